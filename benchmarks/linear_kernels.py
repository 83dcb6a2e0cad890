"""Time the bundled model's 121 projection shapes through four CPU matmul paths, at several row counts.

    python benchmarks/linear_kernels.py

Random float32 weights of SmolLM2-135M's shapes (30 layers x q/k/v, o, gate/up, down, plus the LM head);
prints the median time of one pass over all of them.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def bench(fn, n: int = 6) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    torch.manual_seed(0)
    ws = [torch.randn(*s) for s in SHAPES]
    wts = [w.t().contiguous() for w in ws]
    mk = [w.to_mkldnn() for w in ws]
    blocked = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
    print(f"{'M':>4} {'F.linear':>10} {'x@W^T':>10} {'mkldnn_linear':>14} {'blocked':>10}  (ms per pass)")
    with torch.no_grad():
        for m in (1, 4, 32, 256):
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            a = bench(lambda: [F.linear(xs[w.shape[1]], w) for w in ws])
            b = bench(lambda: [xs[w.shape[0]] @ w for w in wts])
            c = bench(lambda: [torch._C._nn.mkldnn_linear(xs[w.shape[1]].to_mkldnn(), w, None).to_dense() for w in mk])
            d = bench(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                               for w, p in zip(ws, blocked)])
            print(f"{m:>4} {a:>10.1f} {b:>10.1f} {c:>14.1f} {d:>10.1f}")


if __name__ == "__main__":
    main()
