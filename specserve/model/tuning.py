"""Kernel choice by measurement: time each candidate kernel on the model's own shapes, at the row
counts a step uses, on the machine at hand, and keep the fastest.

Choices are cached per machine (CPU model and flags, or GPU name), PyTorch version and thread
count, in cache_root()/kernel-choices.json, so a model loads without re-timing on a machine that
has timed its shapes before. A candidate that raises is skipped.
"""

from __future__ import annotations

import hashlib
import logging
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specserve.isa import cache_root, cpu_info, keep, read_kept
from specserve.model import ops
from specserve.model.ops import PACKED_BY_ID
from specserve.model.quant import PREFETCH_POLICIES, GGUFLinearKernel, KernelFactory

logger = logging.getLogger("specserve.model")

# Rows a projection sees in a step: a decode, a few drafts, a small batch, a large batch.
ROWS = (1, 4, 16, 64)
# Rows at which the packed kernels' prefetch policies are compared: a decode, draft trees' verification,
# a batch.
PREFETCH_ROWS = (1, 2, 4, 8)


def machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        name, cpu_flags = cpu_info()
        model = name or platform.processor()
        flags = hashlib.sha256(" ".join(sorted(cpu_flags)).encode()).hexdigest()[:8]
        hw = f"{model}/{flags}/{torch.get_num_threads()}t"
    return f"{hw}|torch {torch.__version__}"


