"""The W4A8 kernel at one activation row: a 24576 x 576 int4 matrix (bytes read per second), and
the model's four projection shapes (microseconds each). Thread count from OMP_NUM_THREADS.

    OMP_NUM_THREADS=1 python benchmarks/w4a8_gemv.py; OMP_NUM_THREADS=2 python benchmarks/w4a8_gemv.py
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from specserve.model.quant import NativeInt4Kernel, quantize_int4


def median_seconds(f: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def main() -> None:
    torch.manual_seed(0)
    big = NativeInt4Kernel(quantize_int4(torch.randn(24576, 576) * 0.05), None)
    x = torch.randn(1, 576)
    t = median_seconds(lambda: big(x), 50)
    nbytes = big.packed.numel() + 4 * (big.scale.numel() + big.minimum.numel())
    print(f"{torch.get_num_threads()} threads: 24576 x 576 W4A8 at 1 row {t * 1e3:.3f} ms, {nbytes / t / 1e9:.1f} GB/s")
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        kernel = NativeInt4Kernel(quantize_int4(torch.randn(n, k) * 0.05), None)
        xk = torch.randn(1, k)
        print(f"  {n} x {k}: {median_seconds(lambda: kernel(xk), 200) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
