"""A model's weights moved into memory backed by 2 MB pages (Linux transparent huge pages).

A step streams every weight once (a decode on the 1.5B model reads 1 GB). In 4 KB pages that is
a TLB miss every 4 KB, a page walk each; in 2 MB pages, one every 2 MB. Measured on a 2-core Xeon
(BENCHMARKS.md, session 34): plain decoding at batch 1 1.08-1.13x on Qwen2.5-Coder-1.5B Q4_K_M and
1.05-1.12x on the bundled model, in one process and in fresh ones. The price is the load: the
copy's page faults take 2 MB pages, which the kernel may first have to compact memory for (the
1.5B's move 0.4 s on a quiet machine, 2.5 s with 11 GB of page cache to compact). Where the system leaves huge pages to the program's asking
(/sys/kernel/mm/transparent_hugepage/enabled = madvise, the common default) PyTorch's allocator
does not ask, and a GGUF file's own pages are 4 KB page-cache pages, so the weights are copied
once, at load, into one anonymous private mapping advised MADV_HUGEPAGE (`WeightArena`), each
storage once (tied weights and views of one tensor stay shared), and the originals are dropped.

That copy costs the start, so by default the weights are not moved: once the engine is built, a
thread of its own asks the kernel to collapse the 2 MB-aligned regions the weights lie in into huge
pages where they are (`madvise(MADV_COLLAPSE)`, Linux 6.1 and later: the kernel copies each region
into a huge page and remaps it, the addresses stay, concurrent reads see the same bytes throughout).
The engine serves meanwhile, in 4 KB pages, and speeds up as regions are collapsed (`PageCollapse`:
a thread at the lowest priority that waits while the engine computes, for up to 10 s; the 1.5B:
1002 of its 1108 MB in 2 MB pages after 0.6-3 s of one core, decoding 1.2-1.3x after). A region
that reaches past the weights collapses the memory beside them too (the heap's: a little more
resident memory); one that crosses two mappings is refused (EINVAL) and stays in 4 KB pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger("specserve.model")

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage starts on a cache line
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this system gives an anonymous mapping 2 MB pages when it asks (Linux, transparent
    huge pages not switched off)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


class WeightArena:
    """One anonymous private mapping of `nbytes`, 2 MB aligned and advised MADV_HUGEPAGE; `place`
    copies a tensor's storage into it (once per storage) and returns the same view of the copy."""

    def __init__(self, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = (-ctypes.addressof(ctypes.c_char.from_buffer(self._map))) % HUGE_PAGE
        try:
            _advise_huge(self._map, start, size)
        except OSError as e:  # a kernel that refuses the advice: the copy is still the weights, in 4 KB pages
            logger.warning("weights: madvise(MADV_HUGEPAGE) refused (%s); they stay in 4 KB pages", e)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=size, offset=start)
        self.used = 0
        self._placed: dict[tuple[int, int], int] = {}  # an original storage (address, bytes) -> its offset here

    def place(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not _movable(t) or storage.data_ptr() == self.bytes.untyped_storage().data_ptr():
            return t  # (a tensor held twice, such as a tied head's, is here already when met again)
        key = _storage_key(t)
        offset = self._placed.get(key)
        if offset is None:
            n = storage.nbytes()
            offset = -(-self.used // _ALIGN) * _ALIGN
            if offset + n > self.bytes.numel():
                raise ValueError(f"weights: the arena holds {self.bytes.numel()} bytes, {offset + n} asked")
            self.bytes[offset:offset + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            self._placed[key] = offset
            self.used = offset + n
        start = (self.bytes.storage_offset() + offset) // t.element_size() + t.storage_offset()
        return torch.empty(0, dtype=t.dtype).set_(self.bytes.untyped_storage(), start, t.size(), t.stride())


def _advise_huge(m: mmap.mmap, start: int, size: int) -> None:
    m.madvise(mmap.MADV_HUGEPAGE, start, size)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """A storage by where it starts and how long it is (two storages over one buffer, such as
    tensors made from arrays over one mapping, may start at the same address)."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _movable(t: torch.Tensor) -> bool:
    """A dense CPU tensor with memory of its own (not a oneDNN-layout one, not empty)."""
    return t.device.type == "cpu" and t.layout == torch.strided and t.untyped_storage().nbytes() > 0


def weights(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers, and those of modules that keep
    weights in attributes of their own (`_apply` overridden, as GGUFLinearKernel does)."""
    seen: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    model._apply(collect)
    return seen


# While weights move, `freed` is called each time this many more bytes have been copied: the
# originals replaced so far are garbage by then, and the caller can give their memory back (glibc
# keeps freed heap memory). Loading the 1.5B then peaked at 1.8 GB resident, against 2.5 GB without
# and 1.3 GB with the weights left in 4 KB pages (every 64 MB: 1.7 GB, but 17 trims cost 1.5 s).
FREE_EVERY = 256 << 20


def into_huge_pages(model: nn.Module, freed: Callable[[], None] | None = None) -> int:
    """Move the model's CPU weights into one `WeightArena` (see the module's docstring), calling
    `freed` every FREE_EVERY bytes; returns the bytes moved (0 where huge pages are not available or
    nothing is on the CPU)."""
    if not huge_pages_available():
        return 0
    storages = {_storage_key(t) for t in weights(model) if _movable(t)}
    if not storages:
        return 0
    arena = WeightArena(sum(-(-n // _ALIGN) * _ALIGN for _, n in storages))
    mark = [0]

    def place(t: torch.Tensor) -> torch.Tensor:
        if freed is not None and arena.used - mark[0] >= FREE_EVERY:
            freed()  # the tensors replaced before this one are gone
            mark[0] = arena.used
        return arena.place(t)

    with torch.no_grad():
        model._apply(place)
    return arena.used


MADV_COLLAPSE = 25  # Linux 6.1 (<linux/mman.h>); Python's mmap module may not name it


def collapse_regions(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The start of every 2 MB-aligned region that holds a byte of one of these CPU tensors'
    storages, ascending, each once."""
    spans = sorted({_storage_key(t) for t in tensors if _movable(t)})
    starts: list[int] = []
    for address, nbytes in spans:
        first = max(address // HUGE_PAGE * HUGE_PAGE, starts[-1] + HUGE_PAGE if starts else 0)
        starts.extend(range(first, address + nbytes, HUGE_PAGE))
    return starts


def _madvise() -> Callable[[int, int, int], int]:
    """libc's madvise(address, length, advice): 0, or -1 with errno set (the GIL let go meanwhile)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _lowest_priority() -> None:
    """The calling thread at the lowest nice: it gets a CPU where the engine leaves one, and a small
    share where the engine keeps both busy. Measured on the 1.5B, served, requests back to back
    from the start: at normal priority the collapse took 2 s of one of the two cores and slowed
    the decode beside it to 0.7x; at nice 19 it took 7 s, the first 64-token request ran at 12.0
    tok/s, the next at 19.1 and the rest at 20.4-22.1 (15.9-18.1 with the weights left in 4 KB
    pages, the next run); at SCHED_IDLE the decode kept its rate but the
    collapse did not advance in 27 s (the engine's OpenMP threads spin between steps, so the CPUs
    never look idle), and the weights stayed in 4 KB pages for as long as requests kept coming."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class OthersBusy:
    """Whether the rest of the process (every thread but the one asking) used more than `share` of
    a CPU since the last call: the engine is computing a step."""

    def __init__(self, share: float = 0.25, others_cpu: Callable[[], float] | None = None) -> None:
        self.share = share
        self._cpu = others_cpu or (lambda: time.process_time() - time.thread_time())
        self._last = self._sample()

    def _sample(self) -> tuple[float, float]:
        return time.monotonic(), self._cpu()

    def __call__(self) -> bool:
        (t0, cpu0), (t1, cpu1) = self._last, self._sample()
        self._last = (t1, cpu1)
        return cpu1 - cpu0 > self.share * max(t1 - t0, 1e-3)


@dataclass
class PageCollapse:
    """Collapses `regions` (2 MB-aligned addresses, collapse_regions) into huge pages in place, on a
    daemon thread of its own (`start`) at the lowest priority, one region a call. It waits while
    the rest of the process is `busy` (OthersBusy), for at most `patience` seconds from its start,
    then goes on whatever runs beside it: a collapse beside a step slows the step (below), so a
    request that comes at once, or a short `specserve generate`, runs as in 4 KB pages, and a server
    that is never idle still gets its huge pages after `patience`. `wait` blocks until it is
    through. What it did: the regions `collapsed`, those `refused` by errno (EINVAL: the region
    crosses two mappings, or a kernel before 6.1; ENOMEM/EAGAIN: no huge page free now), `seconds`
    from its start. The memory stays valid and unchanged whatever the kernel answers.

    Measured on the 1.5B, the first 64-token request sent as the server turned healthy: 9.3-11.3
    tok/s with the collapse beside it at nice 19 against 15.9-16.7 with `--huge-pages off`
    (BENCHMARKS.md, session 36)."""

    regions: list[int]
    advise: Callable[[int, int, int], int] = field(default_factory=_madvise, repr=False)
    busy: Callable[[], bool] | None = field(default=None, repr=False)  # None: OthersBusy() on the thread
    patience: float = 10.0
    poll: float = 0.05  # seconds between looks while busy
    collapsed: list[int] = field(default_factory=list)
    refused: Counter[int] = field(default_factory=Counter)
    seconds: float = 0.0
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> "PageCollapse":
        logger.info("weights: collapsing %d 2 MB regions into huge pages in the background", len(self.regions))
        self._thread = threading.Thread(target=self.run, name="specserve-huge-pages", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        _lowest_priority()
        busy = self.busy or OthersBusy()
        begin = time.perf_counter()
        for address in self.regions:
            while time.perf_counter() - begin < self.patience and busy():
                time.sleep(self.poll)
            if self.advise(address, HUGE_PAGE, MADV_COLLAPSE) == 0:
                self.collapsed.append(address)
            else:
                self.refused[ctypes.get_errno()] += 1
        self.seconds = time.perf_counter() - begin
        logger.info("weights: %d of %d 2 MB regions collapsed into huge pages in %.1f s%s", len(self.collapsed),
                    len(self.regions), self.seconds,
                    f" (refused: {dict(self.refused)} by errno)" if self.refused else "")

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is through (True where it never started)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
