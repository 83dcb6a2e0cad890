"""One activation row through every quantized tensor of a GGUF (each projection and the LM head, as
a decode step reads them) against the machine's read bandwidth, measured in the same run by a
stream-like probe: a sum over the same mapped bytes and over a fresh 1 GiB buffer (int64 lanes,
all threads). Rounds alternate; medians.

    python benchmarks/gemv_bandwidth.py --gguf ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--isa", default=None, help="kernel variant (default: the best this CPU runs)")
    p.add_argument("--layout", choices=["file", "packed"], default="packed",
                   help="Q4_K as the file stores it, or packed as the variant reads it (x8 for avx2, x16 for "
                        "avx512vnni: what the engine picks)")
    p.add_argument("--prefetch", default="next-group",
                   help="the packed kernels' prefetch policy (quant.PREFETCH_POLICIES; the engine's is the machine's "
                        "timed choice, logged at load as `prefetch NAME`)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from specserve.model import ops
    from specserve.model.gguf_file import QUANTIZED, GGUFFile

    ops.load()
    isa_name = a.isa or ops.runnable_isas()[-1]
    isa = ops.isa_id(isa_name)
    from specserve.model.quant import PREFETCH_POLICIES

    prefetch = PREFETCH_POLICIES[a.prefetch]
    g = GGUFFile(a.gguf)
    from specserve.model.quant import pack_gguf_parts

    tensors = [(g.data(n), t.type_id, t.cols) for n, t in g.tensors.items()
               if t.type_name in QUANTIZED and n != "token_embd.weight"]
    if a.layout == "packed" and isa_name in ops.PACKED_LAYOUTS:
        layout = ops.PACKED_LAYOUTS[isa_name]
        tensors = [(p[0], ty[0], k) for w, t, k in tensors for p, ty in [pack_gguf_parts([w], [t], layout)]]
    total = sum(w.numel() for w, _, _ in tensors)
    xs = {k: torch.randn(1, k) for k in {c for _, _, c in tensors}}
    fresh = torch.ones(1 << 27, dtype=torch.int64)  # 1 GiB

    def gemv() -> float:
        start = time.perf_counter()
        for w, t, k in tensors:
            torch.ops.specserve.gguf_linear(xs[k], [w], [t], None, isa, prefetch)
        return total / (time.perf_counter() - start)

    def probe_mapped() -> float:
        start = time.perf_counter()
        for w, _, _ in tensors:
            w.reshape(-1)[: w.numel() // 8 * 8].view(torch.int64).sum()
        return total / (time.perf_counter() - start)

    def probe_fresh() -> float:
        start = time.perf_counter()
        fresh.sum()
        return fresh.numel() * 8 / (time.perf_counter() - start)

    runs: dict[str, list[float]] = {"gemv": [], "probe (mapped weights)": [], "probe (1 GiB buffer)": []}
    for _ in range(a.rounds):
        runs["probe (1 GiB buffer)"].append(probe_fresh())
        runs["gemv"].append(gemv())
        runs["probe (mapped weights)"].append(probe_mapped())
    med = {k: statistics.median(v) / 1e9 for k, v in runs.items()}
    for k, v in med.items():
        print(f"{k:>24}: {v:5.1f} GB/s")
    best_probe = max(med["probe (mapped weights)"], med["probe (1 GiB buffer)"])
    print(f"gemv: {total / 1e6:.0f} MB per row in {total / med['gemv'] / 1e6:.1f} ms, "
          f"{med['gemv'] / best_probe:.0%} of the probe's bandwidth")
    if a.json:
        a.json.write_text(json.dumps({"gguf": a.gguf, "layout": a.layout, "prefetch": a.prefetch, "threads": a.threads,
                                      "bytes": total, "gb_per_s": med,
                                      "ratio": med["gemv"] / best_probe}, indent=1))


if __name__ == "__main__":
    main()
