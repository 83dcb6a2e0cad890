"""What the goodput guard saw, bucket by bucket: one `auto` engine runs the prompts as one continuous
batch of at most --batch requests, and every decode-only step the guard judged is logged with its
bucket (requests decoding, context), its say, what it verified, its seconds, its emitted tokens and
the step-cost model's prediction of its plain time. Per bucket: the steps kept plain, those that
verified drafts, and those that asked the drafters and verified nothing, each as steps, measured
milliseconds per emitted token, tokens a step, and measured over predicted plain time (the units the
guard judges in: a plain step's should be near 1); and how often a drafter went off or on there.

    python benchmarks/guard_buckets.py --dataset sharegpt --prompts 48 --batch 4
    python benchmarks/guard_buckets.py --learn-drafting-only   # the step-cost model taught only by
                                                               # steps that asked the drafters (before session 31)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def add_workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The options `auto_engine_and_prompts` reads."""
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)


def auto_engine_and_prompts(a: argparse.Namespace) -> tuple[Any, list[str]]:
    """An `auto` engine on --model (default: the bundled one) taking --batch requests at a time,
    and --prompts prompts of --dataset under its chat template; torch on --threads threads."""
    from specserve import LLM
    from specserve.bench.spec import chat_prompts, open_dataset

    torch.set_num_threads(a.threads)
    kw: dict[str, Any] = {"model": a.model} if a.model else {}
    llm = LLM(speculative=dict(method="auto"), threads=a.threads, max_num_seqs=a.batch, **kw)
    tok = llm.tokenizer
    return llm, chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, tok)


def learn_drafting_only(speculator: Any) -> None:
    """The speculator's step-cost model taught only by the steps that asked the drafters (its
    rule before session 31): a step kept plain leaves it as it was."""
    learn = speculator._learn
    controller = speculator.controller

    def _learn(step: Any, seconds: float) -> None:
        if step.predicted_seconds is not None:
            return learn(step, seconds)
        keep = controller.learn
        controller.learn = lambda shape, seconds: None
        try:
            return learn(step, seconds)
        finally:
            controller.learn = keep

    speculator._learn = _learn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(ap)
    ap.add_argument("--learn-drafting-only", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import SamplingParams
    from specserve.speculation.guard import Mode

    llm, prompts = auto_engine_and_prompts(a)
    speculator = llm.engine.core.speculator
    if a.learn_drafting_only:
        learn_drafting_only(speculator)
    guard = speculator.guard
    steps: list[dict[str, Any]] = []
    flips: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # bucket -> [went off, came on]
    record = guard.record_step

    def record_step(shape, modes, step_no, drafted_by, seconds, tokens, rows, judged=True, expected=None):
        before = {k: b.off for k, b in guard._buckets.items()}
        record(shape, modes, step_no, drafted_by, seconds, tokens, rows, judged, expected)
        for k, b in guard._buckets.items():
            if k in before and before[k] != b.off:
                flips[str(shape)][0 if b.off else 1] += 1
        kind = ("drafted" if drafted_by else
                "plain" if all(m is Mode.PLAIN for m in modes.values()) else "asked")
        steps.append(dict(bucket=str(shape), kind=kind, seconds=seconds, tokens=tokens, expected=expected))

    guard.record_step = record_step
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    elapsed = time.perf_counter() - start
    emitted = sum(len(o.token_ids) for o in outs)
    print(f"{a.dataset}, {len(prompts)} prompts, batch {a.batch}: {emitted / elapsed:.1f} tok/s"
          f"{' (cost model taught by drafting steps only)' if a.learn_drafting_only else ''}")
    report: dict[str, Any] = {}
    for bucket in sorted({s["bucket"] for s in steps}):
        row: dict[str, Any] = {"went_off": flips[bucket][0], "came_on": flips[bucket][1]}
        for kind in ("plain", "drafted", "asked"):
            sel = [s for s in steps if s["bucket"] == bucket and s["kind"] == kind]
            if not sel:
                continue
            tokens = sum(s["tokens"] for s in sel)
            ratios = [s["seconds"] / s["expected"] for s in sel if s["expected"]]
            row[kind] = dict(steps=len(sel), ms_per_token=round(1e3 * sum(s["seconds"] for s in sel) / tokens, 3),
                             tokens_per_step=round(tokens / len(sel), 2),
                             measured_over_predicted=round(statistics.median(ratios), 3) if ratios else None)
        report[bucket] = row
        print(f"bucket {bucket}: " + "; ".join(
            f"{k} {v['steps']} steps, {v['ms_per_token']} ms/token, {v['tokens_per_step']} tokens a step, "
            f"x{v['measured_over_predicted']} predicted" for k, v in row.items() if isinstance(v, dict))
            + f"; off {row['went_off']}, on {row['came_on']}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "tok_s": emitted / elapsed, "buckets": report}, indent=1))


if __name__ == "__main__":
    main()
