"""Output tok/s of one `LLM.generate` over 16 Spec-Bench chat prompts on the bundled model (greedy,
96 tokens each), for comparing two checkouts of the engine in the same run (a refactor must keep
the speed):

    for r in 1 2 3; do for d in /path/to/before /path/to/after; do
      (cd $d && PYTHONPATH=$d python benchmarks/generate_speed.py --spec none); done; done

(the checkout without its own build needs the compiled specserve/_C*.so copied in).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specserve import LLM, SamplingParams
from specserve.bench.throughput import load_spec_bench_prompts
from specserve.tokenizer import apply_chat_template


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="auto", help="speculative method (none, auto, ngram, ...)")
    p.add_argument("--dataset", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/spec_bench_question.jsonl")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args()
    llm = LLM(threads=2, speculative=a.spec)
    llm.wait_for_huge_pages()
    texts = load_spec_bench_prompts(a.dataset, a.prompts)
    prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"spec": a.spec, "tok_s": sum(len(o.token_ids) for o in outs) / seconds}))


if __name__ == "__main__":
    main()
