"""Directories computed once from a model file (a GGUF's dequantized weights, its converted
tokenizer) and kept in the cache, found again by the file's content, and bounded in number.

An entry is named by the file's size and a hash of 64 small pieces of it spread over its length,
not by its path or modification time: the same file installed in another virtual environment (or
copied, or touched) finds the entry it already has, where a path-keyed cache made a new one each
time (on one development machine 36 copies of the bundled model's 517 MB conversion, 20 GB in all).
The entries of a kind are kept to the most recently used few; the rest are deleted when a new one
is made (a process still reading a deleted entry's memory-mapped files keeps its data until it
unmaps them).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from specserve.isa import cache_root

PIECES = 64
PIECE_BYTES = 4096
STALE_TMP_SECONDS = 3600.0  # a half-written entry this old was left by a process that died


def fingerprint(path: Path, salt: str) -> str:
    """16 hex digits naming the file's content (size and 64 pieces across it) and `salt` (the
    format of what is made from it)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:{salt}".encode())
    with path.open("rb") as f:
        for i in range(PIECES):
            f.seek(size * i // PIECES)
            h.update(f.read(PIECE_BYTES))
        f.seek(max(0, size - PIECE_BYTES))
        h.update(f.read(PIECE_BYTES))
    return h.hexdigest()[:16]


def entry_dir(kind: str, path: Path, salt: str) -> Path:
    """Where the `kind` entry made from `path` lives (made or not)."""
    return cache_root() / kind / f"{path.stem}-{fingerprint(path, salt)}"


def _size(entry: Path) -> int:
    total = 0
    for f in entry.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:  # deleted meanwhile by another process pruning the same cache
            pass
    return total


def mark_used(entry: Path, keep: int, max_bytes: int | None = None) -> None:
    """Record that `entry` was used now; delete its kind's other entries beyond the `keep` most
    recently used (and beyond `max_bytes` with this one counted), and half-written ones abandoned
    long ago."""
    try:
        os.utime(entry)
    except OSError:  # another process pruned it meanwhile; what this one loaded stays readable
        return
    now = time.time()
    done: list[tuple[float, Path]] = []
    for other in entry.parent.iterdir():
        if other == entry or not other.is_dir():
            continue
        try:
            used = other.stat().st_mtime
        except OSError:  # deleted meanwhile by another process
            continue
        if ".tmp" in other.name:
            if now - used > STALE_TMP_SECONDS:
                shutil.rmtree(other, ignore_errors=True)
            continue
        done.append((used, other))
    done.sort(reverse=True)
    kept, total = 1, _size(entry) if max_bytes is not None else 0
    for _, other in done:  # the most recently used first
        size = _size(other) if max_bytes is not None else 0
        if kept < keep and (max_bytes is None or total + size <= max_bytes):
            kept, total = kept + 1, total + size
        else:
            shutil.rmtree(other, ignore_errors=True)
