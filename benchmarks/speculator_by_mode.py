"""The speculator's own time per step by what the goodput guard said of the step (plain, draft,
probe), beside plain decoding's: what speculation costs where it is switched off.

    python benchmarks/speculator_by_mode.py        # bundled model, ShareGPT, batch 8, 32 prompts, two rounds

Prints, per engine and guard mode, the mean and median microseconds of the speculator's
propose, verify and observe (perf_counter around each call; no profiler).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any


def guard_say(sp: Any) -> str:
    """What the guard said of the step just proposed: probe if it probes a drafter, draft if any may
    draft, plain if none may; unjudged where it did not judge the step (a prompt chunk in it, or no
    speculation)."""
    judged = sp._step.guard
    if judged is None:
        return "unjudged"
    modes = {m.value for m in judged[1].values()}
    return "probe" if "probe" in modes else "draft" if "draft" in modes else "plain"


def main() -> None:
    from speculator_overhead import engines_and_prompts, run_rounds, workload_args  # beside this file

    a = workload_args(__doc__)
    llms, prompts = engines_and_prompts(a)
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
                        mode[0] = guard_say(sp)
                    rec[(mode[0], method)].append(dt)
            return call

        for method in ("propose", "verify", "observe"):
            setattr(sp, method, timed(method, getattr(sp, method)))
    run_rounds(llms, prompts, a)
    for name, rec in seconds.items():
        print(name)
        for (mode, method), xs in sorted(rec.items()):
            print(f"  {mode:6s} {method:8s} steps {len(xs):5d}  mean {statistics.mean(xs) * 1e6:7.0f} us"
                  f"  median {statistics.median(xs) * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
