"""`auto` with a draft model beside its lookups against `auto` with the lookups alone, request by
request, and where the draft model's time goes: Spec-Bench questions (by default the second and
third of each category: the first is the one the served comparisons use), greedy, `--max-tokens`
with ignore_eos, every engine taking each prompt in turn (the order reversed every other prompt),
beside plain decoding twice (`none`, `none-again`: the run's noise).

For each engine with a draft model: the seconds it spent catching up (`Drafter.catch_up_seconds`)
and proposing, the steps that verified its chains and their accepted tokens. `--catch-up-share`
sets `Speculator.CATCH_UP_SHARE` (of the drafts' expected saving) for an extra engine (`inf`: the draft model runs whatever its
catch-up costs, as before session 22).

    python benchmarks/draft_beside_lookups.py --target $M --draft $D --skip 1 --per-category 2 \\
        --catch-up-share inf --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def instrument(llm: Any) -> Counter:
    """Counts of the engine's steps from now on: seconds, propose and catch-up seconds, and per
    drafter the steps that verified its tree and their accepted tokens."""
    sp = llm.engine.core.speculator
    learn = sp._learn
    counts: Counter = Counter()

    def counted(step: Any, seconds: float) -> None:
        counts["steps"] += 1
        counts["propose_s"] += step.propose_seconds
        counts["catch_up_s"] += step.catch_up_seconds
        for r in step.rows.values():
            if r.drafted is not None and r.ok:
                counts[f"{r.drafted.name}_steps"] += 1
                counts[f"{r.drafted.name}_accepted"] += len(r.verdict.accepted)
        return learn(step, seconds)

    sp._learn = counted
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--categories", default=None, help="comma-separated (default: all 13)")
    ap.add_argument("--skip", type=int, default=1, help="questions skipped at the start of each category")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--catch-up-share", type=float, default=None,
                    help="an extra engine with this CATCH_UP_SHARE (inf: no limit)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import SampleSpec, open_dataset

    cats = a.categories.split(",") if a.categories else None
    seen: dict[str, int] = {}
    samples = []
    for x in open_dataset("spec-bench", None).sample(SampleSpec(per_category=a.skip + a.per_category)).samples:
        if cats is None or x.category in cats:
            seen[x.category] = seen.get(x.category, 0) + 1
            if seen[x.category] > a.skip:
                samples.append(x)

    engines = {"none": LLM(a.target, threads=a.threads),
               "auto": LLM(a.target, threads=a.threads, speculative=dict(method="auto")),
               "auto+draft": LLM(a.target, threads=a.threads, speculative=dict(method="auto", draft_model=a.draft))}
    if a.catch_up_share is not None:
        name = f"auto+draft@share={a.catch_up_share:g}"
        engines[name] = LLM(a.target, threads=a.threads, speculative=dict(method="auto", draft_model=a.draft))
        speculator = engines[name].engine.core.speculator
        if a.catch_up_share == float("inf"):
            speculator._catch_up_unpaid = lambda *args: False
        else:
            speculator.CATCH_UP_SHARE = a.catch_up_share
    engines["none-again"] = LLM(a.target, threads=a.threads)
    counts = {n: instrument(llm) for n, llm in engines.items() if llm.engine.core.speculator.enabled}
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up, and the draft model's first catch-up measured
        llm.chat([{"role": "user", "content": "Write four lines about the sea."}],
                 SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for c in counts.values():
        c.clear()
    totals = {n: [0.0, 0] for n in engines}
    per_request = []
    for i, x in enumerate(samples):
        row: dict[str, Any] = {"category": x.category}
        for n in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            t = time.perf_counter()
            o = engines[n].chat([{"role": "user", "content": x.prompt}], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t
            totals[n][0] += seconds
            totals[n][1] += len(o.token_ids)
            row[n] = round(len(o.token_ids) / seconds, 1)
        per_request.append(row)
        print(json.dumps(row), flush=True)
    base = totals["none"][1] / totals["none"][0]
    result = {}
    for n, (seconds, tokens) in totals.items():
        result[n] = dict(tok_s=round(tokens / seconds, 1), vs_none=round(tokens / seconds / base, 3),
                         seconds=round(seconds, 2), **{k: round(v, 3) for k, v in sorted(counts.get(n, {}).items())})
        print(n, json.dumps(result[n]), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "result": result, "per_request": per_request},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
