"""What an FR-Spec LM head buys a draft model: the 0.5B draft's head cut to its N most frequent rows
(its own GGUF blocks for those rows, the rest of the vocabulary never proposed), against the full
head, both drafting for the 1.5B target with a fixed budget of K tokens, on Spec-Bench's 13
first questions (greedy, 128 tokens, the two engines taking each prompt in turn); and a one-token
forward of the target and of the draft (each head) timed in turn, what a draft token costs.

The rows are ranked by their count in HumanEval's prompts (not the measured ones), ties broken by
token id, or (`--census ids`) by token id alone (byte-level BPE ids run roughly from frequent to
rare: the rule the engine's `--draft-vocab` took from these runs); `--q4-0` rounds the kept rows to
Q4_0 and packs them, as the draft's full head is. The cut head is patched onto the draft model here
(any set of rows; the engine's own cut, LlamaForCausalLM.read_out_vocabulary, keeps spans of ids),
and the engine's own cut is off in both engines.

    python benchmarks/draft_frspec.py --target $M --draft $D --rows 32768 --tokens 2 --json out.json
    python benchmarks/draft_frspec.py --target $M --draft $D --rows 32768 --census ids --q4-0 --tokens 3
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--rows", type=int, default=32768, help="head rows kept (the most frequent tokens)")
    ap.add_argument("--tokens", type=int, default=2, help="draft tokens a step (fixed controller)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--census", choices=("humaneval", "ids"), default="humaneval",
                    help="how rows are ranked: token counts in HumanEval's prompts, or the token id alone "
                         "(byte-level BPE: merge order, roughly frequent to rare); added tokens always kept")
    ap.add_argument("--q4-0", action="store_true",
                    help="the cut rows rounded to Q4_0 and packed, as the draft's full head is by default "
                         "(without: the embedding's own blocks, Q8_0 for the 0.5B)")
    ap.add_argument("--method", choices=("draft-model", "auto"), default="draft-model",
                    help="draft-model with a fixed K, or the default: auto with the draft model beside the lookups")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import SampleSpec, open_dataset
    from specserve.model.quant import GGUFLinearKernel, pack_gguf_parts

    def make(rows: torch.Tensor | None):  # type: ignore[no-untyped-def]
        spec = (dict(method="draft-model", draft_model=a.draft, num_tokens=a.tokens, controller="fixed")
                if a.method == "draft-model" else dict(method="auto", draft_model=a.draft))
        spec["draft_vocab"] = None  # the engine's own cut off: this script makes the cut it measures
        llm = LLM(a.target, threads=a.threads, speculative=spec)
        model = llm.engine.core.speculator.drafters["draft-model"].forward.__self__.model
        if rows is not None:
            emb = model.embed_tokens  # the tied head's own blocks, one row per token
            isa = model.lm_head.kernel.isa
            parts, types = [emb.blocks[rows].contiguous()], [emb.type_id]
            if a.q4_0:  # rounded as the draft's own head is (draft_quantization q4_0), and packed as it is
                from specserve.model import ops
                from specserve.model.gguf_model import requantize_q4_0

                parts, types = map(list, zip(requantize_q4_0(parts[0], types[0], model.config.hidden_size)))
                if (layout := ops.PACKED_LAYOUTS.get(isa)) is not None:
                    parts, types = pack_gguf_parts(parts, types, layout)
            cut = GGUFLinearKernel(parts, types, None, isa)
            vocab = model.config.vocab_size

            def logits(h: torch.Tensor) -> torch.Tensor:
                out = torch.full((h.shape[0], vocab), float("-inf"))
                out[:, rows] = cut(h.float())
                return out

            model.compute_logits = logits
        return llm, model

    full, full_model = make(None)
    counts: collections.Counter = collections.Counter()
    if a.census == "humaneval":
        for x in open_dataset("humaneval", None).sample(SampleSpec(seed=0, num=164, output_len=a.max_tokens)).samples:
            counts.update(full.tokenizer.encode(x.prompt))
    order = sorted(range(full_model.config.vocab_size), key=lambda i: (-counts[i], i))
    added = set(getattr(full.tokenizer, "added_tokens_decoder", {}) or {})
    kept = set(order[: a.rows]) | {i for i in added if i < full_model.config.vocab_size}
    for i in order[a.rows:]:  # whole groups of 16 rows, as the packed layouts take them
        if len(kept) % 16 == 0:
            break
        kept.add(i)
    rows = torch.tensor(sorted(kept))
    cut, cut_model = make(rows)

    h = torch.randn(1, full_model.config.hidden_size)

    def ms(fn, n: int = 20) -> float:  # type: ignore[no-untyped-def]
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return round(statistics.median(ts) * 1e3, 3)

    head_ms = {"full": ms(lambda: full_model.compute_logits(h)), "cut": ms(lambda: cut_model.compute_logits(h))}
    # One-token forwards after 200 cached tokens (made-up block tables: the cached values do not
    # matter for time), the target's and each draft's taken in turn, the median of 15 turns each.
    from specserve.model.forward import ForwardItem

    item = [ForwardItem(list(range(14)), 200, [100])]
    turns = {"target": full.engine.core.runner.run,
             "draft full head": full.engine.core.speculator.drafters["draft-model"].forward,
             "draft cut head": cut.engine.core.speculator.drafters["draft-model"].forward}
    from draft_variants import forwards_in_turn  # benchmarks/, this script's directory

    forward_ms = forwards_in_turn(turns, item)
    print("one-token forward ms:", json.dumps(forward_ms), flush=True)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    totals = {name: dict(seconds=0.0, tokens=0, accepted=0, drafted_steps=0) for name in ("full", "cut")}
    for x in open_dataset("spec-bench", None).sample(SampleSpec(seed=None, per_category=1, output_len=a.max_tokens)).samples:
        for name, llm in (("full", full), ("cut", cut)):
            t = time.perf_counter()
            o = llm.chat([{"role": "user", "content": x.prompt}], params, use_tqdm=False)[0]
            row = totals[name]
            row["seconds"] += time.perf_counter() - t
            row["tokens"] += len(o.token_ids)
            row["accepted"] += o.metrics.speculation.accepted
            row["drafted_steps"] += o.metrics.speculation.steps
    result = {}
    for name, row in totals.items():
        result[name] = dict(row, head_ms=head_ms[name], tok_s=round(row["tokens"] / row["seconds"], 1),
                            accepted_per_step=round(row["accepted"] / max(row["drafted_steps"], 1), 3))
        print(name, json.dumps(result[name]), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(__import__("sys").argv), "rows": a.rows,
                                      "tokens": a.tokens, "forward_ms": forward_ms, "result": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
