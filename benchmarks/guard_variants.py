"""Goodput-guard settings side by side in one process: an engine without speculation, `auto` with
the guard as shipped, and `auto` with guard settings changed (GuardConfig fields), each taking
every group of prompts in turn, the order reversed every other group (so a drift of the machine's
speed within a turn does not fall on one engine each time); `none-again`, a second engine without
speculation, is the run's noise. With --continuous a group is --chunk prompts run as one
continuous batch of at most --batch requests (new requests join as others finish, their prefill
chunks beside the decodes); without, a group is --batch prompts run to its end (a static batch).

    python benchmarks/guard_variants.py --prompts 64 --batch 8 --runs 2 --variant "control8:control_every=8"
    python benchmarks/guard_variants.py --continuous --chunk 32 --prompts 64 --batch 8 --runs 2

Every engine's outputs are checked against `none`'s (greedy: token for token).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import torch


# Not GuardConfig fields: kept_plain=1 makes the guard keep every step plain (speculation's
# bookkeeping without drafts: the floor `auto` stands on); every_token=1 has the guard count every
# emitted token also where no request waits (as before session 17: no fixed share); no_reserve=1
# has the scheduler reserve no draft slots (with kept_plain=1: the bookkeeping without the blocks).
KEPT_PLAIN = "kept_plain"
EVERY_TOKEN = "every_token"
NO_RESERVE = "no_reserve"
RESERVING_NONE = "none-reserving"  # --reserving-none: no speculation, but draft slots reserved as `auto` does


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'name:field=value,field=value' -> (name, GuardConfig overrides, kept_plain=1, every_token=1)."""
    from specserve.speculation.guard import GuardConfig

    name, _, spec = text.partition(":")
    types = {f.name: f.type for f in fields(GuardConfig)} | {KEPT_PLAIN: "int", EVERY_TOKEN: "int", NO_RESERVE: "int"}
    overrides: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in types:
            raise SystemExit(f"--variant {text!r}: GuardConfig has no field {key!r} (fields: {', '.join(types)})")
        overrides[key] = float(value) if types[key] in (float, "float") else int(value)
    return name, overrides


def build(overrides: dict[str, Any] | None, model: str, batch: int, reserving: bool = False) -> Any:
    """An engine: `none` (overrides None), `auto` with the guard's overrides; `reserving`: `none`
    whose scheduler reserves draft slots as `auto`'s does (its default K) and trims them after."""
    from specserve import LLM
    from specserve.speculation.config import SpeculativeConfig
    from specserve.speculation.guard import GoodputGuard, GuardConfig, Mode

    llm = LLM(model, max_num_seqs=batch, speculative=None if overrides is None else dict(method="auto"))
    core = llm.engine.core
    if reserving:
        k = SpeculativeConfig(method="auto").num_tokens
        core.scheduler.draft_budget = lambda seq: max(0, min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1))
    if overrides:
        overrides = dict(overrides)
        kept_plain = overrides.pop(KEPT_PLAIN, 0)
        if overrides.pop(NO_RESERVE, 0):
            core.scheduler.draft_budget = lambda seq: 0
        speculator = core.speculator
        if overrides.pop(EVERY_TOKEN, 0):
            speculator.controller.fixed_share = lambda shape, rows: None
        guard = speculator.guard = GoodputGuard(GuardConfig(**overrides))
        if kept_plain:
            guard.modes = lambda shape, drafters, step_no, requests=frozenset(): dict.fromkeys(drafters, Mode.PLAIN)
    return llm


def time_forwards(llm: Any) -> dict[str, float]:
    """Seconds and calls of the engine's forwards (the runner's execute) from now on."""
    runner = llm.engine.core.runner
    execute = runner.execute
    spent = {"seconds": 0.0, "steps": 0}

    def timed(*args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return execute(*args, **kw)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["steps"] += 1

    runner.execute = timed
    return spent


def take_turns(engines: dict[str, Any], groups: list[list[str]], params: Any
               ) -> tuple[dict[str, float], dict[str, int], dict[str, list[list[int]]]]:
    """Every engine generates each group in turn, the order reversed every other group: each
    engine's seconds, tokens and outputs (in prompt order)."""
    names = list(engines)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in names}
    for g, group in enumerate(groups):
        for name in (names if g % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            out = engines[name].generate(group, params, use_tqdm=False)
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.token_ids) for o in out)
            outputs[name].extend(o.token_ids for o in out)
    return seconds, tokens, outputs


