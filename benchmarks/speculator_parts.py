"""Where auto's extra step time goes: each part of the speculator timed with perf_counter wrappers
(no profiler: cProfile inflates this Python-heavy code many times over), plain decoding and auto
on the same batches of ShareGPT prompts in one process.

    python benchmarks/speculator_parts.py            # bundled model, ShareGPT, batch 8, 32 prompts, two rounds
    python benchmarks/speculator_parts.py --dataset humaneval --batch 4 --prompts 48 --rounds 1

Prints, per engine, the total seconds spent in each wrapped method over the run.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any


SPECULATOR_PARTS = ("propose", "verify", "observe", "finish", "_grant", "_run_drafters", "_select",
                    "_keep_top_ids", "_tell_drafters", "_sample")
# The suffix drafter's propose, by part: indexing finished outputs, the request's own tokens since it
# last proposed (its whole prompt on the first call), and a request's whole proposal (that indexing,
# then matching and growing a tree in either index).
SUFFIX_PARTS = ("_absorb", "_request_index", "_propose_one")


def wrap(obj: Any, attr: str, totals: dict[str, float], key: str | None = None,
         calls: dict[str, int] | None = None) -> None:
    """Replace obj.attr by a version that adds its wall time to totals[key] (default "Class.attr")
    and, given `calls`, counts its calls there."""
    f = getattr(obj, attr)
    key = key or f"{type(obj).__name__}.{attr}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t
            if calls is not None:
                calls[key] += 1

    object.__setattr__(obj, attr, timed)  # drafters may be frozen dataclasses


def main() -> None:
    from speculator_overhead import engines_and_prompts, run_rounds, workload_args  # beside this file

    a = workload_args(__doc__)
    llms, prompts = engines_and_prompts(a)
    totals: dict[str, dict[str, float]] = {name: defaultdict(float) for name in llms}
    for name, llm in llms.items():
        core, t = llm.engine.core, totals[name]
        wrap(core, "step", t)
        wrap(core.runner, "execute", t)
        sp = core.speculator
        for m in SPECULATOR_PARTS:
            wrap(sp, m, t)
        for drafter in sp.drafters.values():
            for m in ("propose", "observe", "finish") + SUFFIX_PARTS:
                if hasattr(drafter, m):
                    wrap(drafter, m, t)
        wrap(sp.controller, "select", t)
        wrap(sp.verifier, "verify", t)
    run_rounds(llms, prompts, a)
    for name, t in totals.items():
        s = llms[name].engine.core.speculation_stats()
        print(name, f"steps {s.steps}, grants {dict(s.grants)}, accepted {s.accepted}, drafted with {dict(s.drafted_with)},"
              f" guard: plain {s.guard_plain_steps}, probes {s.guard_probes}, turned off {s.guard_turned_off}")
        for key, seconds in sorted(t.items(), key=lambda kv: -kv[1]):
            print(f"  {key:40s} {seconds * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
