"""The goodput guard's reference, side by side in one process: engines without speculation, with
`auto` (each step with drafting on judged against the step-cost model's prediction of its own plain
time), with `auto` whose guard is given no prediction (judged against the shape's plain steps, as
before session 16), and with `auto` whose guard keeps every step plain (speculation's bookkeeping
alone: the floor). Every engine takes each static group of --batch prompts in turn, the order
alternating group by group, so that a machine whose speed drifts favours none; `none-again` is a
second engine without speculation, the run's noise.

    python benchmarks/guard_reference.py --prompts 64 --batch 8 --runs 3 --json benchmarks/guard_reference_zen5_s16_cpu.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from guard_variants import add_common_arguments, run_all  # beside this script

CONFIGS = ("none", "auto", "auto-plain-reference", "auto-kept-plain", "none-again")


def build(name: str, model: str, batch: int) -> Any:
    from specserve import LLM
    from specserve.speculation.guard import Mode

    llm = LLM(model, max_num_seqs=batch, speculative=None if name.startswith("none") else dict(method="auto"))
    guard = llm.engine.core.speculator.guard
    if name == "auto-plain-reference":
        record = guard.record_step
        guard.record_step = lambda *a, expected=None, **k: record(*a, **k)  # no predicted plain time
    elif name == "auto-kept-plain":
        guard.modes = lambda shape, drafters, step_no, requests=frozenset(): dict.fromkeys(drafters, Mode.PLAIN)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    ap.add_argument("--runs", type=int, default=3, help="fresh engines each run")
    a = ap.parse_args()
    a.continuous, a.own_weights = False, True  # static groups of --batch; each engine its own weights (as recorded)
    runs = run_all(a, lambda: {name: build(name, a.model, a.batch) for name in CONFIGS})
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
