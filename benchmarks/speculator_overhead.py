"""What the speculator itself adds to a step: plain decoding and `auto` on the same batches of ShareGPT prompts, one process, the
engines taking each batch in turn. Each step is timed whole and its forward alone (the model
runner's execute), so step minus forward is the engine's and the speculator's Python.

    python benchmarks/speculator_overhead.py   # bundled model, batch 8, 48 prompts

Prints tok/s, steps, step median and p99, forward mean and step-minus-forward mean per engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch


def engines_and_prompts(a: argparse.Namespace) -> tuple[dict, list]:
    """The plain and `auto` engines on `a.model` (default: the bundled one), and the prompts of
    `a.dataset` under its chat template (`guard_variants.chat_prompts`)."""
    from guard_variants import chat_prompts  # beside this file
    from specserve import LLM

    kw = {} if a.model is None else {"model": a.model}
    llms = {"none": LLM(speculative=None, threads=a.threads, **kw),
            "auto": LLM(speculative=dict(method="auto"), threads=a.threads, **kw)}
    return llms, chat_prompts(a, llms["none"].tokenizer)


def workload_args(doc: str | None, prompts: int = 32) -> argparse.Namespace:
    """The options the speculator's timing scripts share: model, dataset, threads, prompts, batch,
    rounds, max tokens (threads applied to torch)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    return a


def run_rounds(llms: dict, prompts: list, a: argparse.Namespace) -> None:
    """Greedy generation of the prompts in batches, the engines taking turns batch by batch."""
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    for _ in range(a.rounds):
        for i in range(0, len(prompts), a.batch):
            for llm in llms.values():
                llm.generate(prompts[i:i + a.batch], params, use_tqdm=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specserve import SamplingParams

    llms, prompts = engines_and_prompts(a)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    rec: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in llms}
    for name, llm in llms.items():
        core, cur = llm.engine.core, {}
        execute, step = core.runner.execute, llm.engine.step

        def timed_execute(*args, execute=execute, cur=cur, **kwargs):
            t = time.perf_counter()
            out = execute(*args, **kwargs)
            cur["forward"] = time.perf_counter() - t
            return out

        def timed_step(step=step, cur=cur, r=rec[name]):
            cur.clear()
            t = time.perf_counter()
            out = step()
            dt = time.perf_counter() - t
            if "forward" in cur:
                r["step"].append(dt)
                r["forward"].append(cur["forward"])
            return out

        core.runner.execute = timed_execute
        llm.engine.step = timed_step
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        rec[name].clear()
    seconds, tokens = defaultdict(float), defaultdict(int)
    for i in range(0, len(prompts), a.batch):
        for name, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate(prompts[i : i + a.batch], params, use_tqdm=False)
            seconds[name] += time.perf_counter() - t
            tokens[name] += sum(len(o.token_ids) for o in outs)
    result = {}
    for name, r in rec.items():
        decode = [(s, f) for s, f in zip(r["step"], r["forward"]) if s < 0.1]  # prefill steps left out
        steps = sorted(s for s, _ in decode)
        result[name] = dict(
            tok_s=tokens[name] / seconds[name], steps=len(steps), step_median_ms=1e3 * statistics.median(steps),
            step_p99_ms=1e3 * steps[int(0.99 * (len(steps) - 1))],
            forward_mean_ms=1e3 * statistics.mean(f for _, f in decode),
            outside_forward_mean_ms=1e3 * statistics.mean(s - f for s, f in decode),
        )
        print(f"{name:16s} " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result[name].items()))
    if a.json:
        a.json.write_text(json.dumps(dict(command=" ".join(__import__("sys").argv), rows=result), indent=1))


if __name__ == "__main__":
    main()