def one_run(a: argparse.Namespace, engines: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    for llm in engines.values():
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    forwards = {name: time_forwards(llm) for name, llm in engines.items()}
    size = a.chunk if a.continuous else a.batch
    seconds, tokens, outputs = take_turns(engines, [prompts[i:i + size] for i in range(0, len(prompts), size)], params)
    rate = {name: tokens[name] / seconds[name] for name in engines}
    rows = {}
    for name, llm in engines.items():
        s = llm.engine.speculation_stats()
        rows[name] = {"tok_s": round(rate[name], 1), "vs_none": round(rate[name] / rate["none"], 3),
                      "same_tokens_as_none": outputs[name] == outputs["none"],
                      "guard_plain_steps": s.guard_plain_steps, "guard_probes": s.guard_probes,
                      "guard_turned_off": s.guard_turned_off, "accepted": s.accepted,
                      "steps": forwards[name]["steps"], "forward_s": round(forwards[name]["seconds"], 3),
                      "outside_forward_s": round(seconds[name] - forwards[name]["seconds"], 3)}
    return rows


def chat_prompts(a: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """The questions of `a.dataset` (`a.prompts` of them; per category for Spec-Bench) that fit with
    `a.max_tokens` to generate, each as a one-turn chat in the model's template."""
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts as chat

    return chat(open_dataset(a.dataset, None), a.prompts, a.max_tokens, tokenizer)


def run_all(a: argparse.Namespace, make_engines: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """`a.runs` runs, each on fresh engines from `make_engines` (a `none` among them, first), on the
    questions of `a.dataset` that fit the model; each run's rows, printed as they come."""
    torch.set_num_threads(a.threads)
    prompts: list[str] = []
    runs = []
    for r in range(a.runs):
        engines = make_engines()
        if not a.own_weights:  # one copy of the weights for all: where each engine's copy lies in memory moved
            model = engines["none"].engine.core.runner.model  # its speed by up to 5-10% an engine, run-long
            for llm in engines.values():
                llm.engine.core.runner.model = model
        if not prompts:  # the questions fitting the model's tokenizer, once
            prompts = chat_prompts(a, engines["none"].tokenizer)
        rows = one_run(a, engines, prompts)
        del engines
        runs.append(rows)
        print(f"run {r + 1}: " + ", ".join(f"{n} {v['vs_none']:.3f}x" for n, v in rows.items()), flush=True)
        for n, v in rows.items():
            print(f"  {n}: {v['steps']} steps, forward {1e3 * v['forward_s'] / v['steps']:.2f} ms a step, "
                  f"outside it {1e3 * v['outside_forward_s'] / v['steps']:.2f} ms", flush=True)
    return runs


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    ap.add_argument("--continuous", action="store_true", help="groups of --chunk prompts as continuous batches")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2, help="fresh engines each run")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:FIELD=VALUE,... an `auto` engine whose GuardConfig has these fields changed")
    ap.add_argument("--own-weights", action="store_true",
                    help="each engine computes with the weights it loaded (by default all use none's)")
    ap.add_argument("--reserving-none", action="store_true",
                    help=f"also {RESERVING_NONE!r}: no speculation, draft slots reserved and trimmed as under auto")
    a = ap.parse_args()
    configs: dict[str, dict[str, Any] | None] = {"none": None, "auto": {}}
    configs.update(parse_variant(v) for v in a.variant)
    if a.reserving_none:
        configs[RESERVING_NONE] = None
    configs["none-again"] = None
    runs = run_all(a, lambda: {name: build(o, a.model, a.batch, reserving=name == RESERVING_NONE)
                               for name, o in configs.items()})
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "args": {k: str(v) for k, v in vars(a).items()},
                                      "configs": configs, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
