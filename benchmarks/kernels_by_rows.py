"""Every quantized projection of a GGUF model once (one `gguf_linear` call per tensor, as a forward
makes them), for each kernel candidate this CPU runs (variant x layout: the file's blocks, or Q4_K
packed as the variant reads it), at several row counts. Candidates alternate round by round;
each figure is the median of its rounds. What a forward's projections cost by rows, without
attention or the rest of the step.

    python benchmarks/kernels_by_rows.py --gguf ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf \\
        --rows 1,2,4,8,16 --json benchmarks/kernels_by_rows_1p5b_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--candidates", default=None,
                   help="comma-separated isa or isa-layout names (default: every one this CPU runs)")
    p.add_argument("--types", default=None, help="only tensors of these ggml types (e.g. Q6_K)")
    p.add_argument("--names", default=None, help="only tensors whose names contain one of these (e.g. ffn_down,output)")
    p.add_argument("--prefetch", default="next-group",
                   help="the packed kernels' prefetch policies (quant.PREFETCH_POLICIES), comma-separated: "
                        "each packed candidate runs under each, named CANDIDATE@POLICY where more than one")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from specserve.model import ops
    from specserve.model.gguf_file import QUANTIZED, GGUFFile
    from specserve.model.quant import PREFETCH_POLICIES, pack_gguf_parts

    ops.load()
    g = GGUFFile(a.gguf)
    types = set(a.types.split(",")) if a.types else QUANTIZED
    names = a.names.split(",") if a.names else None
    chosen = {n: t for n, t in g.tensors.items() if t.type_name in QUANTIZED & types and n != "token_embd.weight"
              and (names is None or any(s in n for s in names))}
    tensors = [(g.data(n), t.type_id, t.cols) for n, t in chosen.items()]
    policies = a.prefetch.split(",")
    candidates: dict[str, tuple[int, list[tuple[torch.Tensor, int, int]], int]] = {}
    for isa in ops.runnable_isas():
        if isa == "generic":
            continue
        candidates[isa] = (ops.isa_id(isa), tensors, PREFETCH_POLICIES["next-group"])
        layout = ops.PACKED_LAYOUTS.get(isa)
        if layout is not None:
            packed = [(pp[0], ty[0], k) for w, t, k in tensors for pp, ty in [pack_gguf_parts([w], [t], layout)]]
            for policy in policies:
                name = f"{isa}-{layout.name}" + (f"@{policy}" if len(policies) > 1 else "")
                candidates[name] = (ops.isa_id(isa), packed, PREFETCH_POLICIES[policy])
    if a.candidates:
        candidates = {n: candidates[n] for n in a.candidates.split(",")}
    rows = [int(r) for r in a.rows.split(",")]
    xs = {(m, k): torch.randn(m, k) for m in rows for k in {c for _, _, c in tensors}}
    weights = sum(t.rows * t.cols for t in chosen.values())

    def once(isa: int, ts: list[tuple[torch.Tensor, int, int]], prefetch: int, m: int) -> float:
        start = time.perf_counter()
        for w, t, k in ts:
            torch.ops.specserve.gguf_linear(xs[(m, k)], [w], [t], None, isa, prefetch)
        return time.perf_counter() - start

    samples: dict[str, dict[int, list[float]]] = {n: {m: [] for m in rows} for n in candidates}
    for name, (isa, ts, prefetch) in candidates.items():  # warm every candidate once
        once(isa, ts, prefetch, 1)
    for r in range(a.rounds):
        for name, (isa, ts, prefetch) in candidates.items():
            for m in rows:
                samples[name][m].append(once(isa, ts, prefetch, m))
    print(f"{cpu_name()}, {a.threads} threads, {weights / 1e9:.2f} G weights; ms (median of {a.rounds}) and x one row")
    print("candidate".ljust(28) + "".join(f"{m:>16}" for m in rows))
    result = {}
    for name in candidates:
        med = {m: statistics.median(samples[name][m]) for m in rows}
        result[name] = {str(m): med[m] for m in rows}
        print(name.ljust(28) + "".join(f"{med[m] * 1e3:9.1f} {med[m] / med[rows[0]]:5.2f}x" for m in rows))
    if a.json:
        a.json.write_text(json.dumps({"gguf": a.gguf, "cpu": cpu_name(), "threads": a.threads, "rounds": a.rounds,
                                      "seconds": result, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
