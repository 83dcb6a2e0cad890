"""Transparent huge pages for the weights, tried: PyTorch's CPU allocator asks for them
(madvise(MADV_HUGEPAGE) on allocations of 2 MB and more) when THP_MEM_ALLOC_ENABLE=1. Each
process loads the model and decodes --tokens greedy tokens at batch 1, three times; the processes
alternate without and with the setting, --pairs times. Prints and records each process's load
time, decode tok/s (median of its three) and the huge pages it holds.

    python benchmarks/hugepages.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf --pairs 5 \\
        --json benchmarks/hugepages_1p5b_zen5_s16_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(2)
from specserve import LLM, SamplingParams
t = time.perf_counter()
llm = LLM(sys.argv[1])
load = time.perf_counter() - t
params = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0, ignore_eos=True)
prompt = "Write a long story about a dragon."
llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
rates = []
for _ in range(3):
    t = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)
    rates.append(len(out[0].token_ids) / (time.perf_counter() - t))
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(json.dumps({"load_s": load, "tok_s": statistics.median(rates), "anon_huge": huge[0].split(":")[1].strip() if huge else "?"}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    runs: list[dict[str, object]] = []
    for p in range(a.pairs):
        for thp in ("0", "1"):
            env = dict(os.environ, THP_MEM_ALLOC_ENABLE=thp)
            line = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.tokens)], env=env, capture_output=True,
                                  text=True, check=True).stdout.strip().splitlines()[-1]
            row = dict(json.loads(line), pair=p, thp=thp == "1")
            runs.append(row)
            print(row, flush=True)
    ratios = [b["tok_s"] / a_["tok_s"] for a_, b in zip(runs[::2], runs[1::2])]  # type: ignore[operator]
    summary = {"decode_with_over_without_median": round(statistics.median(ratios), 3),
               "faster_pairs": sum(r > 1 for r in ratios), "pairs": len(ratios),
               "load_s_without": [round(r["load_s"], 2) for r in runs if not r["thp"]],  # type: ignore[arg-type]
               "load_s_with": [round(r["load_s"], 2) for r in runs if r["thp"]]}  # type: ignore[arg-type]
    print(summary)
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
