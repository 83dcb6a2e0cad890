"""How close each quantization setting stays to float32 on the bundled model.

    python benchmarks/quant_accuracy.py [--json out.json]

- Greedy agreement on Spec-Bench (first question of each of the 13 categories, chat template,
  256 tokens): per prompt, how many leading tokens equal float32's, and the share of equal tokens
  position by position.
- Perplexity on a held text: ShareGPT replies (the assistant's turns) in file order, 16,000 tokens,
  scored in chunks of 256 tokens by the engine's own forward (every position's logits).

Settings: none (float32, the reference), int8 (W8A8), int4 (W4A8; the GGUF's own Q4_1 blocks).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.bench.datasets import SampleSpec, open_dataset
from specserve.engine.model_runner import ForwardItem
from specserve.tokenizer import apply_chat_template

SETTINGS = ("none", "int8", "int4")


def held_text_ids(llm: LLM, n_tokens: int) -> list[int]:
    """The ShareGPT replies in file order, tokenized back to back, up to n_tokens."""
    from specserve.bench.datasets import ShareGPT

    ids: list[int] = []
    for pair in ShareGPT().pairs()[0]:
        ids.extend(llm.tokenizer(pair.reply).input_ids)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], chunk: int = 256) -> float:
    """exp(mean NLL) of each token given the ones before it, within windows of `chunk` tokens
    continued over a growing cache of up to 1024 tokens (then restarted)."""
    runner = llm.engine.runner
    bs = runner.block_size
    window = 1024
    nll, count = 0.0, 0
    for w0 in range(0, len(ids) - 1, window):
        piece = ids[w0 : w0 + window + 1]
        table = list(range(-(-len(piece) // bs)))
        for s in range(0, len(piece) - 1, chunk):
            tokens = piece[s : s + chunk]
            out = runner.run([ForwardItem(table, s, tokens, logits="all")])
            targets = torch.tensor(piece[s + 1 : s + 1 + len(tokens)])
            logp = torch.log_softmax(out.logits[: len(targets)], dim=-1)
            nll -= float(logp.gather(1, targets[:, None]).sum())
            count += len(targets)
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--held-tokens", type=int, default=16000)
    a = ap.parse_args()
    samples = open_dataset("spec-bench", None).sample(SampleSpec(seed=None, per_category=1)).samples
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    outputs: dict[str, list[list[int]]] = {}
    results = []
    held: list[int] | None = None
    for setting in SETTINGS:
        llm = LLM(quantization=setting)
        if held is None:
            held = held_text_ids(llm, a.held_tokens)
        prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": s.prompt}]) for s in samples]
        t = time.perf_counter()
        outputs[setting] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        gen_s = time.perf_counter() - t
        ppl = perplexity(llm, held)
        results.append({"setting": setting, "perplexity": round(ppl, 3), "held_tokens": len(held),
                        "generate_seconds": round(gen_s, 1)})
        print(f"{setting}: perplexity {ppl:.3f} on {len(held)} tokens", flush=True)
        del llm
    ref = outputs["none"]
    for r in results:
        mine = outputs[r["setting"]]
        prefixes, equal = [], []
        for x, y in zip(mine, ref):
            n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            prefixes.append(n)
            equal.append(sum(p == q for p, q in zip(x, y)) / max(len(x), len(y)))
        r["identical_prompts"] = sum(x == y for x, y in zip(mine, ref))
        r["median_identical_prefix"] = statistics.median(prefixes)
        r["mean_equal_positions"] = round(statistics.fmean(equal), 3)
    print(f"{'setting':<8} {'ppl':>8} {'identical':>10} {'median prefix':>14} {'equal positions':>16}")
    for r in results:
        print(f"{r['setting']:<8} {r['perplexity']:>8.3f} {r['identical_prompts']:>7}/13 "
              f"{r['median_identical_prefix']:>14} {r['mean_equal_positions']:>16.3f}")
    if a.json:
        a.json.write_text(json.dumps({"results": results, "prompts": len(samples), "max_tokens": a.max_tokens},
                                     indent=2))


if __name__ == "__main__":
    main()
