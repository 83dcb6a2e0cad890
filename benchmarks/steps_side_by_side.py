"""Every step of two engine variants timed side by side in one process: each built twice (A B B A),
the prompts in groups of 4 x --batch run as one continuous batch each, every engine taking each group
in turn (the order reversed every other group, as `auto_drafter_sets.py` does). Per step: requests,
context, prompt tokens, draft nodes verified, the forward's seconds and the whole step's.

Printed per engine: steps by kind (plain decode, drafted decode, with a prompt chunk) and their
seconds; drafted decode steps by requests (how many, nodes a step, their mean time against the
engine's median plain step of as many requests); and the plain decode forward of B over A's
binned by (requests, mean context // 64), with at least 10 steps in a bin.

    python benchmarks/steps_side_by_side.py --a none --b auto --json steps.json
    python benchmarks/steps_side_by_side.py --a auto --b auto:guard.fresh_short_rows=1073741824   # before session 38

A variant is `none`, a --spec method, or either with `:guard.NAME=value` (a field of the lookups'
GuardConfig).

Session 38 (ShareGPT, batch 8, 96 prompts, bundled model): the plain forward the same under `auto`
and `none` at the same rows and context; the drafted 8-row steps, nearly all probes, ~21 ms against
~11 for a plain step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

# one step: (requests, context, prompt tokens, draft nodes, forward s, step s)
Step = tuple[int, int, int, int, float, float]


def main() -> None:
    from guard_variants import add_common_arguments  # beside this file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    ap.set_defaults(prompts=96)
    ap.add_argument("--a", default="none")
    ap.add_argument("--b", default="auto")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts

    def build(variant: str) -> Any:
        method, *settings = variant.split(":")
        llm = LLM(a.model, max_num_seqs=a.batch, speculative=None if method == "none" else {"method": method})
        llm.wait_for_huge_pages()
        guard = llm.engine.core.speculator.guard
        fields = dict(s.removeprefix("guard.").split("=", 1) for s in settings)
        if fields:
            guard.config = dataclasses.replace(guard.config, **{
                k: type(getattr(guard.config, k))(float(v)) for k, v in fields.items()})
        return llm

    names = [f"{a.a}#1", f"{a.b}#1", f"{a.b}#2", f"{a.a}#2"]
    llms = {n: build(n.split("#")[0]) for n in names}
    steps: dict[str, list[Step]] = {n: [] for n in names}
    for n, llm in llms.items():
        record(llm.engine.core, steps[n])
    tok = llms[names[0]].tokenizer
    prompts = chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, tok)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    for n, llm in llms.items():
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
        steps[n].clear()
    seconds = dict.fromkeys(names, 0.0)
    size = 4 * a.batch
    for k, start in enumerate(range(0, len(prompts), size)):
        for n in names if k % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            llms[n].generate(prompts[start:start + size], params, use_tqdm=False)
            seconds[n] += time.perf_counter() - t
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}, "seconds": seconds,
                           "engines": {n: summarize(s) for n, s in steps.items()},
                           "plain_forward_b_over_a": forward_ratio(steps[names[0]] + steps[names[3]],
                                                                   steps[names[1]] + steps[names[2]])}
    out["b_seconds_over_a"] = (seconds[names[1]] + seconds[names[2]]) / (seconds[names[0]] + seconds[names[3]])
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out | {"steps": steps}, indent=1))


def record(core: Any, steps: list[Step]) -> None:
    """Append each step of `core` to `steps`, its forward and its whole time."""
    execute, step = core.runner.execute, core.step
    forward: dict[str, Any] = {}

    def timed_execute(batch: Any, drafts: Any = None, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        result = execute(batch, drafts, *args, **kw)
        forward["s"] = time.perf_counter() - t
        forward["shape"] = (len(batch), sum(it.seq.num_computed_tokens + it.num_new_tokens for it in batch),
                            sum(it.num_new_tokens for it in batch) - len(batch),
                            sum(len(d) for d in (drafts or {}).values()))
        return result

    def timed_step() -> Any:
        forward.clear()
        t = time.perf_counter()
        result = step()
        if forward:
            steps.append((*forward["shape"], forward["s"], time.perf_counter() - t))
        return result

    core.runner.execute = timed_execute
    core.step = timed_step


def summarize(steps: list[Step]) -> dict[str, Any]:
    plain = [s for s in steps if not s[2] and not s[3]]
    drafted = [s for s in steps if not s[2] and s[3]]
    mixed = [s for s in steps if s[2]]
    median_plain = {r: statistics.median(s[5] for s in plain if s[0] == r) for r in {s[0] for s in plain}}
    by_rows: dict[int, list[Step]] = defaultdict(list)
    for s in drafted:
        by_rows[s[0]].append(s)
    return {
        "steps": len(steps),
        **{kind: {"steps": len(group), "seconds": round(sum(s[5] for s in group), 3)}
           for kind, group in (("plain", plain), ("drafted", drafted), ("with_prompt", mixed))},
        "drafted_by_requests": {r: {"steps": len(g), "nodes_a_step": round(statistics.mean(s[3] for s in g), 1),
                                    "ms": round(1e3 * statistics.mean(s[5] for s in g), 2),
                                    "plain_ms": round(1e3 * median_plain[r], 2) if r in median_plain else None}
                                for r, g in sorted(by_rows.items())},
    }


def forward_ratio(a: list[Step], b: list[Step]) -> dict[str, Any]:
    """Plain decode steps' forward, B's median over A's, by (requests, mean context // 64)."""
    def bins(steps: list[Step]) -> dict[tuple[int, int], list[float]]:
        out: dict[tuple[int, int], list[float]] = defaultdict(list)
        for rows, context, prompt, nodes, fwd, _ in steps:
            if not prompt and not nodes:
                out[rows, context // rows // 64].append(fwd)
        return out

    ba, bb = bins(a), bins(b)
    ratios = {k: (statistics.median(bb[k]) / statistics.median(ba[k]), len(bb[k]))
              for k in sorted(set(ba) & set(bb)) if len(ba[k]) >= 10 and len(bb[k]) >= 10}
    weight = sum(n for _, n in ratios.values())
    return {"by_bin": {f"{k[0]} requests, context bin {k[1]}": round(r, 3) for k, (r, _) in ratios.items()},
            "weighted": round(sum(r * n for r, n in ratios.values()) / weight, 3) if weight else None}


if __name__ == "__main__":
    main()
