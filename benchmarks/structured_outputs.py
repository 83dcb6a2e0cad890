"""Structured outputs on the bundled model: validity, losslessness and speed, with and without
speculation, and what masking costs per step.

Thirty constrained requests (24 JSON schemas, 3 regexes, 3 choices; chat prompts asking for each),
greedy, one at a time (batch 1) and all at once (batch 30), for each `--spec`:

- valid: the response parses and validates against its schema (or matches its regex / choice);
- same: the response is token for token the one without speculation;
- tok/s and the forced-token drafts (text the grammar forces, drafted for free).

    python benchmarks/structured_outputs.py --specs none,auto,suffix --json benchmarks/structured_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch


def _obj(props: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **kw}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _short(n: int = 30) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a fictional person", _obj({"name": _short(), "age": INT, "email": _short(40)})),
    ("a book", _obj({"title": _short(60), "author": _short(), "year": INT,
                     "genres": {"type": "array", "items": _short(), "maxItems": 4}})),
    ("a city", _obj({"name": _short(), "country": _short(), "population": INT, "capital": B})),
    ("a product in an online shop", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                          "name": _short(), "price": N, "in_stock": B})),
    ("a calendar event", _obj({"title": _short(), "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                               "attendees": {"type": "array", "items": _short(), "maxItems": 5}})),
    ("the weather today", _obj({"city": _short(), "temperature_c": N, "condition":
                                {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("a recipe", _obj({"name": _short(), "servings": INT, "ingredients": {
        "type": "array", "items": _obj({"item": _short(), "grams": INT}), "maxItems": 5}})),
    ("a movie review", _obj({"movie": _short(), "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                             "summary": _short(120)})),
    ("a bank transaction", _obj({"id": INT, "amount": N, "currency": {"enum": ["USD", "EUR", "GBP"]},
                                 "pending": B})),
    ("a postal address", _obj({"street": _short(), "city": _short(), "zip": {"type": "string",
                                                                             "pattern": "^[0-9]{5}$"}})),
    ("a company", _obj({"name": _short(), "founded": INT, "employees": INT, "public": B,
                        "ceo": _obj({"name": _short(), "age": INT})})),
    ("a to-do list", _obj({"owner": _short(), "items": {"type": "array", "items": _obj({"task": _short(50), "done": B}),
                                                        "maxItems": 4}})),
    ("a football match result", _obj({"home": _short(), "away": _short(), "home_goals": INT, "away_goals": INT})),
    ("a laptop's specifications", _obj({"brand": _short(), "ram_gb": INT, "storage_gb": INT, "weight_kg": N})),
    ("a flight", _obj({"flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"}, "from": _short(),
                       "to": _short(), "seats_left": INT})),
    ("a song", _obj({"title": _short(), "artist": _short(), "duration_s": INT, "explicit": B})),
    ("a student's grades", _obj({"student": _short(), "grades": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 5}})),
    ("an animal", _obj({"species": _short(), "legs": INT, "habitat": {"enum": ["forest", "ocean", "desert", "arctic"]},
                        "endangered": B})),
    ("a planet", _obj({"name": _short(), "moons": INT, "has_rings": B, "distance_au": N})),
    ("a car", _obj({"make": _short(), "model": _short(), "year": INT, "electric": B})),
    ("a user account", _obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                             "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]},
                                       "maxItems": 3}, "active": B})),
    ("a job posting", _obj({"title": _short(), "company": _short(), "salary": INT, "remote": B})),
    ("a hotel booking", _obj({"hotel": _short(), "nights": INT, "guests": INT, "breakfast": B})),
    ("any JSON object describing a dog", {"type": "object"}),
]
REGEXES = [
    ("a US phone number", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("an ISO date in 2026", r"2026-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("an IPv4 address", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
]
CHOICES = [
    ("the sentiment of 'I love this phone, the battery lasts forever'", ["positive", "negative", "neutral"]),
    ("the capital of France", ["Paris", "London", "Berlin", "Madrid"]),
    ("whether 17 is prime", ["yes", "no"]),
]


def cases() -> list[dict[str, Any]]:
    out = []
    for what, schema in SCHEMAS:
        out.append(dict(kind="json", prompt=f"Give {what} as a JSON object.", schema=schema))
    for what, regex in REGEXES:
        out.append(dict(kind="regex", prompt=f"Write {what}.", regex=regex))
    for what, choice in CHOICES:
        out.append(dict(kind="choice", prompt=f"Answer with one word: {what}?", choice=choice))
    return out


def params_for(case: dict[str, Any], max_tokens: int, constrained: bool = True):
    from specserve import SamplingParams, StructuredOutputsParams

    c = None
    if constrained:
        if case["kind"] == "json":
            c = StructuredOutputsParams(json=case["schema"])
        elif case["kind"] == "regex":
            c = StructuredOutputsParams(regex=case["regex"])
        else:
            c = StructuredOutputsParams(choice=tuple(case["choice"]))
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=c)


def valid(case: dict[str, Any], text: str) -> bool:
    if case["kind"] == "json":
        try:
            jsonschema.validate(json.loads(text), case["schema"])
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    if case["kind"] == "regex":
        return re.fullmatch(case["regex"], text) is not None
    return text in case["choice"]


def run(spec: str, all_cases: list[dict[str, Any]], max_tokens: int, threads: int) -> dict[str, Any]:
    from specserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM("smollm2-135m", speculative=spec)
    convs = [[{"role": "user", "content": c["prompt"]}] for c in all_cases]
    llm.chat(convs[:2], [params_for(c, 8) for c in all_cases[:2]], use_tqdm=False)  # warm up kernels, grammars
    eng = llm.engine
    before = eng.speculation_stats()
    start = time.perf_counter()
    outs = [llm.chat([conv], params_for(c, max_tokens), use_tqdm=False)[0] for conv, c in zip(convs, all_cases)]
    b1 = time.perf_counter() - start
    stats = eng.speculation_stats()
    start = time.perf_counter()
    batched = llm.chat(convs, [params_for(c, max_tokens) for c in all_cases], use_tqdm=False)
    b30 = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    free_tokens = free_time = 0.0
    if spec == "none":  # the same prompts unconstrained, each as long as its constrained answer
        free_params = [SamplingParams(max_tokens=len(o.token_ids), temperature=0, ignore_eos=True) for o in outs]
        start = time.perf_counter()
        free = [llm.chat([conv], fp, use_tqdm=False)[0] for conv, fp in zip(convs, free_params)]
        free_time = time.perf_counter() - start
        free_tokens = sum(len(o.token_ids) for o in free)
    return dict(
        spec=spec,
        valid=sum(valid(c, o.text) for c, o in zip(all_cases, outs)),
        valid_batched=sum(valid(c, o.text) for c, o in zip(all_cases, batched)),
        finished=sum(o.finish_reason == "stop" for o in outs),
        tokens=tokens,
        batch1_seconds=b1,
        batch1_tok_s=tokens / b1,
        batched_seconds=b30,
        batched_tok_s=sum(len(o.token_ids) for o in batched) / b30,
        forced_drafted=stats.forced_drafted - before.forced_drafted,
        forced_accepted=stats.forced_accepted - before.forced_accepted,
        drafted=stats.accepted - before.accepted,
        outputs=[o.token_ids for o in outs],
        batched_outputs=[o.token_ids for o in batched],
        texts=[o.text for o in outs],
        unconstrained_ms_per_token=1000 * free_time / free_tokens if free_tokens else None,
        constrained_ms_per_token=1000 * b1 / tokens,
    )


def mask_cost(all_cases: list[dict[str, Any]], texts: list[str]) -> dict[str, float]:
    """Median microseconds to compute one constrained row's mask and apply it to [1, vocab] logits,
    and the mask rows of an 8-node chain, over the states the real outputs pass through."""
    from specserve import LLM
    from specserve.speculation.grammar import masks
    from specserve.speculation.tree import DraftTree
    from specserve.structured import allow_all, apply_bitmask

    llm = LLM("smollm2-135m")
    eng = llm.engine
    vocab = eng.model.config.vocab_size
    logits = torch.randn(1, vocab)
    fill_us, apply_us, tree_us = [], [], []
    for case, text in zip(all_cases, texts):
        g = eng._grammar(params_for(case, 8))
        ids = eng.tokenize(text) if text else []
        for i, t in enumerate(ids):
            bm = allow_all(1, g.mask_size)
            t0 = time.perf_counter()
            g.fill(bm, 0)
            t1 = time.perf_counter()
            apply_bitmask(logits, bm)
            t2 = time.perf_counter()
            fill_us.append(1e6 * (t1 - t0))
            apply_us.append(1e6 * (t2 - t1))
            rest = ids[i : i + 8]
            if len(rest) == 8 and i % 4 == 0:
                t0 = time.perf_counter()
                masks(DraftTree.chain(rest), g)
                tree_us.append(1e6 * (time.perf_counter() - t0))
            if not g.accept(t):
                break
    return dict(fill_us=statistics.median(fill_us), apply_us=statistics.median(apply_us),
                fill_mean_us=statistics.fmean(fill_us), apply_mean_us=statistics.fmean(apply_us),
                chain8_masks_us=statistics.median(tree_us) if tree_us else float("nan"), states=len(fill_us))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--specs", default="none,auto,suffix")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    all_cases = cases()
    results = [run(spec, all_cases, a.max_tokens, a.threads) for spec in a.specs.split(",")]
    base = results[0]
    cost = mask_cost(all_cases, base["texts"])
    print(f"{len(all_cases)} requests, greedy, max_tokens {a.max_tokens}, {platform.processor() or platform.machine()}")
    print(f"{'spec':<10}{'valid':>8}{'same':>8}{'b1 tok/s':>10}{'x':>7}{'b30 tok/s':>11}{'x':>7}"
          f"{'forced acc/drafted':>20}")
    for r in results:
        same = sum(x == y for x, y in zip(r["outputs"], base["outputs"]))
        same_b = sum(x == y for x, y in zip(r["batched_outputs"], base["outputs"]))
        r["same_as_first"] = same
        r["batched_same_as_first"] = same_b
        print(f"{r['spec']:<10}{r['valid']:>5}/{len(all_cases):<2}{same:>5}/{len(all_cases):<2}"
              f"{r['batch1_tok_s']:>10.1f}{r['batch1_tok_s'] / base['batch1_tok_s']:>7.2f}"
              f"{r['batched_tok_s']:>11.1f}{r['batched_tok_s'] / base['batched_tok_s']:>7.2f}"
              f"{r['forced_accepted']:>12}/{r['forced_drafted']:<7}  batched same {same_b}/{len(all_cases)}")
    print(f"plain decoding, the same prompts and lengths: {base['unconstrained_ms_per_token']:.2f} ms/token "
          f"unconstrained, {base['constrained_ms_per_token']:.2f} constrained; "
          f"one row's mask: fill {cost['fill_us']:.0f} us + "
          f"apply {cost['apply_us']:.0f} us; an 8-node chain's 9 rows: {cost['chain8_masks_us']:.0f} us "
          f"(medians over {cost['states']} grammar states; means: fill {cost['fill_mean_us']:.0f} us, "
          f"apply {cost['apply_mean_us']:.0f} us)")
    if a.json:
        for r in results:
            r.pop("outputs"), r.pop("batched_outputs")
        a.json.write_text(json.dumps(dict(results=results, mask_cost=cost, cases=len(all_cases),
                                          max_tokens=a.max_tokens, threads=a.threads), indent=1))


if __name__ == "__main__":
    main()
