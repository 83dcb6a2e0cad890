"""What share of real text's tokens a draft vocabulary cut keeps (`--draft-vocab`): the first N
token ids (byte-level BPE ids run roughly from frequent to rare), against the N most frequent ids
counted on other text (FR-Spec's census: 3,000 ShareGPT replies), on 500 held-out ShareGPT replies
and on HumanEval's canonical solutions.

    python benchmarks/vocab_coverage.py --gguf $M --json benchmarks/vocab_coverage_qwen25_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="a GGUF file whose tokenizer is measured")
    ap.add_argument("--sizes", default="8192,16384,32768,65536")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve.bench.datasets import HumanEval, ShareGPT
    from specserve.model.gguf_model import gguf_tokenizer_dir
    from specserve.tokenizer import load_tokenizer

    tok = load_tokenizer(gguf_tokenizer_dir(Path(a.gguf)))
    pairs, _ = ShareGPT().pairs()
    random.Random(0).shuffle(pairs)
    census: collections.Counter = collections.Counter()
    for p in pairs[:3000]:
        census.update(tok.encode(p.reply, add_special_tokens=False))
    texts = {"sharegpt-heldout": [t for p in pairs[3000:3500] for t in tok.encode(p.reply, add_special_tokens=False)],
             "humaneval-solutions": [t for pr in HumanEval().problems()
                                     for t in tok.encode(pr["canonical_solution"], add_special_tokens=False)]}
    vocab = max(max(census), max(max(t) for t in texts.values())) + 1
    ranked = sorted(range(max(vocab, len(tok.get_vocab()))), key=lambda i: (-census[i], i))
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        by_id, by_count = set(range(n)), set(ranked[:n])
        row = {"rows": n}
        for name, toks in texts.items():
            row[f"{name}_by_id"] = round(sum(t in by_id for t in toks) / len(toks), 4)
            row[f"{name}_by_census"] = round(sum(t in by_count for t in toks) / len(toks), 4)
        rows.append(row)
        print(json.dumps(row))
    if a.json:
        a.json.write_text(json.dumps({"gguf": a.gguf, "command": " ".join(__import__("sys").argv),
                                      "tokens": {k: len(v) for k, v in texts.items()}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
