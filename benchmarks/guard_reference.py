"""The goodput guard's reference, side by side in one process: engines without speculation, with
`auto` (each step with drafting on judged against the step-cost model's prediction of its own plain
time), with `auto` whose guard is given no prediction (judged against the shape's plain steps, as
before session 16), and with `auto` whose guard keeps every step plain (speculation's bookkeeping
alone: the floor). Every engine takes each static group of --batch prompts in turn, the order
alternating group by group, so that a machine whose speed drifts favours none; `none-again` is a
second engine without speculation, the run's noise.

    python benchmarks/guard_reference.py --prompts 64 --batch 8 --runs 3 --json benchmarks/guard_reference_zen5_s16_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

CONFIGS = ("none", "auto", "auto-plain-reference", "auto-kept-plain", "none-again")


def build(name: str, model: str, batch: int) -> Any:
    from specserve import LLM
    from specserve.speculation.guard import Mode

    llm = LLM(model, max_num_seqs=batch, speculative=None if name.startswith("none") else dict(method="auto"))
    guard = llm.engine.core.speculator.guard
    if name == "auto-plain-reference":
        record = guard.record_step
        guard.record_step = lambda *a, expected=None, **k: record(*a, **k)  # no predicted plain time
    elif name == "auto-kept-plain":
        guard.modes = lambda shape, drafters, step_no, requests=frozenset(): dict.fromkeys(drafters, Mode.PLAIN)
    return llm


def one_run(a: argparse.Namespace, engines: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    for llm in engines.values():
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    from guard_variants import take_turns  # beside this script

    seconds, tokens, outputs = take_turns(engines, [prompts[i:i + a.batch] for i in range(0, len(prompts), a.batch)],
                                          params)
    rate = {name: tokens[name] / seconds[name] for name in engines}
    rows = {}
    for name, llm in engines.items():
        s = llm.engine.speculation_stats()
        rows[name] = {"tok_s": round(rate[name], 1), "vs_none": round(rate[name] / rate["none"], 3),
                      "same_tokens_as_none": outputs[name] == outputs["none"],
                      "guard_plain_steps": s.guard_plain_steps, "guard_probes": s.guard_probes, "accepted": s.accepted}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="fresh engines each run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import load_questions
    from specserve.tokenizer import apply_chat_template

    torch.set_num_threads(a.threads)
    prompts: list[str] = []
    runs = []
    for r in range(a.runs):
        engines = {name: build(name, a.model, a.batch) for name in CONFIGS}
        if not prompts:  # the questions fitting the model's tokenizer, once
            tokenizer = engines["none"].tokenizer
            questions = load_questions(open_dataset(a.dataset, None), a.prompts, a.max_tokens, tokenizer)
            prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for _, q in questions]
        rows = one_run(a, engines, prompts)
        del engines
        runs.append(rows)
        print(f"run {r + 1}: " + ", ".join(f"{n} {v['vs_none']:.3f}x" for n, v in rows.items()), flush=True)
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
