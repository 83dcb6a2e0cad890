"""When the goodput guard turns each (shape, drafter) bucket off and on in one in-process run, and
what its plain reference and the gain read on the way: every transition (the step, the bucket,
whether a probe turned it on) and, every --every steps, each bucket of --rows requests that has
been judged (the reference, the gain, on or off). The modes the guard said per shape are counted
at the end ("pp": plain for both drafters, "dd": both on, "xx": both probing, ...).

    python benchmarks/guard_timeline.py --dataset sharegpt --prompts 48 --batch 8
    python benchmarks/guard_timeline.py --dataset sharegpt --prompts 48 --batch 8 --first-references 1   # before session 37
    python benchmarks/guard_timeline.py --dataset sharegpt --prompts 96 --batch 8 --guard fresh_short_rows=1073741824   # before session 38

Session 37: with one plain step as the reference (--first-references 1), the batch-8 bucket on
ShareGPT read drafts that lost as 1.4-2x plain's rate and stayed on for 160-230 steps.
Session 38: with the waits between probes started short again whenever the requests turned over
at batch 8 (--guard fresh_short_rows=1073741824), 4-5 probes came of every turnover.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from typing import Any

import torch


def main() -> None:
    from guard_variants import add_common_arguments  # beside this file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)  # --model --dataset --prompts --batch --max-tokens --threads --json
    ap.set_defaults(prompts=48)
    ap.add_argument("--rows", type=int, default=8, help="the bucket rows whose readings are printed every --every steps")
    ap.add_argument("--every", type=int, default=15)
    ap.add_argument("--first-references", type=int, help="the guard's first_references (default: its own)")
    ap.add_argument("--guard", action="append", default=[], metavar="NAME=VALUE",
                    help="a field of the lookups' GuardConfig (repeatable)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts
    from specserve.speculation.guard import Mode

    llm = LLM(a.model, max_num_seqs=a.batch, speculative={"method": "auto"})
    llm.wait_for_huge_pages()
    guard = llm.engine.core.speculator.guard
    settings = dict(kv.split("=", 1) for kv in a.guard)
    if a.first_references is not None:
        settings["first_references"] = str(a.first_references)
    if settings:  # each value in the type of the field's default
        guard.config = dataclasses.replace(guard.config, **{
            k: type(getattr(guard.config, k))(float(v)) for k, v in settings.items()})
    events: list[dict[str, Any]] = []
    said: Counter[tuple[tuple[int, int], str]] = Counter()

    def reading(key: tuple[int, int, str]) -> dict[str, Any] | None:
        b = guard._buckets.get(key)
        if b is None or not b.plain.steps or not (b.seconds.steps or b.asked_seconds.steps):
            return None
        return {"off": b.off, "reference": round(b.plain.value, 3), "gain": round(b.gain(), 3)}

    modes = guard.modes

    def traced_modes(shape: tuple[int, int], drafters: list[str], step_no: int, requests: frozenset[str] = frozenset()):
        out = modes(shape, drafters, step_no, requests)
        said[shape, "".join("x" if m is Mode.PROBE else m.value[0] for m in out.values())] += 1
        if shape[0] == a.rows and step_no % a.every == 0:
            for name in drafters:
                if (r := reading((*shape, name))) is not None:
                    events.append({"step": step_no, "bucket": [*shape, name], **r})
                    print(f"  step {step_no:4d} {shape} {name:7s} {'off' if r['off'] else 'on '} reference "
                          f"{r['reference']:.3f} gain {r['gain']:.3f}")
        return out

    def transitions(record: Any) -> Any:
        def traced(key: tuple[int, int, str], *args: Any, **kw: Any) -> None:
            was = guard._bucket(key, args[1]).off  # args: mode, step_no, ...
            record(key, *args, **kw)
            b = guard._buckets[key]
            if b.off != was:
                probe = args[0] is Mode.PROBE  # args: mode, step_no, drafted, seconds, tokens, rows
                events.append({"step": args[1], "bucket": list(key),
                               "turned": "off" if b.off else "on", "by_probe": probe})
                print(f"{events[-1]['step']:4} {key} turned {'off' if b.off else 'on'}{' by a probe' if probe else ''}")
        return traced

    guard.modes = traced_modes
    guard._record = transitions(guard._record)  # (key, mode, step_no, drafted, seconds, tokens, rows)
    record_asked = guard._record_asked  # (key, step_no, seconds, tokens)

    def traced_asked(key: tuple[int, int, str], step_no: int, seconds: float, tokens: float) -> None:
        was = guard._bucket(key, step_no).off
        record_asked(key, step_no, seconds, tokens)
        if guard._buckets[key].off != was:
            events.append({"step": step_no, "bucket": list(key), "turned": "off", "by_probe": False})
            print(f"{step_no:4} {key} turned off (steps that only asked)")

    guard._record_asked = traced_asked
    prompts = chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    counts = sorted(([list(shape), m, n] for (shape, m), n in said.items()), key=lambda x: (x[0], x[1]))
    for shape, m, n in counts:
        print(f"{shape} {m}: {n}")
    stats = llm.engine.core.speculator.stats()
    print(f"guard: {stats.guard_plain_steps} plain steps, {stats.guard_probes} probes, {stats.guard_turned_off} turned off")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "events": events, "modes": counts,
                                      "guard_plain_steps": stats.guard_plain_steps, "probes": stats.guard_probes,
                                      "turned_off": stats.guard_turned_off}, indent=1))


if __name__ == "__main__":
    main()
