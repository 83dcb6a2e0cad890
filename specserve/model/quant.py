"""Weights of the projections: dense, int8 or int4, and the kernel that multiplies by them.

`--quantization` picks the precision (a user's choice: int8 and int4 are lossy):

- none: the loaded dtype (float32 by default);
- int8: symmetric, one scale per output channel;
- int4: asymmetric in groups of 32 along the input (GGUF's Q4_1 rule: w = q * scale + min,
  q in 0..15). A GGUF tensor already in Q4_0 or Q4_1 is taken from its own blocks, so the int4
  weights are exactly the file's; anything else is quantized from the dequantized weights.
  The LM head stays int8 in int4 mode (it is tied to the embedding in small models, and GGUFs
  ship it in Q8_0);
- gguf: a GGUF file's tensors as the file stores them, each its own type (GGUFLinearKernel over
  the compiled operators of specserve/csrc; the model is built by specserve.model.gguf_model).

Which kernel runs a precision is chosen by measurement on the machine at hand (`KernelTuner`),
among those the device offers and that compute a row alone whatever its batch: on the CPU with
float32 activations, the package's operators (else `F.linear` or oneDNN, PyTorch's packed
weight-only kernels for int8/int4), and for gguf one compiled variant per instruction set.
On CUDA, int4 uses PyTorch's tinygemm kernel and int8 a dequantizing matmul.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.ops import PACKED_BY_ID, PACKED_LAYOUTS, PackedLayout

logger = logging.getLogger("specserve.model")

QUANTIZATIONS = ("none", "int8", "int4", "gguf")
GROUP_SIZE = 32
KernelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class Int4Weight:
    """Unpacked int4 weights: w[n, k] = q[n, k] * scale[n, k // 32] + minimum[n, k // 32]."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K // 32] float32
    minimum: torch.Tensor  # [N, K // 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (groups * self.scale[..., None] + self.minimum[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Rows of several weights stacked (a fused projection)."""
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.minimum for p in parts]))


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"quantization: int4 needs input sizes divisible by {GROUP_SIZE}; got a {n}x{k} weight")
    groups = w.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Weight(q, scale, lo)


@dataclass(frozen=True)
class Int8Weight:
    """w[n, k] = q[n, k] * scale[n]."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    w = w.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return Int8Weight(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)


# -- kernels: each an nn.Module computing x @ W^T (+ b) in x's dtype -----------------------------


class DenseKernel(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDnnKernel(nn.Module):
    """float32 on CPU: oneDNN's matmul on a weight reordered once into its blocked layout."""

    PACK_BATCH_HINT = 32  # rows the layout is tuned for; measured to matter little between 8 and 2048

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.PACK_BATCH_HINT)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


