"""Small C kernels, compiled for this machine at first use and loaded with ctypes.

A kernel's source lives in specserve/model/csrc/. It is built with the C compiler found on the
machine ($CC, else cc/gcc/clang), -O3 -fopenmp and the vector ISA flags this CPU reports (never
-march=native: some VMs advertise instructions, such as AMX, that they do not enable). The
library is cached under ~/.cache/specserve/native/ (or $SPECSERVE_CACHE/native/), keyed by the
source, the compiler and the flags, so each machine builds it once. The OpenMP runtime is the
one PyTorch already loaded (libgomp.so.1), so the kernels share its threads.

No compiler, or a failed build: `load` returns None and says why once; callers then use their
PyTorch fallback.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("specserve.model")

CSRC = Path(__file__).with_name("csrc")

# Instruction sets worth enabling when the CPU reports them, in the flag names of /proc/cpuinfo.
_ISA_FLAGS = (("avx2", "-mavx2"), ("fma", "-mfma"), ("f16c", "-mf16c"), ("avx512f", "-mavx512f"),
              ("avx512bw", "-mavx512bw"), ("avx512vl", "-mavx512vl"), ("avx512dq", "-mavx512dq"))


def cache_root() -> Path:
    base = os.environ.get("SPECSERVE_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "specserve"


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_flags(flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [opt for name, opt in _ISA_FLAGS if name in flags]


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


@dataclass(frozen=True)
class BuildResult:
    library: ctypes.CDLL | None
    reason: str  # why there is no library, or where it came from


@functools.cache
def load(name: str) -> BuildResult:
    """The compiled library for csrc/`name`.c (built once per process, and once per machine);
    `library` is None when it cannot be."""
    result = _build(name)
    if result.library is None:
        logger.warning("native kernel %s unavailable (%s); using the PyTorch fallback", name, result.reason)
    return result


def _build(name: str) -> BuildResult:
    source = CSRC / f"{name}.c"
    cc = find_compiler()
    if cc is None:
        return BuildResult(None, "no C compiler found; set $CC or install gcc")
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", f"-I{CSRC}", *isa_flags()]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return BuildResult(None, f"{cc} --version failed: {e}")
    sources = b"".join(p.read_bytes() for p in sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")]))  # a source may include the others
    key = hashlib.sha256(sources + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_root() / "native" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            try:
                proc = subprocess.run([cc, *flags, "-o", str(out), str(source), "-lm"],
                                      capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                return BuildResult(None, f"{cc} failed: {e}")
            if proc.returncode != 0:
                return BuildResult(None, f"{cc} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
            os.replace(out, target)  # atomic: concurrent builders all end with a whole file
    try:
        return BuildResult(ctypes.CDLL(str(target)), str(target))
    except OSError as e:
        return BuildResult(None, f"cannot load {target}: {e}")
