"""How well the step-cost model predicts steps, replayed on logged ones: `record` runs one `auto`
engine over a dataset as one continuous batch and logs every step the model learns from (its
shape, measured seconds, decoding requests and verified draft nodes) with the start-up probes;
`replay` feeds the logged steps, in order, to a fresh `StepCostModel` of the code it runs from,
predicting each before learning it, and prints the relative error (mean, and mean absolute) of
plain steps and of steps that verified drafts. Run `replay` from a worktree of an older commit to
compare models on the same steps.

    python benchmarks/cost_model_replay.py record --dataset sharegpt --batch 4 --out steps_sharegpt_b4.json
    python benchmarks/cost_model_replay.py replay steps_sharegpt_b4.json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from guard_buckets import add_workload_arguments, auto_engine_and_prompts  # beside this file


def record(a: argparse.Namespace) -> None:
    from specserve import SamplingParams

    llm, prompts = auto_engine_and_prompts(a)
    speculator = llm.engine.core.speculator
    cost = speculator.controller.cost
    steps: list[list[float]] = []
    made: dict[str, int] = {}
    learn_step, learn = speculator._learn, speculator.controller.learn

    def _learn(step: Any, seconds: float) -> None:  # the step's requests and verified nodes
        made["rows"] = len(step.rows)
        made["nodes"] = sum(len(r.drafted.tree) for r in step.rows.values() if r.drafted is not None)
        learn_step(step, seconds)

    def _learn_cost(shape: Any, seconds: float) -> None:
        steps.append([shape.tokens, shape.drafted, shape.attended, shape.hot, seconds, made["rows"], made["nodes"]])
        learn(shape, seconds)

    speculator._learn, speculator.controller.learn = _learn, _learn_cost
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    a.out.write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(a).items()},
        "profile": dict(zip(cost.profile.sizes, cost.profile.seconds)), "per_context": cost.context,
        "per_attended": cost.attention,
        "steps (tokens, drafted, attended, hot, seconds, decoding requests, verified nodes)": steps}))
    print(f"{len(steps)} steps -> {a.out}")


def replay(a: argparse.Namespace) -> None:
    from specserve.speculation.controller import ForwardProfile, StepCostModel, StepShape

    for path in a.logs:
        d = json.loads(Path(path).read_text())
        cost = StepCostModel(ForwardProfile({int(k): v for k, v in d["profile"].items()}),
                             per_attended=d["per_attended"], per_context=d["per_context"])
        errors: dict[str, list[float]] = {"plain": [], "drafted": []}
        steps = next(v for k, v in d.items() if k.startswith("steps"))
        for i, (tokens, drafted, attended, hot, seconds, rows, nodes) in enumerate(steps):
            shape = StepShape(int(tokens), int(drafted), int(attended), int(hot))
            if i >= a.skip and tokens == rows + nodes:  # decode-only steps, once the model has seen a few
                errors["drafted" if nodes else "plain"].append((cost.predict(shape) - seconds) / seconds)
            cost.observe(shape, seconds)
        print(f"{Path(path).name}: " + "; ".join(
            f"{k} {len(e)} steps, error mean {statistics.mean(e):+.3f}, mean absolute {statistics.mean(map(abs, e)):.3f}"
            for k, e in errors.items() if e) + f"; weights {[round(w, 5) for w in cost.w]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    add_workload_arguments(r)
    r.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("replay")
    p.add_argument("logs", nargs="+")
    p.add_argument("--skip", type=int, default=30, help="steps before errors are counted")
    a = ap.parse_args()
    record(a) if a.command == "record" else replay(a)


if __name__ == "__main__":
    main()
