"""Where a speculating engine's step time goes on the CPU, step by step: the scheduler, the
speculator's propose / verify / observe, the forward (the runner's execute), the rest; decode-only
steps split by whether they verified draft nodes, and the drafted steps' time against what the same
tokens cost at the same engine's plain rate for that many decoding requests.

    python benchmarks/step_phases.py --spec auto --dataset sharegpt --prompts 32 --batch 8
    python benchmarks/step_phases.py --spec auto --force-plain --random --batch 8   # what speculation costs a plain step

--static runs the prompts in groups of --batch, each group to its end (as `bench spec --batch`);
by default they run as one continuous batch of at most --batch requests. --force-plain makes the
goodput guard keep every step plain (speculation's bookkeeping without drafts).
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

PHASES = (("scheduler", "schedule"), ("speculator", "propose"), ("runner", "execute"), ("speculator", "verify"),
          ("speculator", "observe"), ("core", "_decodes"), ("core", "_finish_row"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="auto", help="a --spec method, or none")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--static", action="store_true", help="groups of --batch, each run to its end")
    ap.add_argument("--random", action="store_true", help="random 200-token prompts, every request to max-tokens")
    ap.add_argument("--force-plain", action="store_true", help="the guard keeps every step plain")
    ap.add_argument("--draft-model", help="for --spec draft-model")
    ap.add_argument("--spec-tokens", type=int, help="the most draft tokens a step (K; default: the engine's)")
    ap.add_argument("--controller", help="goodput or fixed (default: the engine's)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.speculation.guard import Mode

    torch.set_num_threads(a.threads)
    spec: dict[str, Any] = dict(method=a.spec, draft_model=a.draft_model)
    spec.update({k: v for k, v in (("num_tokens", a.spec_tokens), ("controller", a.controller)) if v is not None})
    llm = LLM(a.model, max_num_seqs=a.batch, speculative=None if a.spec == "none" else spec)
    llm.wait_for_huge_pages()
    if a.random:
        vocab = llm.engine.model.config.vocab_size
        prompts = [torch.randint(100, vocab - 100, (200,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(a.prompts)]
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    else:
        from specserve.bench.datasets import open_dataset
        from specserve.bench.spec import chat_prompts

        prompts = chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    core = llm.engine.core
    if a.force_plain:
        if core.speculator.guard is None:
            raise SystemExit("--force-plain: this method has no goodput guard")
        core.speculator.guard.modes = lambda shape, drafters, step_no, requests=frozenset(): dict.fromkeys(
            drafters, Mode.PLAIN)

    cur: dict[str, Any] = defaultdict(float)
    steps: list[dict[str, Any]] = []
    objects = {"scheduler": core.scheduler, "speculator": core.speculator, "runner": core.runner, "core": core}
    for owner, name in PHASES:
        obj = objects[owner]
        fn = getattr(obj, name)

        def timed(*args: Any, fn: Any = fn, name: str = name, **kw: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kw)
            cur[name] += time.perf_counter() - t
            if name == "execute":
                batch, drafts = args[0], args[1] or {}
                cur["nodes"] = sum(len(d) for d in drafts.values())
                cur["requests"] = len(batch)
                cur["prefill"] = sum(it.num_new_tokens for it in batch) - len(batch)
            elif name == "propose":  # whether the guard left a drafter to ask (else the step is plain from the start)
                cur["eligible"] = bool(core.speculator._active)
            return out

        setattr(obj, name, timed)
    step = core.step

    def timed_step() -> Any:
        cur.clear()
        t = time.perf_counter()
        out = step()
        if "execute" in cur:
            steps.append(dict(cur, total=time.perf_counter() - t, tokens=sum(len(o.new_token_ids) for o in out)))
        return out

    core.step = timed_step  # type: ignore[method-assign]
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    steps.clear()
    groups = [prompts[i:i + a.batch] for i in range(0, len(prompts), a.batch)] if a.static else [prompts]
    start, tokens = time.perf_counter(), 0
    for group in groups:
        tokens += sum(len(o.token_ids) for o in llm.generate(group, params, use_tqdm=False))
    seconds = time.perf_counter() - start
    result = summarize(steps, tokens, seconds)
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(dict(args=vars(a) | {"json": str(a.json)}, **result), indent=1))


def summarize(steps: list[dict[str, Any]], tokens: int, seconds: float) -> dict[str, Any]:
    decode = [s for s in steps if s["prefill"] == 0]
    by_requests: dict[int, list[float]] = defaultdict(list)
    for s in decode:
        if s["nodes"] == 0:
            by_requests[s["requests"]].append(s["total"] / s["tokens"])
    plain_rate = {r: statistics.median(v) for r, v in by_requests.items()}  # plain s/token by requests decoding
    lost = gained = 0.0
    judged = 0
    for s in decode:
        if s["nodes"] and s["requests"] in plain_rate:
            d = s["total"] - s["tokens"] * plain_rate[s["requests"]]
            judged += 1
            lost, gained = (lost + d, gained) if d > 0 else (lost, gained - d)
    out: dict[str, Any] = {
        "tok_s": round(tokens / seconds, 1), "steps": len(steps), "decode_only_steps": len(decode),
        "mixed_steps": len(steps) - len(decode), "mixed_drafted": sum(1 for s in steps if s["prefill"] and s["nodes"]),
        "seconds": round(seconds, 3), "outside_forward_s": round(sum(s["total"] - s["execute"] for s in steps), 3),
        "drafted_vs_plain_rate": {"steps": judged, "seconds_lost": round(lost, 3), "seconds_gained": round(gained, 3)},
    }
    groups = (("plain", [s for s in decode if not s["nodes"]]), ("drafted", [s for s in decode if s["nodes"]]),
              # plain steps split: the guard kept them plain, or drafters were asked and nothing was verified
              ("plain_by_guard", [s for s in decode if not s["nodes"] and not s.get("eligible")]),
              ("plain_asked", [s for s in decode if not s["nodes"] and s.get("eligible")]),
              # steps carrying a prefill chunk (which the guard does not judge)
              ("prefill_plain", [s for s in steps if s["prefill"] and not s["nodes"]]),
              ("prefill_drafted", [s for s in steps if s["prefill"] and s["nodes"]]))
    for kind, group in groups:
        if group:
            keys = ["total", *(name for _, name in PHASES)]
            out[kind] = {"steps": len(group), "seconds": round(sum(s["total"] for s in group), 3),
                         "prefill": round(statistics.mean(s["prefill"] for s in group), 1), "nodes": round(statistics.mean(s["nodes"] for s in group), 1),
                         "requests": round(statistics.mean(s["requests"] for s in group), 1),
                         "tokens": round(statistics.mean(s["tokens"] for s in group), 2),
                         "us_median": {k: round(1e6 * statistics.median(s.get(k, 0.0) for s in group)) for k in keys}}
    return out


if __name__ == "__main__":
    main()
