"""Plot a draft head's held-out accuracy against the training tokens it has seen, from the
`train_log.jsonl` that `specserve train-drafter` writes; several logs side by side (one colour a
run, one marker a depth) to compare recipes on the same data.

    python benchmarks/eagle_training.py OUT/train_log.jsonl --plot benchmarks/eagle_training_cpu.png
    python benchmarks/eagle_training.py A/train_log.jsonl B/train_log.jsonl --labels last-layer fused --plot x.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MARKERS = ("o", "s", "^", "v", "D")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("logs", type=Path, nargs="+")
    p.add_argument("--labels", nargs="*", default=None, help="one per log (default: the logs' directories)")
    p.add_argument("--plot", type=Path, required=True)
    p.add_argument("--title", default="EAGLE-style head for SmolLM2-135M, trained on a 2-core CPU")
    a = p.parse_args()
    labels = a.labels or [log.parent.name for log in a.logs]
    if len(labels) != len(a.logs):
        p.error(f"--labels: {len(labels)} labels for {len(a.logs)} logs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (log, label) in enumerate(zip(a.logs, labels)):
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "acc1" in r]
        tokens = [r["tokens_seen"] / 1e6 for r in rows]
        depths = sorted(int(k[3:]) for k in rows[-1] if k.startswith("acc") and k[3:].isdigit())
        for d in depths:
            ax.plot(tokens, [r[f"acc{d}"] for r in rows], color=f"C{i}", marker=MARKERS[(d - 1) % len(MARKERS)],
                    markersize=3, label=f"{label}: depth {d}" + ("+" if d == depths[-1] and d > 1 else ""))
        last = rows[-1]
        print(f"{label}: {len(rows)} evaluations; last at {last['tokens_seen']} tokens, {last['seconds']:.0f} s: "
              + ", ".join(f"acc{d} {last[f'acc{d}']:.3f}" for d in depths) + f", chain5 {last['chain5']:.2f}")
    ax.set_xlabel("training tokens seen (millions; epochs over the same answers)")
    ax.set_ylabel("held-out top-1 on the target's next token")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=7, ncol=max(1, len(a.logs)))
    ax.set_title(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
