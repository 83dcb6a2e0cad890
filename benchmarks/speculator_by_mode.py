"""The speculator's own time per step by what the goodput guard said of the step (plain, draft,
probe), beside plain decoding's: what speculation costs where it is switched off.

    python benchmarks/speculator_by_mode.py        # bundled model, ShareGPT, batch 8, 32 prompts, two rounds

Prints, per engine and guard mode, the mean and median microseconds of the speculator's
propose, verify and observe (perf_counter around each call; no profiler).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from speculator_overhead import engines_and_prompts  # beside this file

    from specserve import SamplingParams

    llms, prompts = engines_and_prompts(a.model, a.threads, a.prompts, a.max_tokens)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    seconds: dict[str, dict[tuple[str, str], list[float]]] = {name: defaultdict(list) for name in llms}
    for name, llm in llms.items():
        sp = llm.engine.core.speculator
        step_mode = ["draft"]  # the guard's say on the current step, set when propose returns

        def timed(method: str, f: Any, sp: Any = sp, rec: dict = seconds[name], mode: list = step_mode) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return f(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t
                    if method == "propose":
                        mode[0] = sp._mode.value
                    rec[(mode[0], method)].append(dt)
            return call

        for method in ("propose", "verify", "observe"):
            setattr(sp, method, timed(method, getattr(sp, method)))
    for _ in range(a.rounds):
        for i in range(0, len(prompts), a.batch):
            for llm in llms.values():
                llm.generate(prompts[i:i + a.batch], params, use_tqdm=False)
    for name, rec in seconds.items():
        print(name)
        for (mode, method), xs in sorted(rec.items()):
            print(f"  {mode:6s} {method:8s} steps {len(xs):5d}  mean {statistics.mean(xs) * 1e6:7.0f} us"
                  f"  median {statistics.median(xs) * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
