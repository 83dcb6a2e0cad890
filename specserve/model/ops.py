"""The package's compiled torch operators (specserve/csrc, built when the package is installed).

`torch.ops.specserve.*` exist once `load()` has run. Each has a fake (meta) implementation here, so
torch.compile and shape propagation can trace through them. A package installed without its
library (built from a source tree without the compile step) says so and how to rebuild.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Kernel variants by id (ops.cpp's Isa enum): the instruction sets the quantized kernels were
# compiled for. Which of them runs a given weight shape is decided by timing (KernelTuner).
ISAS = ("generic", "avx2")

# ggml types with a packed layout (csrc/gguf_packed.h): type -> (packed type id, bytes per 256
# weights of a row); a packed tensor's rows are whole groups of PACK_ROWS.
PACKED = {12: (112, 148)}  # Q4_K -> Q4_Kx8
PACK_ROWS = 8


class KernelLibraryError(RuntimeError):
    """The compiled operator library is missing or does not load with this PyTorch."""


@functools.cache
def load() -> None:
    """Load specserve/_C (once per process)."""
    package = Path(__file__).resolve().parent.parent
    libs = sorted(package.glob("_C*.so")) + sorted(package.glob("_C*.pyd"))
    if not libs:
        raise KernelLibraryError(
            f"specserve's kernel library (_C) is not in {package}: reinstall the package so it is built "
            "(`pip install --no-build-isolation -e .` with PyTorch installed first)"
        )
    try:
        torch.ops.load_library(str(libs[0]))
    except OSError as e:
        raise KernelLibraryError(
            f"specserve's kernel library {libs[0].name} does not load with torch {torch.__version__} ({e}); it "
            "was built against another PyTorch: rebuild with `pip install --no-build-isolation -e .`"
        ) from None
    _register_fakes()


def _register_fakes() -> None:
    @torch.library.register_fake("specserve::gguf_linear")
    def _(x, weights, types, bias, isa):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))

    @torch.library.register_fake("specserve::gguf_dequantize")
    def _(blocks, type, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(blocks.shape[0], cols, dtype=torch.float32)

    @torch.library.register_fake("specserve::gguf_embedding")
    def _(ids, blocks, type, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(*ids.shape, cols, dtype=torch.float32)

    @torch.library.register_fake("specserve::gguf_pack")
    def _(blocks, type, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(blocks.shape[0], cols // 256 * PACKED[type][1])

    @torch.library.register_fake("specserve::gguf_round_activations")
    def _(x, block):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)


@functools.cache
def _library_path() -> Path:
    load()
    package = Path(__file__).resolve().parent.parent
    return sorted(package.glob("_C*.so"))[0]


@functools.cache
def native_entry(symbol: str) -> int:
    """The address of one of the library's C entry points (for the native layer loop)."""
    import ctypes

    return ctypes.cast(getattr(ctypes.CDLL(str(_library_path())), symbol), ctypes.c_void_p).value or 0


def runnable_isas() -> tuple[str, ...]:
    """The kernel variants this CPU can run, by name."""
    load()
    mask = int(torch.ops.specserve.cpu_isas())
    return tuple(name for i, name in enumerate(ISAS) if mask >> i & 1)


def isa_id(name: str) -> int:
    return ISAS.index(name)
