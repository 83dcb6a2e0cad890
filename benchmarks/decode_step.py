"""Steady-state decode step time of the bundled model at batch 1, 8 and 32 (Spec-Bench chat prompts).

    python benchmarks/decode_step.py [--profile]

Prefills the first N prompts, then times 20 decode steps and prints the median.
"""

from __future__ import annotations

import sys
import time

from specserve import LLM, SamplingParams
from specserve.bench.throughput import load_spec_bench_prompts
from specserve.tokenizer import apply_chat_template


def main() -> None:
    llm = LLM()
    engine = llm.engine
    texts = load_spec_bench_prompts(None, 32)
    prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for b in (1, 8, 32):
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in prompts[:b]]
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        prefill = time.perf_counter() - start
        times = []
        for _ in range(20):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        step = sorted(times)[10]
        print(f"batch {b:2d}: prefill {prefill:.2f} s, decode step {step * 1e3:.1f} ms -> {b / step:.1f} tok/s")
        for rid in ids:
            engine.abort_request(rid)
    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile

        for p in prompts[:32]:
            engine.add_request(p, params)
        for _ in range(10):
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
