"""Why a decode step drafted or not, step by step, under `auto` at batch 1 (Spec-Bench's first
question of each category, or --dataset's first --prompts questions; greedy, `--max-tokens` with
ignore_eos): for each step, the guard's mode for each drafter, the drafter chosen for the request
and its grant, whether a model drafter's catch-up was judged not worth it
(`Speculator._catch_up_unpaid`: its inputs and verdict), the trees proposed and the nodes verified,
and the step-cost model's price of one more verified token. Then, by category (by prompt elsewhere): steps that verified drafts (by drafter), steps that asked and verified nothing (by
the drafter chosen, and whether its grant was 0 and why), and steps the guard kept plain.

    python benchmarks/propose_trace.py --model $M --draft-model $D --json trace.json
    python benchmarks/propose_trace.py --model $M --draft-model $D --dataset humaneval --prompts 8 --json trace.json

The instrumentation wraps the speculator's methods from outside (nothing in the engine changes);
the wrapped calls cost microseconds against ~30 ms steps.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch


def instrument(sp: Any, log: list[dict[str, Any]], where: dict[str, str]) -> None:
    """Wrap `sp`'s propose path so that every step appends a record to `log` (`where["category"]`
    names the prompt it belongs to)."""
    from specserve.speculation.controller import StepShape

    cur: dict[str, Any] = {}
    catch_up, grant, run, select, propose = (sp._catch_up_unpaid, sp._grant, sp._run_drafters,
                                             sp.controller.select, sp.propose)

    def traced_catch_up(o: Any, *args: Any) -> bool:  # (offer, rows) before session 27
        unpaid = catch_up(o, *args)
        cur["catch_up"] = dict(unpaid=unpaid, seconds=round(sp._active[o.name].catch_up_cost(o.request.view), 4),
                               lookups=sp._lookups(), output=len(o.request.view.output_token_ids))
        if len(args) == 3:
            cur["catch_up"].update(per_node=round(args[1], 3), values=[round(v, 3) for v in args[0][:4]])
        return unpaid

    def traced_grant(offers: Any, base: Any, rows: int) -> None:
        grant(offers, base, rows)
        cur["grant"] = [(o.name, o.grant) for o in offers]

    def traced_run(offers: Any, base: Any, rows: int) -> None:
        run(offers, base, rows)
        cur["trees"] = [(o.name, len(o.tree)) for o in offers]

    def traced_select(base: Any, rows: int, candidates: Any, behind: bool = False) -> Any:
        out = select(base, rows, candidates, behind)
        cost = sp.controller.cost
        plain = cost.predict(base)
        cur.setdefault("selections", []).append(dict(
            counts=list(out.counts), values=[[round(v, 2) for v in c.values[:4]] for c in candidates],
            token_ms=round(1e3 * (cost.predict(StepShape(base.tokens + 1, base.drafted, base.attended, base.hot))
                                  - plain), 2)))
        return out

    def traced_propose(decodes: Any, base: Any, rows: int, waiting: int = 0) -> Any:
        cur.clear()
        out = propose(decodes, base, rows, waiting)
        guard = sp._step.guard
        log.append(dict(cur, category=where["category"], prefill=base.tokens != rows,
                        nodes=sum(len(t) for t in out.values()),
                        modes={k: v.value for k, v in guard[1].items()} if guard else {}))
        return out

    sp._catch_up_unpaid, sp._grant, sp._run_drafters = traced_catch_up, traced_grant, traced_run
    sp.controller.select, sp.propose = traced_select, traced_propose


def kind(step: dict[str, Any]) -> str:
    """A decode step's outcome: the drafter whose tree it verified, or why it verified none."""
    if step["nodes"]:
        return "drafted:" + step["trees"][0][0]
    if not step["modes"] or all(m == "plain" for m in step["modes"].values()):
        return "guard-plain"
    if "grant" not in step:
        return "asked:nothing-granted"
    name, granted = step["grant"][0]
    if granted == 0:
        unpaid = step.get("catch_up", {}).get("unpaid")
        return f"asked:{name}:grant-0" + (":catch-up-unpaid" if unpaid else "")
    return f"asked:{name}:proposed-{'nothing' if not step.get('trees') or not step['trees'][0][1] else 'unkept'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dataset", default="spec-bench", help="spec-bench (by category), humaneval, sharegpt, ...")
    ap.add_argument("--prompts", type=int, default=1, help="a category's (Spec-Bench), else in all")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_questions
    from specserve.tokenizer import apply_chat_template

    torch.set_num_threads(a.threads)
    llm = LLM(a.model, max_num_seqs=1, speculative=dict(method="auto", draft_model=a.draft_model))
    log: list[dict[str, Any]] = []
    where = {"category": "warm-up"}
    instrument(llm.engine.core.speculator, log, where)
    chat = lambda q: apply_chat_template(llm.tokenizer, [{"role": "user", "content": q}])  # noqa: E731
    llm.generate(chat("Hello"), SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    seconds: dict[str, float] = {}
    for i, (category, prompt) in enumerate(chat_questions(open_dataset(a.dataset, None), a.prompts, a.max_tokens,
                                                          llm.tokenizer)):
        category = category if a.dataset == "spec-bench" else f"{a.dataset}-{i}"
        where["category"] = category
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        seconds[category] = round(time.perf_counter() - start, 2)
    by: dict[str, Counter] = defaultdict(Counter)
    for step in log:
        if not step["prefill"] and step["category"] != "warm-up":
            by[step["category"]][kind(step)] += 1
    summary = {c: dict(seconds=seconds[c], steps=sum(k.values()), **dict(k.most_common())) for c, k in by.items()}
    total: Counter = sum(by.values(), Counter())
    for c, row in summary.items():
        print(c, json.dumps(row))
    print("all", json.dumps(dict(seconds=round(sum(seconds.values()), 2), steps=sum(total.values()),
                                 **dict(total.most_common()))))
    if a.json:
        a.json.write_text(json.dumps(dict(args=vars(a) | {"json": str(a.json)}, summary=summary,
                                          total=dict(total), steps=log)) + "\n")


if __name__ == "__main__":
    main()
