"""Plot a draft head's held-out accuracy against the training tokens it has seen, from the
`train_log.jsonl` that `specserve train-drafter` writes.

    python benchmarks/eagle_training.py OUT/train_log.jsonl --plot benchmarks/eagle_training_cpu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("log", type=Path)
    p.add_argument("--plot", type=Path, required=True)
    p.add_argument("--title", default="EAGLE-style head for SmolLM2-135M, trained on a 2-core CPU")
    a = p.parse_args()
    rows = [json.loads(line) for line in a.log.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "acc1" in r]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["tokens_seen"] / 1e6 for r in rows]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(tokens, [r["acc1"] for r in rows], marker="o", label="top-1, target's features (depth 1)")
    left.plot(tokens, [r["acc2"] for r in rows], marker="s", label="top-1, head's own features (depth 2+)")
    left.set_xlabel("training tokens seen (millions; epochs over the same answers)")
    left.set_ylabel("held-out accuracy on the target's next token")
    left.set_ylim(0, 1)
    right = left.twinx()
    right.plot(tokens, [r["chain5"] for r in rows], color="gray", linestyle="--", label="est. accepted / 5-chain")
    right.set_ylabel("estimated accepted tokens per 5-token chain")
    right.set_ylim(0, 5)
    lines = left.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    left.set_title(a.title, fontsize=10)
    last = rows[-1]
    print(f"{len(rows)} evaluations; last at {last['tokens_seen']} tokens, {last['seconds']:.0f} s: "
          f"acc1 {last['acc1']:.3f}, acc2 {last['acc2']:.3f}, chain5 {last['chain5']:.2f}")
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