class Int8PackKernel(nn.Module):
    """int8 weights, per-channel scales, activations cast to `act` (CPU: aten's int8 kernel)."""

    def __init__(self, w: Int8Weight, bias: torch.Tensor | None, act: torch.dtype) -> None:
        super().__init__()
        self.act = act
        self.register_buffer("q", w.q.contiguous(), persistent=False)
        self.register_buffer("scale", w.scale.to(act), persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.act), self.q, self.scale)
        y = y.to(x.dtype).view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int8DequantKernel(nn.Module):
    """int8 weights converted to x's dtype inside the matmul (any device; compiled, the conversion fuses)."""

    def __init__(self, w: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("q", w.q.contiguous(), persistent=False)
        self.register_buffer("scale", w.scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias


def _scales_and_zeros(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """[K // 32, N, 2] (scale, zero) as PyTorch's int4 kernels take them: w = (q - 8) * scale + zero."""
    zero = w.minimum + 8 * w.scale
    return torch.stack([w.scale.t(), zero.t()], dim=-1).contiguous().to(dtype)


class Int4PackCpuKernel(nn.Module):
    """int4 weights, groups of 32, activations cast to `act` (aten's CPU int4 kernel)."""

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None, act: torch.dtype) -> None:
        super().__init__()
        self.act = act
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 2)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("sz", _scales_and_zeros(w, act), persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(self.act), self.packed,
                                                        GROUP_SIZE, self.sz)
        y = y.to(x.dtype).view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int4PackCudaKernel(nn.Module):
    """int4 weights on CUDA: PyTorch's tinygemm kernel (bfloat16 activations)."""

    INNER_K_TILES = 8

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        q = w.q.to(torch.int32)
        packed_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes.to(w.q.device), self.INNER_K_TILES)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("sz", _scales_and_zeros(w, torch.bfloat16), persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @staticmethod
    def supported(n: int, k: int) -> bool:
        return n % 8 == 0 and k % (Int4PackCudaKernel.INNER_K_TILES * 16) == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed,
                                               GROUP_SIZE, self.sz)
        y = y.to(x.dtype).view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int4DequantKernel(nn.Module):
    """int4 weights dequantized inside every call: the fallback where no packed kernel runs."""

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("q", w.q, persistent=False)
        self.register_buffer("scale", w.scale, persistent=False)
        self.register_buffer("minimum", w.minimum, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = Int4Weight(self.q, self.scale, self.minimum).dequantize().to(x.dtype)
        return F.linear(x, w, self.bias)


# -- native CPU kernels (csrc/gemm_small.c, as torch.ops.specserve.linear_*) ---------------------

class _NativeKernel(nn.Module):
    """float32 in and out on the CPU; subclasses call one operator over csrc/gemm_small.c, in the
    variant `isa` (the one the layer loop runs: ops.layer_isa()).

    Every row is computed alone, in the same order of operations whatever the other rows: a
    row's output does not depend on the batch it came in (speculation, chunking and preemption
    change batches; the quantized kernels round activations to int8, where a last-bit difference
    can move a whole quantization step, so "equal up to rounding" would not be equal).
    """

    out_features: int

    def __init__(self) -> None:
        super().__init__()
        from specserve.model import ops

        self.isa = ops.layer_isa()

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():  # the decode path: no copies
            return self._compute(x)
        shape = x.shape
        y = self._compute(x.reshape(-1, shape[-1]).to(torch.float32).contiguous())
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


class NativeF32Kernel(_NativeKernel):
    """float32 weights, the register-tiled kernel for few rows (and not only few)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("weight", weight.detach().float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specserve.linear_f32(x, self.weight, self.bias, self.isa)


class NativeInt8Kernel(_NativeKernel):
    """int8 weights (per-channel scale) times activations quantized to int8 per block of 32."""

    def __init__(self, w: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = w.q.shape[0]
        self.register_buffer("q", w.q.contiguous(), persistent=False)
        self.register_buffer("scale", w.scale.float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specserve.linear_int8(x, self.q, self.scale, self.bias, self.isa)


def pack_int4(w: Int4Weight) -> torch.Tensor:
    """[N, K // 2] bytes in GGUF's Q4 layout: byte j of a group holds element j (low nibble) and
    element j + 16 (high nibble)."""
    n, k = w.q.shape
    g = w.q.view(n, k // GROUP_SIZE, GROUP_SIZE)
    return (g[..., :16] | (g[..., 16:] << 4)).contiguous().view(n, k // 2)


class NativeInt4Kernel(_NativeKernel):
    """int4 weights (groups of 32) times activations quantized to int8 per block of 32."""

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = w.q.shape[0]
        self.register_buffer("packed", pack_int4(w), persistent=False)
        self.register_buffer("scale", w.scale.float().contiguous(), persistent=False)
        self.register_buffer("minimum", w.minimum.float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specserve.linear_int4(x, self.packed, self.scale, self.minimum, self.bias, self.isa)


# -- GGUF blocks as the file stores them (csrc/ops.cpp: torch.ops.specserve.*) --------------------


# How the packed GGUF kernels prefetch the weights they stream (csrc/qgemm.h, kPrefetchPolicies, in
# this order): "next-group": from tiles of two activation rows on, the next group of weight rows asked
# of L2 while this one is worked on, else 2 KB ahead in the kernel's own stream (a 2-core Zen 4: 4 rows
# of the 1.5B 10% faster than 2 KB ahead alone); "in-stream-2k" and "in-stream-8k": always 2 or 8 KB
# ahead in the stream (a 2-core Zen 5: 4 rows 15-25% faster at 8 KB). Chosen per machine by measurement
# (KernelTuner.choose_prefetch).
PREFETCH_POLICIES = {"next-group": 0, "in-stream-2k": 1, "in-stream-8k": 2}


class GGUFLinearKernel(nn.Module):
    """A projection over GGUF weight tensors (each its own type: a fused q/k/v may be Q4_K, Q4_K and
    Q6_K), stacked along the output; activations float32, rounded to int8 per block inside the
    operator. `isa` names the compiled variant that runs it. A part is the file's blocks or, for
    the packed types (ops.PACKED_LAYOUTS), the same blocks repacked by `pack_gguf_parts`."""

    def __init__(self, parts: list[torch.Tensor], types: list[int], bias: torch.Tensor | None, isa: str) -> None:
        super().__init__()
        from specserve.model import ops

        ops.load()
        self.parts = parts  # uint8 [rows, bytes per row]: views of the mapped file, or packed copies
        self.types = list(types)
        self.isa = isa
        self._isa_id = ops.isa_id(isa)
        self.prefetch = PREFETCH_POLICIES["next-group"]  # the packed kernels' prefetch (KernelTuner.choose_prefetch)
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = _gguf_cols(parts[0], types[0])
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "GGUFLinearKernel":
        """As nn.Module's, over the parts too (they are a list, not buffers): a model moved to
        other memory (`specserve.model.huge_pages`) takes its GGUF weights along."""
        self.parts = [fn(p) for p in self.parts]
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return torch.ops.specserve.gguf_linear(x, self.parts, self.types, self.bias, self._isa_id,
                                                   self.prefetch)
        shape = x.shape
        y = torch.ops.specserve.gguf_linear(x.reshape(-1, shape[-1]).float(), self.parts, self.types, self.bias,
                                            self._isa_id, self.prefetch)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


    def row_spans(self, spans: list[tuple[int, int]], copy: bool = False) -> "GGUFLinearKernel":
        """The same projection over only the output rows in `spans` ([start, end) pairs, in order),
        stacked: views of these weights, or with `copy` their own memory (the rest can then go). A
        packed part is cut in whole groups of its rows."""
        parts: list[torch.Tensor] = []
        types: list[int] = []
        biases: list[torch.Tensor] = []
        for start, end in spans:
            first = 0
            for part, type_id in zip(self.parts, self.types):
                lo, hi = max(start, first), min(end, first + part.shape[0])
                if lo < hi:
                    group = PACKED_BY_ID[type_id].rows if type_id in PACKED_BY_ID else 1
                    if (lo - first) % group or (hi - first) % group:  # (a packed part is whole groups)
                        raise ValueError(f"rows: [{start}, {end}) cuts a group of {group} packed rows")
                    rows = part[lo - first:hi - first]
                    parts.append(rows.clone() if copy else rows)
                    types.append(type_id)
                    if self.bias is not None:
                        biases.append(self.bias[lo:hi])
                first += part.shape[0]
        cut = GGUFLinearKernel(parts, types, torch.cat(biases) if biases else None, self.isa)
        cut.prefetch = self.prefetch
        return cut


def _gguf_cols(blocks: torch.Tensor, type_id: int) -> int:
    from specserve.model.gguf_file import GGML_TYPES
    if type_id in PACKED_BY_ID:
        elems, size = PACKED_BY_ID[type_id].block_elems, PACKED_BY_ID[type_id].block_bytes
    else:
        elems, size = GGML_TYPES[type_id][1:]
    return blocks.shape[1] // size * elems


def packable(part: torch.Tensor, type_id: int, layout: PackedLayout) -> bool:
    packed = layout.of(type_id)
    return packed is not None and part.shape[0] % packed.rows == 0


# Rows a part is packed in at a time: with `done`, the source's pages can be dropped slice by slice,
# so loading never holds a whole large tensor twice (the 1.5B model's 191 MB head).
PACK_SLICE_BYTES = 16 << 20


def pack_gguf_parts(parts: list[torch.Tensor], types: list[int], layout: PackedLayout,
                    done: Callable[[int, int, int], None] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """The parts `layout` can hold repacked into it (new memory; the same numbers, losslessly), the
    others as they are. `done(part, row0, row1)` is told as each slice of a part's source rows has
    been copied (and is not read again)."""
    out_parts, out_types = [], []
    for i, (p, t) in enumerate(zip(parts, types)):
        packed = layout.of(t) if packable(p, t, layout) else None
        if packed is None:
            out_parts.append(p)
            out_types.append(t)
            continue
        cols = _gguf_cols(p, t)
        out = torch.empty(p.shape[0], packed.row_bytes(cols), dtype=torch.uint8)
        step = max(packed.rows, PACK_SLICE_BYTES // max(p.shape[1], 1) // packed.rows * packed.rows)
        for r0 in range(0, p.shape[0], step):
            r1 = min(r0 + step, p.shape[0])
            torch.ops.specserve.gguf_pack_(out[r0:r1], p[r0:r1], t, cols, packed.type_id)
            if done is not None:
                done(i, r0, r1)
        out_parts.append(out)
        out_types.append(packed.type_id)
    return out_parts, out_types


def _packed_kernel(parts: list[torch.Tensor], types: list[int], bias: torch.Tensor | None, isa: str,
                   layout: PackedLayout, done: Callable[[int, int, int], None] | None) -> "GGUFLinearKernel":
    return GGUFLinearKernel(*pack_gguf_parts(parts, types, layout, done), bias, isa)


def gguf_candidates(parts: list[torch.Tensor], types: list[int], bias: torch.Tensor | None,
                    packed: Callable[[int, int, int], None] | None = None) -> dict[str, KernelFactory]:
    """The compiled variants this CPU runs for these GGUF tensors, by name: "gguf-<isa>" over the
    file's blocks and, where the variant reads a packed layout and a part can be packed into it,
    "gguf-<isa>-<layout>" (Q4_K eight rows at a time for avx2: "x8"; Q4_K, Q6_K, Q4_0, Q4_1 and Q8_0
    sixteen for avx512vnni: "x16"). `packed` is pack_gguf_parts's `done`."""
    from specserve.model import ops

    out: dict[str, KernelFactory] = {}
    for isa in ops.runnable_isas():
        out[f"gguf-{isa}"] = functools.partial(GGUFLinearKernel, parts, types, bias, isa)
        layout = PACKED_LAYOUTS.get(isa)
        if layout is not None and any(packable(p, t, layout) for p, t in zip(parts, types)):
            out[f"gguf-{isa}-{layout.name}"] = functools.partial(_packed_kernel, parts, types, bias, isa, layout, packed)
    return out


def q8_0_candidates(weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, KernelFactory]:
    """`weight` (float, on the CPU) rounded to GGUF Q8_0 blocks (an fp16 scale per 32 weights) and
    the GGUF kernels this CPU runs for them (sixteen rows packed to a `vpdpbusd` vector where it has
    VNNI): for projections made here rather than read from a file, such as a draft head's."""
    import gguf

    blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return gguf_candidates([torch.from_numpy(blocks)], [int(gguf.GGMLQuantizationType.Q8_0)], bias)


# -- which kernels a device offers for a precision ------------------------------------------------

def candidates(precision: str, weight: torch.Tensor, bias: torch.Tensor | None,
               int4: Int4Weight | None = None) -> dict[str, KernelFactory]:
    """The kernels that can run `weight` (on its device) at `precision`, by name."""
    device = weight.device.type
    n, k = weight.shape
    out: dict[str, KernelFactory] = {}
    cpu32 = device == "cpu" and weight.dtype == torch.float32
    if precision == "none":
        if cpu32:
            # Only row-invariant kernels: F.linear and oneDNN pick their blocking by the number of
            # rows, so a row's last bits depended on its batch (batch-4 and batch-1 logprobs differed
            # at a quarter of the positions) and greedy speculation could change the output.
            out["native-f32"] = lambda: NativeF32Kernel(weight, bias)
        else:
            out["dense"] = lambda: DenseKernel(weight, bias)
            if OneDnnKernel.supported(weight):
                out["onednn"] = lambda: OneDnnKernel(weight, bias)
    elif precision == "int8":
        q8 = quantize_int8(weight)
        if cpu32 and k % GROUP_SIZE == 0:
            out["native-w8a8"] = lambda: NativeInt8Kernel(q8, bias)
        elif device == "cpu":
            out["aten-w8a16"] = lambda: Int8PackKernel(q8, bias, torch.bfloat16)
        else:
            out["int8-dequant"] = lambda: Int8DequantKernel(q8, bias)
    elif precision == "int4":
        q4 = int4 if int4 is not None else quantize_int4(weight)
        if cpu32:
            out["native-w4a8"] = lambda: NativeInt4Kernel(q4, bias)
        elif device == "cpu":
            out["aten-w4a16"] = lambda: Int4PackCpuKernel(q4, bias, torch.bfloat16)
        elif device == "cuda" and Int4PackCudaKernel.supported(n, k):
            out["int4-tinygemm"] = lambda: Int4PackCudaKernel(q4, bias)
        else:
            out["int4-dequant"] = lambda: Int4DequantKernel(q4, bias)
    else:
        raise ValueError(f"quantization: unknown {precision!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return out


def gguf_int4(data: "object", tensor_type: str) -> Int4Weight | None:
    """A GGUF tensor's own Q4_0/Q4_1 blocks as int4 weights (exactly the file's values), or None
    for other types. `data` is the reader's uint8 [rows, bytes per row] array."""
    import numpy as np

    if tensor_type not in ("Q4_0", "Q4_1"):
        return None
    raw = np.asarray(data, dtype=np.uint8)
    block = 18 if tensor_type == "Q4_0" else 20
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8.0 * d  # Q4_0: w = d * (q - 8)
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)  # element j, then j + 16, per block
    return Int4Weight(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(np.asarray(m)))


def prepare_linears(
    model: nn.Module,
    precision: str,
    choose: Callable[[str, tuple[int, int], torch.dtype, dict[str, KernelFactory]], tuple[str, nn.Module]],
    int4_source: Callable[[str], Int4Weight | None] | None = None,
    more: Callable[[torch.Tensor, torch.Tensor | None], dict[str, KernelFactory]] | None = None,
) -> dict[str, str]:
    """Give every projection (module with a `kernel` slot) the kernel `choose` picks for
    `precision` (the LM head: int8 when the rest is int4), and drop the dense weights the kernel no
    longer needs; `more(weight, bias)` adds candidates to choose among. Returns {module name: kernel name}."""
    if precision not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown {precision!r}; choose one of {', '.join(QUANTIZATIONS)}")
    shared = {id(p) for name, m in model.named_modules() if not hasattr(m, "kernel")
              for p in m.parameters(recurse=False)}
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if not hasattr(module, "kernel") or module.weight is None:
            continue
        own = "int8" if precision == "int4" and name in ("lm_head", "lm_head.inner") else precision
        exact = int4_source(name) if own == "int4" and int4_source is not None else None
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
        factories = candidates(own, weight, bias, exact)
        if more is not None:
            factories.update(more(weight, bias))
        kernel_name, kernel = choose(own, tuple(weight.shape), weight.dtype, factories)
        module.kernel = kernel
        chosen[name] = kernel_name
        if id(module.weight) not in shared:  # tied to the embedding: the embedding still needs it
            del module.weight
            module.register_parameter("weight", None)
    return chosen
