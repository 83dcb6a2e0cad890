"""How peaked a target's next-token distribution is over the answers a head trains on: the mean and
median probability of its choice and the mean entropy, over the head's draft vocabulary (what
`train-drafter --soft-tokens` trains against) at every answer position of the first feature shard;
the choice's probability over the whole vocabulary on the first 2000 of them.

    python benchmarks/target_peakedness.py --head OUT --model MODEL --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", type=Path, required=True, help="a train-drafter --out directory (head and data/)")
    p.add_argument("--model", required=True, help="the head's target")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    from safetensors.torch import load_file

    from specserve import LLM
    from specserve.model.eagle import lm_head_weight

    lm = lm_head_weight(LLM(a.model).engine.model).float()
    rows = lm[load_file(str(a.head / "model.safetensors"))["vocab_ids"].long()]
    shard = load_file(str(a.head / "data" / "features-00000.safetensors"))
    positions, start = [], 0
    for n, prompt in zip(shard["lengths"].tolist(), shard["prompt_lengths"].tolist()):
        positions += range(start + prompt - 1, start + n - 1)  # the states that chose each answer token
        start += n
    states = shard["hidden"].float()[torch.tensor(positions)]
    with torch.no_grad():
        probs = (states @ rows.T).softmax(-1)
        choice = probs.max(-1).values
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        full = (states[:2000] @ lm.T).softmax(-1).max(-1).values
    out = {"head": str(a.head), "model": a.model, "answer_positions": len(positions),
           "mean_choice_prob": choice.mean().item(), "median_choice_prob": choice.median().item(),
           "share_choice_prob_over_0.9": (choice > 0.9).float().mean().item(),
           "mean_entropy_nats": entropy.mean().item(), "mean_choice_prob_full_vocab_first2000": full.mean().item()}
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
