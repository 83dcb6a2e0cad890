"""Forward time by rows: k new tokens (k = 1..16, every row's logits kept, as a verified draft
chain or a batch needs them) after a cached prefix, for specserve in process and, in the same
run, llama.cpp's `llama-bench -p k -n 0 -d CONTEXT` on the same GGUF file. Rounds alternate
between the engines; each figure is the median of its samples.

    python benchmarks/rows_per_forward.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf \\
        --llama-bench ~/llama-build/bin/llama-bench --json benchmarks/rows_per_forward_cpu.json \\
        --plot benchmarks/rows_per_forward_cpu.png

A prompt's prefill the same way: `--context 0 --rows 512 --logits last` (llama-bench -p 512 -n 0).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def specserve_round(runner, table: list[int], context: int, rows: list[int], reps: int,
                    logits: str = "all") -> dict[int, list[float]]:
    from specserve.model.forward import ForwardItem

    out: dict[int, list[float]] = {k: [] for k in rows}
    with torch.inference_mode():
        for _ in range(reps):
            for k in rows:
                item = ForwardItem(table, context, [17] * k, logits=logits)
                start = time.perf_counter()
                runner.run([item])
                out[k].append(time.perf_counter() - start)
    return out


def llama_round(binary: str, model: str, threads: int, context: int, rows: list[int], reps: int) -> dict[int, list[float]]:
    cmd = [binary, "-m", model, "-t", str(threads), "-p", ",".join(map(str, rows)), "-n", "0", "-d", str(context),
           "-r", str(reps), "-o", "json"]
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {int(r["n_prompt"]): [ns / 1e9 for r2 in [r] for ns in r["samples_ns"]] for r in res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="samples per row count per round")
    p.add_argument("--logits", choices=["all", "last"], default="all",
                   help="logits of every new row (verification) or of the last only (a prompt's prefill, "
                        "as llama-bench's -p measures it)")
    p.add_argument("--llama-bench", help="path of llama-bench, to measure llama.cpp in the same run")
    p.add_argument("--spec-args", default="{}", help="LLM options as JSON (e.g. '{\"quantization\": \"gguf\"}')")
    p.add_argument("--json")
    p.add_argument("--plot")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    torch.set_num_threads(a.threads)
    from specserve import LLM

    llm = LLM(a.model, threads=a.threads, speculative="none", max_model_len=a.context + max(rows) + 64,
              max_num_batched_tokens=max(2048, max(rows)),
              **json.loads(a.spec_args))
    runner = llm.engine.runner
    block = runner.block_size
    table = list(range((a.context + max(rows)) // block + 2))
    from specserve.model.forward import ForwardItem

    if a.context:
        with torch.inference_mode():
            runner.run([ForwardItem(table, 0, [11] * a.context, logits="none")])  # the cached prefix
    samples: dict[str, dict[int, list[float]]] = {"specserve": {k: [] for k in rows}, "llama.cpp": {k: [] for k in rows}}
    for r in range(a.rounds):
        order = ["specserve", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "specserve"]
        for engine in order:
            if engine == "specserve":
                got = specserve_round(runner, table, a.context, rows, a.reps, a.logits)
            elif a.llama_bench:
                got = llama_round(a.llama_bench, a.model, a.threads, a.context, rows, a.reps)
            else:
                continue
            for k, v in got.items():
                samples[engine][k].extend(v)
    result = {"model": a.model, "cpu": cpu_name(), "threads": a.threads, "context": a.context, "rows": rows,
              "command": " ".join(__import__("sys").argv), "ms": {}}
    print(f"{'rows':>5} " + " ".join(f"{e:>22}" for e in samples if samples[e][rows[0]]))
    for engine, by_k in samples.items():
        if by_k[rows[0]]:
            result["ms"][engine] = {k: statistics.median(v) * 1e3 for k, v in by_k.items()}
    for k in rows:
        cells = []
        for engine, ms in result["ms"].items():
            cells.append(f"{ms[k]:8.1f} ms ({ms[k] / ms[rows[0]]:4.2f}x 1 row)")
        print(f"{k:>5} " + " ".join(f"{c:>22}" for c in cells))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for engine, ms in result["ms"].items():
            ax.plot(rows, [k / (ms[k] / 1e3) for k in rows], marker="o", label=engine)
        ax.set_xlabel("rows per forward (new tokens, after a cached prefix of %d)" % a.context)
        ax.set_ylabel("rows per second")
        ax.set_title(f"{Path(a.model).name}, {a.threads} threads\n{result['cpu']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
