"""The trees `auto` verified, by the drafter that proposed them: how many, their nodes, the nodes
accepted, what the acceptance model predicted of them (before the calibration factor), and each
drafter's calibration factor at the end. Where `auto` trails its best drafter, this says whether
its choice between trees is what costs.

    python benchmarks/verified_trees.py --dataset spec-bench --prompts 2 --batch 1 --json trees.json

`--prompts` is per category for Spec-Bench. `--auto-methods` sets `auto`'s lookups
(`spec_config.AUTO_METHODS`). Session 39, bundled model, Spec-Bench, batch 1, `auto` with suffix and
ngram as it then was (`--auto-methods suffix,ngram`): ngram's 193 trees 3.18 nodes for 0.60 accepted
(calibration 0.55), suffix's 256 trees 2.47 for 1.33.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch


def main() -> None:
    from guard_variants import add_common_arguments, chat_prompts  # beside this file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    ap.set_defaults(prompts=2, batch=1, dataset="spec-bench")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--auto-methods", default=None, help="auto's lookups, comma-separated (default: as shipped)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specserve.speculation.config as spec_config
    from specserve import LLM, SamplingParams

    if a.auto_methods:  # read when the engine builds its drafters
        spec_config.AUTO_METHODS = tuple(a.auto_methods.split(","))
    llm = LLM(a.model, max_num_seqs=a.batch, speculative={"method": a.method})
    speculator = llm.engine.core.speculator
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])  # trees, nodes, accepted, predicted
    learn = speculator._learn

    def counting(step, seconds) -> None:
        for row in step.rows.values():
            d = row.drafted
            if d is not None and row.ok:
                t = totals[d.name]
                t[0] += 1
                t[1] += len(d.tree)
                t[2] += sum(1 for n in row.verdict.accepted if n < len(d.tree))
                t[3] += d.predicted
        learn(step, seconds)

    speculator._learn = counting  # type: ignore[method-assign]
    prompts = chat_prompts(a, llm.tokenizer)
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    result = {"model": a.model, "dataset": a.dataset, "prompts": len(prompts), "batch": a.batch, "method": a.method,
              "drafters": {name: {"trees": int(n), "nodes_per_tree": nodes / n, "accepted_per_tree": acc / n,
                                  "predicted_per_tree": pred / n, "calibration": speculator._calibration.factor(name)}
                           for name, (n, nodes, acc, pred) in totals.items()}}
    for name, r in sorted(result["drafters"].items()):
        print(f"{name:10s} {r['trees']:5d} trees, {r['nodes_per_tree']:.2f} nodes, {r['accepted_per_tree']:.2f} accepted, "
              f"{r['predicted_per_tree']:.2f} predicted, calibration {r['calibration']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