def _time(kernel: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """Median seconds of one call, from repeats long enough to be measured."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        for _ in range(2):
            kernel(x)
        sync()
        start = time.perf_counter()
        kernel(x)
        sync()
        once = max(time.perf_counter() - start, 1e-6)
        reps = max(1, min(50, int(2e-3 / once)))
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                kernel(x)
            sync()
            samples.append((time.perf_counter() - start) / reps)
    return sorted(samples)[len(samples) // 2]


class KernelTuner:
    """Picks, per (precision, shape, dtype), the candidate with the least time relative to the
    best at each row count of ROWS (every row count weighs the same)."""

    SLOWER = 3.0  # a candidate this many times the best at one row is not timed at the other row counts

    def __init__(self, device: torch.device, path: Path | None = None) -> None:
        self._announced = False
        self.device = device
        self.path = path if path is not None else cache_root() / "kernel-choices.json"
        self.machine = machine_key(device)
        self._choices: dict[str, str] = read_kept(self.path)

    def _write(self) -> None:
        try:
            keep(self.path, self._choices)
        except OSError as e:
            logger.warning("could not save kernel choices to %s: %s", self.path, e)

    def decide(self, what: str, candidates: dict[str, Callable[[], float]]) -> str:
        """The candidate whose timing function returns the least seconds (remembered for this
        machine under `what`); a candidate whose timing raises is skipped."""
        cached = self.recall(what, list(candidates))
        if cached is not None:
            return cached
        times: dict[str, float] = {}
        for name, seconds in candidates.items():
            try:
                times[name] = seconds()
            except Exception as e:  # noqa: BLE001 - a candidate this machine cannot run (this time)
                logger.info("%s: %s unusable: %s", what, name, str(e))
        if not times:
            raise RuntimeError(f"{what}: no candidate could be timed")
        name = min(times, key=times.__getitem__)
        logger.info("%s: %s -> %s", what, ", ".join(f"{c} {t * 1e3:.2f} ms" for c, t in times.items()), name)
        if len(times) == len(candidates):  # a choice made after a failure is not remembered
            self._choices[self._decision_key(what, list(candidates))] = name
            self._write()
        return name

    def recall(self, what: str, names: list[str]) -> str | None:
        """The choice `decide` remembered on this machine for `what` among `names`, if any."""
        cached = self._choices.get(self._decision_key(what, names))
        return cached if cached in names else None

    def _decision_key(self, what: str, names: list[str]) -> str:
        return f"{self.machine}|{what}|{','.join(sorted(names))}"

    def choose(self, precision: str, shape: tuple[int, int], dtype: torch.dtype,
               factories: dict[str, KernelFactory]) -> tuple[str, nn.Module]:
        """The name of the fastest candidate and an instance of it."""
        n, k = shape
        key = f"{self.machine}|{precision}|{n}x{k}|{dtype}|{','.join(sorted(factories))}"
        if len(factories) == 1:
            name = next(iter(factories))
            return name, factories[name]()
        cached = self._choices.get(key)
        if cached in factories:
            try:
                return cached, factories[cached]()
            except Exception:  # noqa: BLE001 - re-time below
                pass
        if not self._announced:
            logger.warning("timing kernel candidates on this model's projection shapes (once per machine; "
                           "remembered in %s)", self.path)
            self._announced = True
        built: dict[str, nn.Module] = {}
        times: dict[str, list[float]] = {}
        for name, make in factories.items():
            try:
                kernel = make()
                times[name] = [_time(kernel, torch.randn(ROWS[0], k, dtype=dtype, device=self.device), self.device)]
                built[name] = kernel
            except Exception as e:  # noqa: BLE001 - a candidate this machine cannot run
                logger.info("kernel %s unusable for %s %dx%d: %s", name, precision, n, k, e)
        if not built:
            raise RuntimeError(f"quantization: no kernel can run a {precision} {n}x{k} projection on {self.device}")
        first = min(t[0] for t in times.values())
        for name in [c for c in times if times[c][0] > self.SLOWER * first]:  # out of the running: not timed further
            del times[name], built[name]
        for name, kernel in built.items():
            times[name] += [_time(kernel, torch.randn(m, k, dtype=dtype, device=self.device), self.device)
                            for m in ROWS[1:]]
        best = [min(t[i] for t in times.values()) for i in range(len(ROWS))]
        name = min(times, key=lambda c: sum(t / b for t, b in zip(times[c], best)))
        shown = ", ".join(f"{c} " + "/".join(f"{t * 1e3:.2f}" for t in times[c]) for c in times)
        logger.info("%s %dx%d: %s ms at %s rows -> %s", precision, n, k, shown, "/".join(map(str, ROWS)), name)
        self._choices[key] = name
        self._write()
        return name, built[name]

    def choose_prefetch(self, *modules: nn.Module, rounds: int = 5) -> str | None:
        """The packed GGUF kernels' prefetch policy (quant.PREFETCH_POLICIES) that streams these
        modules' weights fastest on this machine, set on every GGUF kernel in them (a model, or a
        draft head and its readout): their own projections, all of
        them once at each of PREFETCH_ROWS under each policy, in alternating rounds (the per-shape
        timing of `choose` runs a projection whose weights sit in the cache; this runs them as a
        forward does, from memory); as in `choose`, the least time relative to the best at each row
        count, every row count weighing the same. Remembered per machine and size of the weights (to
        the nearest power of two in MB). None where no kernel reads a packed layout."""
        kernels = [k for m in modules for k in m.modules() if isinstance(k, GGUFLinearKernel)]
        packed = [k for k in kernels if any(t in PACKED_BY_ID for t in k.types)]
        if not packed:
            return None
        megabytes = sum(p.numel() for k in packed for p in k.parts) / 2**20
        what = f"gguf-prefetch|{2 ** round(math.log2(max(megabytes, 1)))}MB"
        scores: dict[str, float] = {}

        def score(name: str) -> float:
            if not scores:
                medians = _stream_seconds(packed, rounds)
                best = {m: min(t[m] for t in medians.values()) for m in PREFETCH_ROWS}
                scale = sum(best.values()) / len(PREFETCH_ROWS)  # in seconds: the best policies' time, all rows
                scores.update({n: scale * sum(t[m] / best[m] for m in PREFETCH_ROWS) for n, t in medians.items()})
            return scores[name]

        name = self.decide(what, {n: (lambda n=n: score(n)) for n in PREFETCH_POLICIES})
        for k in kernels:
            k.prefetch = PREFETCH_POLICIES[name]
        return name


def _stream_seconds(kernels: list[GGUFLinearKernel], rounds: int) -> dict[str, dict[int, float]]:
    """Median seconds of every kernel once, at each of PREFETCH_ROWS, under each prefetch policy, the
    policies alternating round by round (kernels are left with the last policy timed)."""
    xs = {(m, k.in_features): torch.randn(m, k.in_features) for m in PREFETCH_ROWS for k in kernels}
    samples: dict[str, dict[int, list[float]]] = {n: {m: [] for m in PREFETCH_ROWS} for n in PREFETCH_POLICIES}
    names = list(PREFETCH_POLICIES)
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms every policy up and is not counted
            for name in names if r % 2 else names[::-1]:
                for k in kernels:
                    k.prefetch = PREFETCH_POLICIES[name]
                for m in PREFETCH_ROWS:
                    start = time.perf_counter()
                    for k in kernels:
                        k(xs[(m, k.in_features)])
                    if r:
                        samples[name][m].append(time.perf_counter() - start)
    return {n: {m: statistics.median(s) for m, s in by_rows.items()} for n, by_rows in samples.items()}


# What the attention kernel's vector widths are timed on: a step's decodes, each over a context of its
# own, and a draft tree; in ATTENTION_SETS copies of the blocks taken in turn, so that each call reads
# its keys from memory, as a forward's thirty-odd layers do, not from the cache the last call filled.
ATTENTION_DECODES = 4
ATTENTION_CONTEXT = 512
ATTENTION_TREE = 5
ATTENTION_SETS = 8


def attention_lanes(tuner: KernelTuner, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                    block_size: int = 16, rounds: int = 7) -> int:
    """The paged-attention kernel's `lanes` for these heads on this machine: 0 (its widest task:
    sixteen lanes where the kernels' variant is AVX-512 and the head dim a multiple of 16) or 8 (the
    eight-lane one), whichever attends a step's decodes and a draft tree faster, the two timed in
    alternating rounds and remembered per machine. 0 where the variant has one width. (On a 2-core
    Xeon with AVX-512 the sixteen-lane task took 4 decodes at 400 tokens in 61 us a layer where eight
    lanes took 91; on a CPU that splits 512-bit operations in two the balance may differ.)"""
    isa = ops.layer_isa()
    if "avx512" not in ops.ISAS[isa] or head_dim % 16 or kv_dtype not in (torch.float32, torch.bfloat16):
        return 0
    what = f"paged-attention|{num_heads}x{num_kv_heads}x{head_dim}|{str(kv_dtype).removeprefix('torch.')}"
    seconds: dict[int, float] = {}

    def timed(lanes: int) -> float:
        if not seconds:
            seconds.update(_attention_seconds(num_heads, num_kv_heads, head_dim, kv_dtype, block_size, isa, rounds))
        return seconds[lanes]

    return int(tuner.decide(what, {"0": lambda: timed(0), "8": lambda: timed(8)}))


def _attention_seconds(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int,
                       isa: int, rounds: int) -> dict[int, float]:
    """Median seconds of one paged-attention call over ATTENTION_DECODES decodes and one tree of
    ATTENTION_TREE nodes at ATTENTION_CONTEXT tokens, with lanes 0 and 8 (alternating rounds, the
    first not counted)."""
    g = torch.Generator().manual_seed(0)
    per_item = -(-(ATTENTION_CONTEXT + ATTENTION_TREE) // block_size)
    items = ATTENTION_DECODES + 1
    blocks = ATTENTION_SETS * items * per_item
    kc = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    vc = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    q_len = [1] * ATTENTION_DECODES + [ATTENTION_TREE]
    ctx = [ATTENTION_CONTEXT] * ATTENTION_DECODES + [ATTENTION_CONTEXT + ATTENTION_TREE]
    q = torch.randn(sum(q_len), num_heads, head_dim, generator=g)
    tree = torch.tril(torch.ones(ATTENTION_TREE, ATTENTION_TREE, dtype=torch.uint8)).reshape(-1)

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32)

    q_start, lens, ctxs, meta = i32([sum(q_len[:i]) for i in range(items)]), i32(q_len), i32(ctx), []
    for s in range(ATTENTION_SETS):
        first = s * items * per_item
        tables = list(range(first, first + items * per_item))
        meta.append((i32(tables), i32([i * per_item for i in range(items)])))
    mask_off = torch.tensor([-1] * ATTENTION_DECODES + [0], dtype=torch.int64)
    samples: dict[int, list[float]] = {0: [], 8: []}
    call = 0
    with torch.inference_mode():
        for r in range(rounds + 1):
            for lanes in (0, 8) if r % 2 else (8, 0):
                tables, table_off = meta[call % ATTENTION_SETS]
                call += 1
                start = time.perf_counter()
                torch.ops.specserve.paged_attention(q, kc, vc, q_start, lens, ctxs, tables, table_off, tree, mask_off,
                                                    head_dim ** -0.5, isa, lanes)
                if r:
                    samples[lanes].append(time.perf_counter() - start)
    return {lanes: statistics.median(s) for lanes, s in samples.items()}
