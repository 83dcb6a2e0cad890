#!/usr/bin/env bash
# The CUDA path, checked and timed in one go on a GPU machine (run from the repository root):
#   1. builds the package against the PyTorch installed there;
#   2. `specserve bench throughput` on a Llama-3.1-8B shape with random weights in bfloat16,
#      beside transformers generate() on the same shape, and the batch-1 roofline fraction;
#   3. where a step's time goes (benchmarks/gpu_step_profile.py: host against GPU time);
#      VERIFY_COST=1: a forward's time by draft nodes, same shape repeated, with profiler traces
#      (benchmarks/gpu_verify_cost.py); SPEC_STEPS=1,8,32: plain against `auto` in the engine, each
#      step timed and split by whether it carried drafts (benchmarks/gpu_spec_steps.py);
#   4. the losslessness, batching, sampling and parity tests with every engine on the GPU
#      (SPECSERVE_TEST_DEVICE=cuda, tests/conftest.py): greedy equivalence of every drafter,
#      the exact-distribution checks, batch invariance.
# OUT (default ./gpu_out) receives the logs and the JSON. Wheels for packages the machine lacks
# can be put in .whl/ (installed into /tmp/site first).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
lscpu | grep -m1 'Model name' | tee -a "$OUT/gpu.txt"

start=$(date +%s)
MAX_JOBS=16 $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"; rm -f "$OUT/build.log"

# SPECS: the --spec values to time, one `bench throughput` each (the first one also times transformers
# unless NO_TRANSFORMERS is set); the JSON of each lands in $OUT/throughput_<spec>.json.
specs=${SPECS:-none}
for spec in $specs; do
  [ -n "${SKIP_THROUGHPUT:-}" ] && break
  start=$(date +%s)
  extra=()
  { [ -n "${NO_TRANSFORMERS:-}" ] || [ "$spec" != "${specs%% *}" ]; } && extra+=(--no-transformers)
  $PY -c "from specserve.cli import main; main()" bench throughput --device cuda --dtype bfloat16 \
    --load-format dummy --model "${SHAPE:-llama-3.1-8b}" --batch-sizes "${BATCHES:-1,4,16,32}" \
    --max-tokens "${MAX_TOKENS:-128}" --repeats "${REPEATS:-3}" --spec "$spec" "${extra[@]}" \
    --json "$OUT/throughput_$spec.json" 2>&1 | grep -v '^\s*$' | tail -12
  echo "throughput --spec $spec: $(( $(date +%s) - start )) s"
done

start=$(date +%s)
[ -n "${SKIP_PROFILE:-}" ] || { $PY benchmarks/gpu_step_profile.py --model "${SHAPE:-llama-3.1-8b}" --batch-sizes 1,32 \
  --json "$OUT/step_profile.json" >"$OUT/step_profile.log" 2>&1
  echo "step profile: rc=$? in $(( $(date +%s) - start )) s"; grep '^{' "$OUT/step_profile.log"; }

if [ -n "${VERIFY_COST:-}" ]; then
  start=$(date +%s)
  $PY benchmarks/gpu_verify_cost.py --model "${SHAPE:-llama-3.1-8b}" --batches "${VERIFY_BATCHES:-1,8,32}" \
    --trace-dir "$OUT" --json "$OUT/verify_cost.json" 2>&1 | grep -v USDT
  echo "verify cost: $(( $(date +%s) - start )) s"
fi
if [ -n "${SPEC_STEPS:-}" ]; then
  start=$(date +%s)
  # SPEC_STEPS_ARGS: more options, e.g. "--interleave --profile-dir $OUT" (both engines in one process)
  $PY benchmarks/gpu_spec_steps.py --model "${SHAPE:-llama-3.1-8b}" --batches "$SPEC_STEPS" --spec "${SPEC:-auto}" \
    --json "$OUT/spec_steps.json" ${SPEC_STEPS_ARGS:-} 2>&1 | grep -v USDT
  echo "spec steps: $(( $(date +%s) - start )) s"
fi

start=$(date +%s)
[ "${TEST_TIMEOUT:-240}" = 0 ] || SPECSERVE_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
  tests/test_spec_decoding.py tests/test_batching.py tests/test_sampling.py tests/test_model_parity.py \
  tests/test_lossless_mutations.py tests/test_eagle.py tests/test_measured_speculation.py \
  >"$OUT/tests.log" 2>&1
echo "tests on cuda: rc=$? in $(( $(date +%s) - start )) s"; tail -60 "$OUT/tests.log"

