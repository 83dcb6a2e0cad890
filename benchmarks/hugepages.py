"""The weights in 2 MB pages (--huge-pages, `LLM(huge_pages=True)`: specserve.model.huge_pages)
against 4 KB pages (the default). Each process loads the model and decodes
--tokens greedy tokens at batch 1, three times; the processes alternate, the order swapped every
other pair (4k huge, huge 4k, ...), --pairs pairs. Prints and records each process's load time,
decode tok/s (median of its three) and the anonymous huge pages it holds. (Session 16's version
compared PyTorch's own switch, THP_MEM_ALLOC_ENABLE=1, which gives 2 MB pages only to single
allocations of 2 MB and more: hugepages_1p5b_zen5_s16_cpu.json.)

    python benchmarks/hugepages.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf --pairs 5 \\
        --json benchmarks/hugepages_1p5b_xeon_s34_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(2)
from specserve import LLM, SamplingParams
t = time.perf_counter()
llm = LLM(sys.argv[1], threads=2, huge_pages=sys.argv[3] == "huge")
load = time.perf_counter() - t
params = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0, ignore_eos=True)
prompt = "Write a long story about a dragon."
llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
rates = []
for _ in range(3):
    t = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)
    rates.append(len(out[0].token_ids) / (time.perf_counter() - t))
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(json.dumps({"load_s": load, "tok_s": statistics.median(rates), "anon_huge": huge[0].split(":")[1].strip() if huge else "?"}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    runs: list[dict[str, object]] = []
    for p in range(a.pairs):
        for pages in ("4k", "huge") if p % 2 == 0 else ("huge", "4k"):
            line = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.tokens), pages], capture_output=True,
                                  text=True, check=True).stdout.strip().splitlines()[-1]
            row = dict(json.loads(line), pair=p, huge=pages == "huge")
            runs.append(row)
            print(row, flush=True)
    by_pair = {(r["pair"], r["huge"]): r["tok_s"] for r in runs}
    ratios = [by_pair[p, True] / by_pair[p, False] for p in range(a.pairs)]  # type: ignore[operator]
    summary = {"decode_huge_over_4k_median": round(statistics.median(ratios), 3),
               "faster_pairs": sum(r > 1 for r in ratios), "pairs": len(ratios),
               "load_s_4k": [round(r["load_s"], 2) for r in runs if not r["huge"]],  # type: ignore[arg-type]
               "load_s_huge": [round(r["load_s"], 2) for r in runs if r["huge"]]}  # type: ignore[arg-type]
    print(summary)
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
