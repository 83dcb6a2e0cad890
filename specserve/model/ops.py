"""The package's compiled torch operators (specserve/csrc, built when the package is installed).

`torch.ops.specserve.*` exist once `load()` has run: the GGUF products (ops.cpp) and every other
CPU kernel (kernel_ops.cpp: attention over the paged cache, the layer's small operations, the
float32/int8/int4 products, the native layer loop over a `torch.classes.specserve.Decoder`). Each
operator takes the id of the instruction-set variant that runs it (ISAS). Each has a fake (meta)
implementation here, so torch.compile and shape propagation can trace through them. A package
installed without its library (built from a source tree without the compile step) says so and how
to rebuild.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

# Kernel variants by id (ops.cpp's Isa enum): the instruction sets the quantized kernels were
# compiled for. Which of them runs a given weight shape is decided by timing (KernelTuner).
ISAS = ("generic", "avx2", "avx512vnni")



@dataclass(frozen=True)
class PackedType:
    """A ggml type's weights repacked `rows` rows at a time (csrc/gguf_packed.h): a packed tensor's
    rows are whole groups of `rows`."""

    type_id: int  # the packed type's id (ops.cpp)
    source: int  # the ggml type it holds
    rows: int
    block_elems: int  # a block's weights (per row): 256 for the k-quants, 32 for Q4_0, Q4_1, Q8_0
    block_bytes: int  # a block's bytes per row, as in the file

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_elems * self.block_bytes


@dataclass(frozen=True)
class PackedLayout:
    """The packed types one vectorised variant's kernels read."""

    name: str  # the kernel candidate's suffix ("gguf-avx2-x8")
    types: tuple[PackedType, ...]

    def of(self, source: int) -> PackedType | None:
        """The packed type this layout has for ggml type `source`, if any."""
        return next((t for t in self.types if t.source == source), None)


# The packed layout each vectorised variant reads: Q4_K eight rows to a 32-byte vector (AVX2);
# Q4_K, Q6_K, Q4_0, Q4_1 and Q8_0 sixteen rows to a 64-byte vector (AVX-512 VNNI).
PACKED_LAYOUTS = {
    "avx2": PackedLayout("x8", (PackedType(112, 12, 8, 256, 148),)),
    "avx512vnni": PackedLayout("x16", (PackedType(212, 12, 16, 256, 148), PackedType(214, 14, 16, 256, 210),
                                       PackedType(202, 2, 16, 32, 18), PackedType(203, 3, 16, 32, 20),
                                       PackedType(208, 8, 16, 32, 34))),
}
PACKED_BY_ID = {t.type_id: t for layout in PACKED_LAYOUTS.values() for t in layout.types}


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
    def _(x, weights, types, bias, isa, prefetch=0):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))

    @torch.library.register_fake("specserve::gguf_dequantize")
    def _(blocks, type, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(blocks.shape[0], cols, dtype=torch.float32)

    @torch.library.register_fake("specserve::gguf_embedding")
    def _(ids, blocks, type, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(*ids.shape, cols, dtype=torch.float32)

    @torch.library.register_fake("specserve::gguf_pack")
    def _(blocks, type, cols, packed_type):  # type: ignore[no-untyped-def]
        return blocks.new_empty(blocks.shape[0], PACKED_BY_ID[packed_type].row_bytes(cols))

    @torch.library.register_fake("specserve::gguf_pack_")
    def _(out, blocks, type, cols, packed_type):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("specserve::gguf_quantize_q4_0")
    def _(blocks, type, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(blocks.shape[0], cols // 32 * 18)

    @torch.library.register_fake("specserve::gguf_q5_0_as_q8_0")
    def _(blocks, cols):  # type: ignore[no-untyped-def]
        return blocks.new_empty(blocks.shape[0], cols // 32 * 34)

    @torch.library.register_fake("specserve::gguf_round_activations")
    def _(x, block):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)

    @torch.library.register_fake("specserve::row_topk")
    def _(x, k, isa):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], k, dtype=torch.long)

    @torch.library.register_fake("specserve::row_argmax")
    def _(x, isa):  # type: ignore[no-untyped-def]
        return x.new_empty(2, x.shape[0], dtype=torch.long)

    @torch.library.register_fake("specserve::linear_f32")
    def _(x, weight, bias, isa):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("specserve::linear_int8")
    def _(x, q, scale, bias, isa):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("specserve::linear_int4")
    def _(x, packed, scale, minimum, bias, isa):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("specserve::int8_round_activations")
    def _(x, isa):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)

    @torch.library.register_fake("specserve::paged_attention")
    def _(q, k_cache, v_cache, q_start, q_len, ctx_len, tables, table_off, masks, mask_off, scale, isa, lanes=0):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape)

    @torch.library.register_fake("specserve::write_kv")
    def _(k, v, k_cache, v_cache, slots, isa):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("specserve::rope_")
    def _(x, n_heads, head_dim, cos, sin, isa):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("specserve::rms_norm")
    def _(x, weight, eps, isa):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)

    @torch.library.register_fake("specserve::silu_mul")
    def _(gate_up, isa):  # type: ignore[no-untyped-def]
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def runnable_isas() -> tuple[str, ...]:
    """The kernel variants this CPU can run, by name."""
    load()
    mask = int(torch.ops.specserve.cpu_isas())
    return tuple(name for i, name in enumerate(ISAS) if mask >> i & 1)


def isa_id(name: str) -> int:
    return ISAS.index(name)


@functools.cache
def layer_isa() -> int:
    """The variant that runs the kernels other than the GGUF products (attention, the layer's small
    operations, the float32/int8/int4 products, the layer loop): the widest this CPU runs. (Which
    variant runs a GGUF projection is measured per shape, by KernelTuner.)"""
    return isa_id(runnable_isas()[-1])
