"""Issue 26's third target, `auto` >= `none` at batch 1, 4 and 8 on every dataset, as A B B A pairs:
`auto_drafter_sets.py` (beside this file) once for each dataset and batch, each in a fresh process,
and one table of A over B with the copies' spread (how far a variant's two copies disagree: the
run's noise). A `bench spec` matrix builds one engine per method in a fixed order and cannot tell a
few percent (`none-again` read 0.92-1.03 in session 39); A B B A can.

    python benchmarks/abba_matrix.py --a auto --b none --json benchmarks/abba_auto_vs_none_bundled.json
    python benchmarks/abba_matrix.py --model $M --draft $D --batches 1,4 --datasets humaneval --a auto --b none

Prompts per copy: --n1 at batch 1, --n4 at 4, --n8 at 8 (Spec-Bench: per category, --n1 // 12 at
batch 1 and so on, at least 1). Each pair's JSON goes beside the combined one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Spec-Bench takes prompts per category (13 of them): about as many prompts in all as the others get.
SPEC_BENCH_SHARE = 12


def prompts(dataset: str, batch: int, per_batch: dict[int, int]) -> int:
    """Prompts per copy for `dataset` at `batch` (per category for Spec-Bench)."""
    n = per_batch.get(batch, 4 * batch)
    return max(1, n // SPEC_BENCH_SHARE) if dataset == "spec-bench" else n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="auto")
    ap.add_argument("--b", default="none")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--datasets", default="spec-bench,humaneval,sharegpt")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--n1", type=int, default=24)
    ap.add_argument("--n4", type=int, default=48)
    ap.add_argument("--n8", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    per_batch = {1: a.n1, 4: a.n4, 8: a.n8}
    stem = a.json.with_suffix("")
    rows = []
    for dataset in a.datasets.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            out = Path(f"{stem}_{dataset}_b{batch}.json")
            n = prompts(dataset, batch, per_batch)
            cmd = [sys.executable, str(HERE / "auto_drafter_sets.py"), "--dataset", dataset, "--batch", str(batch),
                   "--n", str(n), "--max-tokens", str(a.max_tokens),
                   "--a", a.a, "--b", a.b, "--json", str(out.resolve())]
            if a.model:
                cmd += ["--model", a.model]
            if a.draft:
                cmd += ["--draft", a.draft]
            started = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=HERE, stdout=subprocess.DEVNULL)
            result = json.loads(out.read_text())
            rows.append({"dataset": dataset, "batch": batch, "n": n,
                         "ratio": result["ratio"], "copy_spread": result["copy_spread"],
                         "tok_s": result["tok_s"], "json": out.name,
                         "seconds": round(time.perf_counter() - started, 1)})
            r = rows[-1]
            print(f"{dataset:<11} b{batch}  {a.a} over {a.b} {r['ratio']:.3f}x  copies "
                  f"{r['copy_spread'][0]:.3f}, {r['copy_spread'][1]:.3f}  ({r['seconds']:.0f} s)", flush=True)
            a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    print(f"\n| workload | {a.a} over {a.b} | copy against copy |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['dataset']} b{r['batch']}, n {r['n']} | {r['ratio']:.3f}x | "
              f"{r['copy_spread'][0]:.3f}, {r['copy_spread'][1]:.3f} |")


if __name__ == "__main__":
    main()
