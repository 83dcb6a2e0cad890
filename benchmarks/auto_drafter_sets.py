"""Two engine variants side by side in one process, each built twice in the order A B B A, so that
neither gains from the order engines are built in (in `bench spec` the same method listed second ran
3-5% faster than listed first, session 30); the prompts go to all four in turn, the order reversed
every other group. A variant is `none`, a --spec method, or `auto` with drafters added to its set
or left out: `auto+recycling` (auto as it was before session 30), `auto-ngram`; `:secant` after
any of them takes the controller's pass over every count of nodes out (`GoodputController.
_by_threshold`, session 30: the secant alone); `:learn-drafting-only` has the step-cost model taught
only by steps that asked the drafters (before session 31); `:name=value` sets a speculative config
field (`auto:latency_slack=0.1`), `:speculator.NAME=value` a Speculator class setting on that
engine (`auto:speculator.WORTH_SHARE=0.5`), `:engine.NAME=value` an EngineArgs field
(`none:engine.huge_pages=1`), `:guard.NAME=value` a field of the goodput guard's config for the
lookups (`auto:guard.probe_steps=3`), `:model_guard.NAME=value` of the one for the drafters that run a
model (`auto:model_guard.start_off_rows=1073741824`).

    python benchmarks/auto_drafter_sets.py --dataset sharegpt --a auto+recycling --b auto
    python benchmarks/auto_drafter_sets.py --dataset sharegpt --batch 4 --n 48 --a auto --b none
    python benchmarks/auto_drafter_sets.py --model $M --draft $D --dataset sharegpt --n 8 --a auto+recycling --b auto

Prints each speculating engine's start-up forward profile (the probe's milliseconds by tokens, up
to 17), each engine's tokens per second and A's over B's (both copies' tokens over both copies'
seconds); the two copies of a variant say the run's noise. With --batch B each group is 4 x B
prompts run as one continuous batch of at most B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="auto")
    ap.add_argument("--b", default="suffix")
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--draft", default=None, help="draft model for auto and draft-model")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--n", type=int, default=16, help="prompts (per category for spec-bench)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specserve.speculation.config as spec_config
    from specserve import LLM, SamplingParams
    from specserve.entrypoints.engine_args import EngineArgs
    from specserve.bench.spec import chat_prompts, open_dataset

    full = spec_config.AUTO_METHODS
    kw: dict[str, Any] = dict(threads=a.threads, max_num_seqs=a.batch, **({"model": a.model} if a.model else {}))

    def build(variant: str) -> Any:
        variant, drafting_only, _ = variant.partition(":learn-drafting-only")
        variant, secant, _ = variant.partition(":secant")
        variant, *settings = variant.split(":")
        by_scope: dict[str, dict[str, str]] = {}  # "" (a speculative config field), engine, speculator, guard
        for setting in settings:
            key, value = setting.split("=")
            scope, _, name = key.rpartition(".")
            by_scope.setdefault(scope, {})[name] = value

        def typed(owner: Any, scope: str) -> dict[str, Any]:  # each value in the type of its default on `owner`
            return {k: v if isinstance(getattr(owner, k), str) else type(getattr(owner, k))(float(v))
                    for k, v in by_scope.get(scope, {}).items()}

        fields = {k: float(v) for k, v in by_scope.get("", {}).items()}
        llm = build_one(variant, fields, typed(EngineArgs(), "engine"))
        llm.wait_for_huge_pages()  # the weights' collapse into 2 MB pages through before anything is timed
        speculator = llm.engine.core.speculator
        for k, v in typed(speculator, "speculator").items():  # a class setting, on this engine alone
            setattr(speculator, k, v)
        if "guard" in by_scope:  # the lookups' guard config (a model drafter's has its own, left as it is)
            speculator.guard.config = dataclasses.replace(speculator.guard.config,
                                                          **typed(speculator.guard.config, "guard"))
        if "model_guard" in by_scope:  # the guard config of the drafters that run a model (`per_drafter`)
            replaced: dict[int, Any] = {}  # drafters judged alike stay alike (the guard groups them by identity)
            for name, config in speculator.guard.per_drafter.items():
                if id(config) not in replaced:
                    replaced[id(config)] = dataclasses.replace(config, **typed(config, "model_guard"))
                speculator.guard.per_drafter[name] = replaced[id(config)]
        if secant and hasattr(llm.engine.core.speculator.controller, "_by_threshold"):
            llm.engine.core.speculator.controller._by_threshold = lambda base, rows, candidates, best: best
        if drafting_only:
            from guard_buckets import learn_drafting_only  # beside this file

            learn_drafting_only(llm.engine.core.speculator)
        return llm

    def build_one(variant: str, fields: dict[str, float], engine: dict[str, Any]) -> Any:
        if variant == "none":
            return LLM(speculative=None, **kw, **engine)
        if not variant.startswith("auto"):
            return LLM(speculative=dict(method=variant, draft_model=a.draft if variant == "draft-model" else None, **fields),
                       **kw, **engine)
        drafters = list(full)
        for sign, name in re.findall(r"([+-])([a-z-]+?)(?=[+-]|$)", variant[4:]):
            drafters = [d for d in drafters if d != name] + ([name] if sign == "+" else [])
        spec_config.AUTO_METHODS = tuple(drafters)
        try:  # read when the engine builds its drafters
            return LLM(speculative=dict(method="auto", draft_model=a.draft, **fields), **kw, **engine)
        finally:
            spec_config.AUTO_METHODS = full

    names = [f"{a.a}#1", f"{a.b}#1", f"{a.b}#2", f"{a.a}#2"]
    llms = {n: build(n.split("#")[0]) for n in names}
    profiles = {}
    for n, llm in llms.items():  # in the order built
        cost = getattr(llm.engine.core.speculator.controller, "cost", None)
        if cost is not None:
            profiles[n] = {k: round(v * 1e3, 2) for k, v in zip(cost.profile.sizes, cost.profile.seconds) if k <= 17}
            print(f"{n:28s} start-up probe (ms by tokens): {profiles[n]}")
    tok = llms[names[0]].tokenizer
    prompts = chat_prompts(open_dataset(a.dataset, None), a.n, a.max_tokens, tok)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    for llm in llms.values():
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    size = 1 if a.batch == 1 else 4 * a.batch
    for k, start in enumerate(range(0, len(prompts), size)):
        group = prompts[start:start + size]
        for n in names if k % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            outs = llms[n].generate(group, params, use_tqdm=False)
            seconds[n] += time.perf_counter() - t
            tokens[n] += sum(len(o.token_ids) for o in outs)
    rate = {n: tokens[n] / seconds[n] for n in names}
    for n in names:
        print(f"{n:28s} {rate[n]:7.1f} tok/s")
    ra = (tokens[names[0]] + tokens[names[3]]) / (seconds[names[0]] + seconds[names[3]])
    rb = (tokens[names[1]] + tokens[names[2]]) / (seconds[names[1]] + seconds[names[2]])
    spread = (rate[names[0]] / rate[names[3]], rate[names[1]] / rate[names[2]])
    print(f"{a.dataset} batch {a.batch}: {a.a} {ra:.1f} vs {a.b} {rb:.1f} tok/s: {ra / rb:.3f}x "
          f"(copy against copy: {spread[0]:.3f}, {spread[1]:.3f})")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "tok_s": rate,
                                      "ratio": ra / rb, "copy_spread": spread,
                                      "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
