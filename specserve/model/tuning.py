"""Kernel choice by measurement: time each candidate kernel on the model's own shapes, at the row
counts a step uses, on the machine at hand, and keep the fastest.

Choices are cached per machine (CPU model and flags, or GPU name), PyTorch version and thread
count, in cache_root()/kernel-choices.json, so a model loads without re-timing on a machine that
has timed its shapes before. A candidate that raises is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specserve.isa import cache_root, cpu_info
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
        self._choices = self._read()

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            merged = {**self._read(), **self._choices}
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
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
