"""What a verified draft node costs one forward, measured alone: B requests at a fixed cached context,
each carrying a draft chain of k nodes (k = 0 is a plain decode step), the same shape repeated
after a warm-up so first-call costs (new shapes in cuBLAS or SDPA) stay out, each forward timed with
the device synchronized, median of the repeats. The runner is called directly with made-up block
tables over the engine's K/V cache (its contents do not matter for time).

With --trace-dir, torch.profiler records a few forwards at k = 0 and at the largest k, writes the
top operators by host and by device time, and a gzipped Chrome trace of one forward of each.

    python benchmarks/gpu_verify_cost.py --batches 1,8,32 --nodes 0,1,2,4,8,15 --trace-dir gpu_out
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a named shape, random weights")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--nodes", default="0,1,2,4,8,15")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the step")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--trace-dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from specserve import LLM
    from specserve.model.forward import ForwardItem
    from specserve.speculation.tree import DraftTree

    device = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    llm = LLM(a.model, load_format="dummy", device=a.device, dtype=a.dtype, speculative=None)
    runner = llm.engine.core.runner
    bs = runner.block_size
    num_blocks = runner.kv_cache[0][0].shape[0]
    vocab = llm.engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def items(batch: int, k: int) -> list[ForwardItem]:
        per = -(-(a.context + k + 1) // bs)
        if batch * per + 1 > num_blocks:
            raise SystemExit(f"--context {a.context} x batch {batch} needs {batch * per + 1} blocks; the cache has {num_blocks}")
        out = []
        for r in range(batch):
            table = list(range(1 + r * per, 1 + (r + 1) * per))
            root = torch.randint(0, vocab, (1,), generator=g).tolist()
            if k == 0:
                out.append(ForwardItem(table, a.context, root))
                continue
            tree = DraftTree.chain(torch.randint(0, vocab, (k,), generator=g).tolist())
            out.append(ForwardItem(table, a.context, root + list(tree.tokens),
                                   positions=[a.context] + [a.context + d for d in tree.depths()],
                                   mask=tree.ancestor_mask(), logits="all"))
        return out

    def timed(its: list[ForwardItem]) -> float:
        sync()
        t = time.perf_counter()
        runner.run(its)
        sync()
        return time.perf_counter() - t

    rows = []
    batches = [int(x) for x in a.batches.split(",")]
    nodes = [int(x) for x in a.nodes.split(",")]
    for b in batches:
        base = None
        for k in nodes:
            its = items(b, k)
            for _ in range(3):
                timed(its)
            ms = statistics.median(timed(its) for _ in range(a.repeats)) * 1e3
            base = ms if k == 0 else base
            row = {"batch": b, "nodes": k, "rows": b * (k + 1), "forward_ms": round(ms, 2),
                   "vs_plain": round(ms / base, 3) if base else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.trace_dir:
        from torch.profiler import ProfilerActivity, profile

        a.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        b = batches[-1]
        for k in (0, max(nodes)):
            its = items(b, k)
            for _ in range(3):
                timed(its)
            with profile(activities=activities) as prof:
                for _ in range(3):
                    timed(its)
            ev = prof.key_averages()
            table = (f"batch {b}, {k} nodes, 3 forwards\n"
                     + ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
                     + "\n" + ev.table(sort_by="self_device_time_total" if device.type == "cuda" else "cpu_time_total",
                                       row_limit=25, max_name_column_width=60))
            (a.trace_dir / f"verify_ops_b{b}_k{k}.txt").write_text(table)
            print(table.splitlines()[0], "->", a.trace_dir / f"verify_ops_b{b}_k{k}.txt", flush=True)
            with profile(activities=activities) as prof:
                timed(its)
            raw = a.trace_dir / f"verify_trace_b{b}_k{k}.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as f_in, gzip.open(str(raw) + ".gz", "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
            raw.unlink()
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(__import__("sys").argv), "model": a.model,
                                      "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                                      "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
