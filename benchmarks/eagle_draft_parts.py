"""Where an EAGLE head's drafting time goes: the drafter's stages and the head's projections, timed
with perf_counter wrappers (no profiler) over greedy code-editing requests at a fixed K.

    python benchmarks/eagle_draft_parts.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf \\
        --head heads/q15b-mix --prompts 2 --max-tokens 128

Prints milliseconds per propose call (one a decoding step at batch 1) for each stage and each of
the head's projections.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4, help="K, fixed")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import CodeEdit, SampleSpec
    from specserve.model.llama import Linear
    from specserve.tokenizer import apply_chat_template

    llm = LLM(a.model, threads=a.threads, speculative=dict(method="eagle", draft_model=a.head, num_tokens=a.tokens,
                                                           controller="fixed"))
    drafter = next(iter(llm.engine.speculator.drafters.values()))
    from speculator_parts import wrap  # beside this file

    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for name in ("propose", "_catch_up", "_grow", "_expand", "_children"):
        wrap(drafter, name, seconds, name, calls)
    wrap(drafter.head, "forward", seconds, "head forward", calls)
    wrap(drafter.readout, "forward", seconds, "readout (LM-head rows)", calls)
    for name, m in drafter.head.named_modules():
        if isinstance(m, Linear):
            wrap(m, "forward", seconds, f"  {name}", calls)
    tok = llm.tokenizer
    samples = CodeEdit().sample(SampleSpec(per_category=1), lambda x: len(tok.encode(x))).samples[: a.prompts]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    start = time.perf_counter()
    emitted = 0
    for s in samples:
        ids = apply_chat_template(tok, [{"role": "user", "content": s.prompt}])
        emitted += len(llm.generate([ids], params, use_tqdm=False)[0].token_ids)
    total = time.perf_counter() - start
    steps = max(1, calls["propose"])
    print(f"{emitted} tokens in {total:.2f} s, {steps} propose calls")
    for key in sorted(seconds, key=lambda k: -seconds[k]):
        print(f"{key:34s} {seconds[key] * 1000 / steps:7.2f} ms a step, {calls[key] / steps:4.2f} calls")


if __name__ == "__main__":
    main()
