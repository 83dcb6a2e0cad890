"""Python's cyclic garbage collections during a batch run, by generation: how many, their seconds,
the longest; with --freeze, with the heap frozen (`gc.freeze()`) once the engine is built.

    python benchmarks/gc_pauses.py --spec auto --prompts 64 --batch 8
    python benchmarks/gc_pauses.py --spec auto --prompts 64 --batch 8 --freeze

(Session 18's JSONs came from 5595c65, whose engine froze the heap once built, and `--thaw`, which
undid it; the freeze was reverted in the same session. Since session 19 `LLM` freezes the imports'
objects once per process before it builds anything: `frozen_at_start` counts them. BENCHMARKS.md.)
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="auto", help="a --spec method, or none")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--freeze", action="store_true", help="freeze the heap once the engine is built")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts

    torch.set_num_threads(a.threads)
    llm = LLM(a.model, max_num_seqs=a.batch, speculative=None if a.spec == "none" else dict(method=a.spec))
    if a.freeze:
        gc.freeze()
    frozen = gc.get_freeze_count()
    prompts = chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    pauses: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(timed)
    start = time.perf_counter()
    for i in range(0, len(prompts), a.batch):
        llm.generate(prompts[i:i + a.batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    gc.callbacks.remove(timed)
    by_gen = {}
    for gen in sorted({g for g, _ in pauses}):
        times = [s for g, s in pauses if g == gen]
        by_gen[gen] = {"collections": len(times), "seconds": round(sum(times), 4), "longest_ms": round(1e3 * max(times), 2)}
    result = {"seconds": round(seconds, 2), "frozen_at_start": frozen,
              "tracked_after": len(gc.get_objects()), "by_generation": by_gen}
    print(json.dumps(result, indent=1))
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "args": {k: str(v) for k, v in vars(a).items()}, **result}, indent=1))


if __name__ == "__main__":
    main()
