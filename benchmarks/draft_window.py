"""How much of a long prompt a draft model should read (`draft_window`): `auto` with the draft model
at each window given, beside plain decoding twice (`none`, `none-again`: the run's noise), on
Spec-Bench's long-prompt categories, every engine taking each prompt in turn (greedy,
`--max-tokens`, ignore_eos). The first question of each category is skipped by default (`--skip 1`):
it is the one the served comparisons (`vs_llamacpp.py`, `bench spec --per-category 1`) use.

    python benchmarks/draft_window.py --target $M --draft $D --windows 0,512,256,128 \
        --categories rag,summarization --per-category 3 --json out.json

A window of 0 reads every prompt whole.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--windows", default="0,256", help="draft_window values, comma-separated (0: whole prompt)")
    ap.add_argument("--categories", default="rag,summarization")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--skip", type=int, default=1, help="questions skipped at the start of each category")
    ap.add_argument("--method", default="auto", help="the drafting method beside the draft model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import SampleSpec, open_dataset

    from draft_variants import summarize  # benchmarks/, this script's directory

    windows = [int(w) for w in a.windows.split(",")]
    engines = {"none": LLM(a.target, threads=a.threads)}
    for w in windows:
        engines[f"window={w or 'all'}"] = LLM(a.target, threads=a.threads, speculative=dict(
            method=a.method, draft_model=a.draft, draft_window=w or None))
    engines["none-again"] = LLM(a.target, threads=a.threads)

    cats = a.categories.split(",")
    spec = SampleSpec(per_category=a.per_category + a.skip, output_len=a.max_tokens)
    seen: dict[str, int] = {}
    samples = []
    for x in open_dataset("spec-bench", None).sample(spec).samples:
        if x.category in cats:
            seen[x.category] = seen.get(x.category, 0) + 1
            if seen[x.category] > a.skip:
                samples.append(x)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    totals = {name: dict(seconds=0.0, tokens=0, accepted=0, drafted_steps=0) for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    per_request: list[dict] = []
    for x in samples:
        row: dict = {"category": x.category}
        for name, llm in engines.items():
            t = time.perf_counter()
            o = llm.chat([{"role": "user", "content": x.prompt}], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t
            tot = totals[name]
            tot["seconds"] += seconds
            tot["tokens"] += len(o.token_ids)
            outputs[name].append(list(o.token_ids))
            row["prompt_tokens"] = len(o.prompt_token_ids)
            row[name] = round(len(o.token_ids) / seconds, 1)
            if o.metrics.speculation is not None:
                tot["accepted"] += o.metrics.speculation.accepted
                tot["drafted_steps"] += o.metrics.speculation.steps
        per_request.append(row)
        print(json.dumps(row), flush=True)
    result = summarize(totals, outputs)
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "result": result,
                                      "per_request": per_request}, indent=1) + "\n")


if __name__ == "__main__":
    main()
