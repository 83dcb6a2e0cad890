"""float32 at batch 1: the loader's choice (since the layer-loop plan is timed at load, whichever of
the per-projection kernels and the native layer loop ran faster there) against native-f32 forced
on every layer projection (the native layer loop); the LM head is left to the tuner either way.
3 Spec-Bench chat prompts, 128 tokens each, after a warm-up.

    python benchmarks/f32_native_loop.py tuned; python benchmarks/f32_native_loop.py native
"""

from __future__ import annotations

import sys
import time

import specserve.model.tuning as tuning
from specserve import LLM, SamplingParams
from specserve.bench.throughput import load_spec_bench_prompts


def force_native_f32() -> None:
    choose = tuning.KernelTuner.choose

    def native_first(self, precision, shape, dtype, factories):  # type: ignore[no-untyped-def]
        if precision == "none" and "native-f32" in factories and shape[0] < 32768:  # not the LM head
            return "native-f32", factories["native-f32"]()
        return choose(self, precision, shape, dtype, factories)

    tuning.KernelTuner.choose = native_first  # type: ignore[method-assign]


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "tuned"
    if mode == "native":
        force_native_f32()
    llm = LLM(quantization="none")
    texts = load_spec_bench_prompts(None, 4)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.chat([{"role": "user", "content": texts[0]}], params, use_tqdm=False)
    for text in texts[1:]:
        start = time.perf_counter()
        llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)
        print(f"{mode}: {128 / (time.perf_counter() - start):.1f} tok/s")


if __name__ == "__main__":
    main()
