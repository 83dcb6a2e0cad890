"""How much drafters' acceptance differs between requests, against the prior weight the acceptance
model gives the drafter's rate over all requests (`AcceptanceModel.prior_weight`).

A request's estimate is (its accepted + m x prior) / (its tried + m): the drafter's rate across
requests counts as m observations of the request's own. If each request's true first-node rate p
were drawn from a Beta distribution of mean mu, its concentration would be the m that weighs the
prior right: Var(p) = mu (1 - mu) / (m + 1). This runs `auto` on a dataset and counts, per drafter
and request, the verified trees (and the trees that lost, replayed on the emitted tokens, which
the model learns from too) and whether their first node was accepted; then estimates m by the
method of moments: the spread of the requests' rates around mu, less what the binomial noise of
their few tries explains.

    python benchmarks/acceptance_spread.py --dataset sharegpt --prompts 24 --batch 1 --json spread.json

Session 39 (bundled model, batch 1): m 4.5-11 across ShareGPT, HumanEval and Spec-Bench for
suffix and ngram, against a prior weight of 4: a request's own record already moves its
estimate at least as fast as the spread between requests warrants.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def concentration(counts: list[tuple[int, int]]) -> dict[str, float]:
    """(tried, accepted) per request -> the pooled rate, the spread of the requests' rates (weighted
    by tries), the part of it binomial noise explains, and the Beta concentration m left over."""
    tried = sum(t for t, _ in counts)
    accepted = sum(a for _, a in counts)
    mu = accepted / tried
    spread = sum(t * (a / t - mu) ** 2 for t, a in counts) / tried
    noise = mu * (1 - mu) * len(counts) / tried
    between = spread - noise
    m = mu * (1 - mu) / between - 1 if between > 0 else float("inf")
    return {"requests": len(counts), "tried": tried, "rate": mu, "spread": spread, "noise": noise, "m": m}


def main() -> None:
    from guard_variants import add_common_arguments, chat_prompts  # beside this file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    ap.set_defaults(prompts=24, batch=1)
    ap.add_argument("--method", default="auto")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specserve import LLM, SamplingParams

    llm = LLM(a.model, max_num_seqs=a.batch, speculative={"method": a.method})
    acceptance = llm.engine.core.speculator.acceptance
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    observe = acceptance.observe

    def counting(drafter, request_id, tree, accepted) -> None:
        observe(drafter, request_id, tree, accepted)
        if len(tree):
            c = counts[(drafter, request_id)]
            c[0] += 1
            c[1] += 0 in accepted

    acceptance.observe = counting  # type: ignore[method-assign]
    prompts = chat_prompts(a, llm.tokenizer)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    by_drafter: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (drafter, _), (t, acc) in counts.items():
        by_drafter[drafter].append((t, acc))
    result = {"model": a.model, "dataset": a.dataset, "prompts": len(prompts), "batch": a.batch, "method": a.method,
              "seconds": seconds, "prior_weight": acceptance.prior_weight,
              "drafters": {d: concentration(c) | {"rates": sorted(acc / t for t, acc in c)} for d, c in by_drafter.items()}}
    print(f"{a.dataset}, {len(prompts)} prompts, batch {a.batch}: the acceptance model's prior weight {acceptance.prior_weight}")
    for d, r in sorted(result["drafters"].items()):
        print(f"  {d:10s} {r['requests']:4d} requests, {r['tried']:5d} first nodes tried, rate {r['rate']:.3f}, "
              f"spread {r['spread']:.4f} (noise {r['noise']:.4f}): m ~ {r['m']:.1f}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
