"""Native CPU helpers for the layer around attention (csrc/cpu_ops.c): the rotary embedding in
place on fused q/k/v, and writing new K/V into the paged cache. Callers fall back to PyTorch
when `available()` is false or the tensors are not float32 on the CPU."""

from __future__ import annotations

import ctypes
import functools

import torch

from specserve.model import native

_P = ctypes.c_void_p


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load("cpu_ops").library
    if lib is None:
        return None
    i, i64 = ctypes.c_int, ctypes.c_int64
    lib.rope_inplace.argtypes = [_P, i, i, i, i, _P, _P]
    lib.write_kv_f32.argtypes = [_P, _P, i64, _P, _P, _P, i, i]
    lib.write_kv_bf16.argtypes = [_P, _P, i64, _P, _P, _P, i, i]
    lib.rms_norm.argtypes = [_P, _P, _P, i, i, ctypes.c_float]
    lib.silu_mul.argtypes = [_P, _P, i, i]
    for fn in (lib.rope_inplace, lib.write_kv_f32, lib.write_kv_bf16, lib.rms_norm, lib.silu_mul):
        fn.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the native helpers can take these: float32 on the CPU, rows of contiguous values."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def rope_(x: torch.Tensor, n_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `n_heads` heads of every row of x ([T, width], rows x.stride(0) apart) in
    place; cos/sin: [T, head_dim] contiguous."""
    _lib().rope_inplace(x.data_ptr(), x.shape[0], x.stride(0), n_heads, head_dim, cos.data_ptr(), sin.data_ptr())


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [T, KVH, D] float32 views with rows k.stride(0) apart (the same for v); slots int64."""
    row = k_cache.shape[2] * k_cache.shape[3]
    fn = _lib().write_kv_f32 if k_cache.dtype == torch.float32 else _lib().write_kv_bf16
    fn(k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
       k.shape[0], row)


def contiguous_f32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] contiguous float32."""
    y = torch.empty_like(x)
    _lib().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] contiguous float32 -> silu(gate) * up, [T, I]."""
    t, width = gate_up.shape
    out = torch.empty(t, width // 2, dtype=torch.float32)
    _lib().silu_mul(gate_up.data_ptr(), out.data_ptr(), t, width // 2)
    return out
