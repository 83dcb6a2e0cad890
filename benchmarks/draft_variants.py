"""What a draft model's file costs and buys: for each draft GGUF given (`--draft NAME=PATH`: the same
model quantized differently) and each `--quantizations` (the engine's draft_quantization: q4_0
rounds the projections stored in more bits to Q4_0 at load, file keeps them), a one-token forward
timed against the target's (the engines taking
turns, the median of 15 turns each: a draft token's cost as a share of a target step), then
Spec-Bench's first question of each category (greedy, `--max-tokens`, every engine taking each prompt
in turn) with a fixed budget of K draft tokens a step, beside plain decoding twice (`none` and
`none-again`, the run's noise).

    python benchmarks/draft_variants.py --target $M --draft 0.5b=$D --quantizations file,q4_0 \
        --tokens 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable


def forwards_in_turn(turns: dict[str, Callable[[Any], Any]], item: Any, rounds: int = 15) -> dict[str, float]:
    """Each forward of `turns` run on `item` in turn, `rounds` times: the median milliseconds of each."""
    samples: dict[str, list[float]] = {name: [] for name in turns}
    for _ in range(rounds):
        for name, run in turns.items():
            t = time.perf_counter()
            run(item)
            samples[name].append(time.perf_counter() - t)
    return {name: round(statistics.median(v) * 1e3, 2) for name, v in samples.items()}


def summarize(totals: dict[str, dict], outputs: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Each engine's totals (seconds, tokens, accepted, drafted_steps) with its tokens/s, its ratio
    to `none`'s, its accepted tokens a drafted step and whether its outputs were `none`'s; printed."""
    base = totals["none"]["tokens"] / totals["none"]["seconds"]
    result = {}
    for name, row in totals.items():
        tok_s = row["tokens"] / row["seconds"]
        result[name] = dict(row, tok_s=round(tok_s, 1), vs_none=round(tok_s / base, 3),
                            accepted_per_step=round(row["accepted"] / max(row["drafted_steps"], 1), 3),
                            same_as_none=outputs[name] == outputs["none"])
        print(name, json.dumps(result[name]), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", action="append", required=True, help="NAME=PATH, a draft model's GGUF (repeatable)")
    ap.add_argument("--quantizations", default="q4_0", help="draft_quantization values, comma-separated")
    ap.add_argument("--tokens", type=int, default=3, help="draft tokens a step (fixed controller)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    paths = dict(d.split("=", 1) for d in a.draft)
    drafts = {f"{name}/{q}": (path, q) for name, path in paths.items() for q in a.quantizations.split(",")}
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import SampleSpec, open_dataset
    from specserve.model.forward import ForwardItem

    engines = {"none": LLM(a.target, threads=a.threads)}
    for name, (path, quantization) in drafts.items():
        engines[name] = LLM(a.target, threads=a.threads, speculative=dict(
            method="draft-model", draft_model=path, draft_quantization=quantization, num_tokens=a.tokens,
            controller="fixed"))
    engines["none-again"] = LLM(a.target, threads=a.threads)

    # One-token forwards after 200 cached tokens (made-up block tables: the cached values do not
    # matter for time), the target's and each draft's taken in turn.
    item = [ForwardItem(list(range(14)), 200, [100])]
    turns = {"target": engines["none"].engine.core.runner.run}
    turns.update({name: engines[name].engine.core.speculator.drafters["draft-model"].forward for name in drafts})
    forward_ms = forwards_in_turn(turns, item)
    share = {name: round(forward_ms[name] / forward_ms["target"], 3) for name in drafts}
    print("one-token forward ms:", json.dumps(forward_ms), "share of a target step:", json.dumps(share), flush=True)

    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    totals = {name: dict(seconds=0.0, tokens=0, accepted=0, drafted_steps=0) for name in engines}
    spec = SampleSpec(seed=None, per_category=a.per_category, output_len=a.max_tokens)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for x in open_dataset("spec-bench", None).sample(spec).samples:
        for name, llm in engines.items():
            t = time.perf_counter()
            o = llm.chat([{"role": "user", "content": x.prompt}], params, use_tqdm=False)[0]
            row = totals[name]
            row["seconds"] += time.perf_counter() - t
            row["tokens"] += len(o.token_ids)
            outputs[name].append(list(o.token_ids))
            if o.metrics.speculation is not None:
                row["accepted"] += o.metrics.speculation.accepted
                row["drafted_steps"] += o.metrics.speculation.steps
    result = summarize(totals, outputs)
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "tokens": a.tokens, "drafts": paths,
                                      "forward_ms": forward_ms, "draft_share": share, "result": result},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
