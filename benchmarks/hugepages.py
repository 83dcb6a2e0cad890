"""The weights in 2 MB pages (`--huge-pages`, specserve.model.huge_pages) against 4 KB pages, each
mode in processes of its own: `off` (4 KB pages), `auto` (the default: collapsed in place on a thread
once the engine is built; the process waits for it before timing, and records how long it took) and
`load` (moved at load into one mapping). Each process loads the model and decodes --tokens greedy
tokens at batch 1, three times; the modes take turns, the order rotated every round, --rounds rounds.
Prints and records each process's load time, decode tok/s (median of its three) and the anonymous
huge pages it holds; the summary gives each mode's tok/s over `off`'s in the same round. (Session
16's version compared PyTorch's own switch, THP_MEM_ALLOC_ENABLE=1, which gives 2 MB pages only to
single allocations of 2 MB and more: hugepages_1p5b_zen5_s16_cpu.json; session 34's compared `load`
with `off` as "huge" and "4k".)

    python benchmarks/hugepages.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf --rounds 4 \\
        --json benchmarks/hugepages_modes_1p5b_xeon_s36_cpu.json
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
llm = LLM(sys.argv[1], threads=2, speculative=None, huge_pages=sys.argv[3])
load = time.perf_counter() - t
llm.wait_for_huge_pages()
collapse = llm.huge_pages.seconds if llm.huge_pages is not None else None
params = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0, ignore_eos=True)
prompt = "Write a long story about a dragon."
llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
rates = []
for _ in range(3):
    t = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)
    rates.append(len(out[0].token_ids) / (time.perf_counter() - t))
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(json.dumps({"load_s": load, "collapse_s": collapse, "tok_s": statistics.median(rates),
                  "anon_huge": huge[0].split(":")[1].strip() if huge else "?"}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default="off,auto,load", help="huge_pages modes, comma-separated; the first is the base")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    modes = a.modes.split(",")
    runs: list[dict[str, object]] = []
    for r in range(a.rounds):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            line = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.tokens), mode], capture_output=True,
                                  text=True, check=True).stdout.strip().splitlines()[-1]
            row = dict(json.loads(line), round=r, mode=mode)
            runs.append(row)
            print(row, flush=True)
    rate = {(row["round"], row["mode"]): row["tok_s"] for row in runs}
    summary: dict[str, object] = {}
    for mode in modes:
        ratios = [rate[r, mode] / rate[r, modes[0]] for r in range(a.rounds)]  # type: ignore[operator]
        summary[mode] = {"tok_s_over_" + modes[0] + "_median": round(statistics.median(ratios), 3),
                         "ratios": [round(x, 3) for x in ratios],
                         "load_s": [round(row["load_s"], 2) for row in runs if row["mode"] == mode],  # type: ignore[arg-type]
                         "collapse_s": [None if row["collapse_s"] is None else round(row["collapse_s"], 2)  # type: ignore[arg-type]
                                        for row in runs if row["mode"] == mode]}
    print(json.dumps(summary, indent=1))
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
