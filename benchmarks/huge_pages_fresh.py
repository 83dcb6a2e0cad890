"""Plain decoding with the weights in 2 MB pages (the default) against 4 KB pages (--no-huge-pages),
each run in a fresh process holding one engine, as a server has it, in the order
huge 4k 4k huge huge 4k (so that neither gains from the machine's drift); batch 1, HumanEval
prompts one at a time. Prints each run's tokens per second and the ratio of the means.

    python benchmarks/huge_pages_fresh.py --model $M --n 8 --max-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ORDER = ("huge", "4k", "4k", "huge", "huge", "4k")


def child(a: argparse.Namespace) -> None:
    import torch

    from specserve import LLM, SamplingParams
    from specserve.bench.spec import load_questions, open_dataset
    from specserve.tokenizer import apply_chat_template

    torch.set_num_threads(a.threads)
    options: dict[str, Any] = {"model": a.model} if a.model else {}
    llm = LLM(**options, speculative=None, threads=a.threads, max_num_seqs=1, huge_pages=a.child == "huge")
    tok = llm.tokenizer
    questions = load_questions(open_dataset(a.dataset, None), a.n, a.max_tokens, tok)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for _, q in questions]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += sum(len(o.token_ids) for o in llm.generate([p], params, use_tqdm=False))
    print(json.dumps({"tok_s": tokens / (time.perf_counter() - start)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=("huge", "4k"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    runs = []
    for kind in ORDER:
        cmd = [sys.executable, __file__, "--child", kind, "--dataset", a.dataset, "--n", str(a.n),
               "--max-tokens", str(a.max_tokens), "--threads", str(a.threads)] + (["--model", a.model] if a.model else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rate = json.loads(out.strip().splitlines()[-1])["tok_s"]
        runs.append({"pages": kind, "tok_s": rate})
        print(f"{kind:5s} {rate:7.2f} tok/s", flush=True)
    mean = {k: statistics.mean(r["tok_s"] for r in runs if r["pages"] == k) for k in ("huge", "4k")}
    print(f"2 MB pages / 4 KB pages: {mean['huge'] / mean['4k']:.3f}x")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items() if k != "child"}, "runs": runs,
                                      "ratio": mean["huge"] / mean["4k"]}, indent=1))


if __name__ == "__main__":
    main()
