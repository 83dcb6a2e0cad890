"""Per drafter, what the acceptance model predicted of the trees verified for it against what
they got (accepted nodes), at batch 1: under `auto` each request's tree is the drafter's whose
predicted value is highest, so the tree verified is the one likeliest overestimated.

    python benchmarks/acceptance_calibration.py --spec auto --per-category 3
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="auto")
    ap.add_argument("--dataset", default="spec-bench")
    ap.add_argument("--dataset-path", type=Path)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts

    torch.set_num_threads(a.threads)
    llm = LLM(a.model, max_num_seqs=1, speculative=dict(method=a.spec))
    sp = llm.engine.speculator
    by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # trees, predicted, accepted, nodes
    learn = sp._learn

    def counting(step: Any, seconds: float) -> None:
        for r in step.rows.values():
            d = r.drafted
            if d is not None and r.ok:
                row = by[d.name]
                row[0] += 1
                row[1] += d.predicted
                row[2] += sum(1 for n in r.verdict.accepted if n < len(d.tree))
                row[3] += len(d.tree)
        learn(step, seconds)

    sp._learn = counting
    prompts = chat_prompts(open_dataset(a.dataset, a.dataset_path), a.per_category, a.max_tokens, llm.tokenizer)
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    rows = {name: {"trees": t, "nodes": n, "predicted": round(p, 1), "accepted": acc,
                   "accepted_over_predicted": round(acc / p, 3) if p else None}
            for name, (t, p, acc, n) in sorted(by.items())}
    print(json.dumps({"questions": len(prompts), "drafters": rows}, indent=1))
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "args": {k: str(v) for k, v in vars(a).items()},
                                      "questions": len(prompts), "drafters": rows}, indent=1))


if __name__ == "__main__":
    main()
