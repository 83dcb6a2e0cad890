"""Prefill throughput of the bundled model: 4 prompts of random tokens of each length, one new
token each, median of 3 timed runs after a warm-up.

    python benchmarks/prefill.py [--quantization auto|none|int8|int4]
"""

from __future__ import annotations

import argparse
import time

import torch

from specserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--lengths", default="128,512,1024")
    a = ap.parse_args()
    llm = LLM("smollm2-135m", quantization=a.quantization)
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1)
    for n in map(int, a.lengths.split(",")):
        def batch() -> list[list[int]]:
            return [torch.randint(100, 40000, (n,), generator=g).tolist() for _ in range(4)]

        llm.generate(batch()[:1], one, use_tqdm=False)
        times = []
        for _ in range(3):
            prompts = batch()
            start = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            times.append(time.perf_counter() - start)
        print(f"{a.quantization:>5} prompt {n:5d} tokens: {4 * n / sorted(times)[1]:7.0f} tok/s prefill")


if __name__ == "__main__":
    main()
