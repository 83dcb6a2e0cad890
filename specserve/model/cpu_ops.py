"""The layer's small CPU operations around attention, as the package's torch operators
(csrc/layer_ops.c through kernel_ops.cpp): the rotary embedding in place on fused q/k/v, writing new
K/V into the paged cache, RMSNorm and the gated activation; and each row's largest logits. Callers
use PyTorch instead when the tensors are not float32 on the CPU (`fits`)."""

from __future__ import annotations

import torch

from specserve.model import ops


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the native helpers can take these: float32 on the CPU, rows of contiguous values."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def contiguous_f32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()


def rope_(x: torch.Tensor, n_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `n_heads` heads of every row of x ([T, width], rows x.stride(0) apart) in
    place; cos/sin: [T, head_dim] contiguous."""
    isa = ops.layer_isa()  # first: it loads the library that defines the operator
    torch.ops.specserve.rope_(x, n_heads, head_dim, cos, sin, isa)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [T, KVH, D] float32 views with rows k.stride(0) apart (the same for v); slots int64."""
    isa = ops.layer_isa()  # first: it loads the library that defines the operator
    torch.ops.specserve.write_kv(k, v, k_cache, v_cache, slots, isa)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] contiguous float32."""
    isa = ops.layer_isa()  # first: it loads the library that defines the operator
    return torch.ops.specserve.rms_norm(x, weight, eps, isa)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] contiguous float32 -> silu(gate) * up, [T, I]."""
    isa = ops.layer_isa()  # first: it loads the library that defines the operator
    return torch.ops.specserve.silu_mul(gate_up, isa)


# The most indices `row_topk` gives a row (csrc/cpu_kernels.h, SPECSERVE_ROW_TOPK_MAX).
ROW_TOPK_MAX = 256


def row_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest values' indices ([T, n] float32, rows contiguous; 1 <= k <= min(n,
    ROW_TOPK_MAX)), largest first, the lower index first among equal values, NaN below every number."""
    isa = ops.layer_isa()  # first: it loads the library that defines the operator
    return torch.ops.specserve.row_topk(x, k, isa)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """[2, T]: each row's index of its largest value ([T, n] float32, rows contiguous, n >= 1), the
    first where several tie, NaN counting as largest (numpy's argmax); then 1 where the value there
    is finite. The columns are split among the threads."""
    isa = ops.layer_isa()  # first: it loads the library that defines the operator
    return torch.ops.specserve.row_argmax(x, isa)
