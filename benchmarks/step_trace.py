"""Where a batch's time goes under `auto`, step by step, beside plain decoding in the same process:
every step of `auto` classified by what it did (prefill chunk in it; verified drafts of a model
drafter, of a lookup; asked the drafters and verified nothing; kept plain by the guard, a probe),
with its seconds, the seconds of proposing and of a draft model's catching up inside them, its
predicted plain time and the tokens it emitted. Then, per class, seconds per emitted token against
the plain engine's, and the time the class cost beyond what its tokens take plain: the loss (or
gain) of `auto` against `none` split by where it came from.

    python benchmarks/step_trace.py --model $M --draft-model $D --dataset sharegpt --prompts 32 --batch 8 --json t.json

The instrumentation wraps `Speculator.observe` from outside (nothing in the engine changes). A
plain engine runs first and a fresh one last (their mean is the reference; the two say the run's
drift); each engine runs the prompts once, so none of them reads another run's prompts from its
prefix cache.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def classify(step: Any, prefill: bool) -> str:
    """A step's class from the speculator's record of it (`_Step`) and whether the engine's batch
    carried prompt tokens (`prefill`)."""
    drafted = sorted({r.drafted.name for r in step.rows.values() if r.drafted is not None})
    modes = step.guard[1] if step.guard is not None else {}
    if prefill:
        kind = "prefill"
    elif drafted:
        kind = "drafted:" + "+".join(drafted)
    elif modes and all(m.value == "plain" for m in modes.values()):
        kind = "guard-plain"
    else:
        kind = "asked-nothing"
    if any(m.value == "probe" for m in modes.values()):
        kind += ":probe"
    return kind


def instrument(sp: Any, log: list[dict[str, Any]], batch: dict[str, int]) -> None:
    """Log each step the speculator observes; `batch` holds the engine's current step's make-up
    (`time_steps`)."""
    observe = sp.observe

    def traced_observe(seconds: float) -> None:
        step = sp._step
        tokens = sum(len(r.verdict.tokens) for r in step.rows.values() if r.verdict is not None)
        log.append(dict(kind=classify(step, batch.get("prompt_tokens", 0) > 0), seconds=seconds, rows=len(step.rows), tokens=tokens,
                        propose=step.propose_seconds, catch_up=step.catch_up_seconds,
                        plain=step.plain_seconds,
                        nodes=sum(len(r.drafted.tree) for r in step.rows.values() if r.drafted is not None)))
        observe(seconds)

    sp.observe = traced_observe


def time_steps(core: Any, log: list[dict[str, Any]], current: dict[str, int] | None = None) -> None:
    """Wrap the engine core's step body so that each step appends its seconds and its make-up:
    prompt tokens computed, decoding requests (both engines alike); `current` is told the make-up
    before the step runs."""
    inner = core._step

    def timed(batch: Any) -> Any:
        # read before the step: a prompt's last chunk has its prompt computed after it
        decodes = sum(1 for it in batch if it.seq.num_computed_tokens >= it.seq.num_prompt_tokens)
        make_up = dict(decodes=decodes, prompt_tokens=sum(it.num_new_tokens for it in batch) - decodes)
        if current is not None:
            current.update(make_up)
        start = time.perf_counter()
        try:
            return inner(batch)
        finally:
            log.append(dict(seconds=time.perf_counter() - start, **make_up))

    core._step = timed


def by_make_up(log: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Steps with prompt tokens and decode-only steps: their count, seconds, prompt tokens, decodes."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in log:
        b = out["prefill" if s["prompt_tokens"] else "decode"]
        b["steps"] += 1
        b["seconds"] += s["seconds"]
        b["prompt_tokens"] += s["prompt_tokens"]
        b["decodes"] += s["decodes"]
    return {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in out.items()}


def run(llm: Any, prompts: list[str], params: Any) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=32, help="per category where the dataset has them")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts

    torch.set_num_threads(a.threads)
    plain = LLM(a.model, max_num_seqs=a.batch)
    llm = LLM(a.model, max_num_seqs=a.batch, speculative=dict(method="auto", draft_model=a.draft_model))
    prompts = chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    plain2 = LLM(a.model, max_num_seqs=a.batch)
    for engine in (plain, llm, plain2):
        engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    log: list[dict[str, Any]] = []
    current: dict[str, int] = {}
    instrument(llm.engine.core.speculator, log, current)
    plain_steps: list[dict[str, Any]] = []
    auto_steps: list[dict[str, Any]] = []
    plain2_steps: list[dict[str, Any]] = []
    time_steps(plain.engine.core, plain_steps)
    time_steps(llm.engine.core, auto_steps, current)
    time_steps(plain2.engine.core, plain2_steps)
    none1 = run(plain, prompts, params)
    auto = run(llm, prompts, params)
    none2 = run(plain2, prompts, params)
    none_s = (none1[0] + none2[0]) / 2
    per_token = none_s / none1[1]  # plain's seconds per emitted token, prefill included
    decode_steps = [s for s in log if s["kind"] != "prefill"]
    by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in log:
        b = by[s["kind"]]
        for k in ("seconds", "tokens", "propose", "catch_up", "nodes"):
            b[k] += s[k]
        b["steps"] += 1
        b["predicted_plain_tokens"] += s["rows"] if s["kind"] != "prefill" else 0
    # the plain step's seconds per row at decode, from the guard-plain steps' own time (the same engine)
    gp = [s for s in decode_steps if s["kind"] == "guard-plain"]
    plain_row = sum(s["seconds"] for s in gp) / max(sum(s["rows"] for s in gp), 1)
    summary: dict[str, Any] = {}
    for kind, b in sorted(by.items(), key=lambda kv: -kv[1]["seconds"]):
        row = {k: round(v, 3) for k, v in b.items()}
        if kind != "prefill":
            # what the step's emitted tokens would have cost as plain rows (guard-plain steps' rate)
            row["excess_s"] = round(b["seconds"] - b["tokens"] * plain_row, 2)
            row["ms_per_token"] = round(1e3 * b["seconds"] / max(b["tokens"], 1), 2)
        summary[kind] = row
    result = dict(none_seconds=[round(none1[0], 2), round(none2[0], 2)], auto_seconds=round(auto[0], 2),
                  tokens=dict(none=none1[1], auto=auto[1]), speedup=round(none_s / auto[0], 3),
                  plain_ms_per_token_all=round(1e3 * per_token, 2),
                  guard_plain_ms_per_row=round(1e3 * plain_row, 2), classes=summary,
                  make_up=dict(none1=by_make_up(plain_steps), auto=by_make_up(auto_steps),
                               none2=by_make_up(plain2_steps)))
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(dict(args=vars(a) | {"json": str(a.json)}, result=result, steps=log)) + "\n")


if __name__ == "__main__":
    main()
