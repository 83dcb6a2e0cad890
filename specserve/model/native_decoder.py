"""The decoder layers of a step in one native call (csrc/decoder.c).

Used when every projection runs a native kernel and attention is the in-place CPU kernel: the
hot path of decoding, and prefill too. It computes what the layer-by-layer Python path computes,
with the same kernels, without the interpreter between them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from specserve.model import native
from specserve.model.quant import GGUFLinearKernel, NativeF32Kernel, NativeInt4Kernel, NativeInt8Kernel

_P = ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("w", _P), ("scale", _P), ("minimum", _P), ("bias", _P), ("fn", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", _P), ("v_cache", _P)]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load("decoder").library
    if lib is None:
        return None
    i = ctypes.c_int
    lib.decoder_forward.restype = i
    lib.decoder_forward.argtypes = [_P, i, i, i, _P, i, ctypes.c_float, i, i, i, i, i, _P, _P, _P, i,
                                    _P, _P, _P, _P, _P, _P, _P, ctypes.c_float]
    return lib


def _linear(module: Any) -> _Linear | None:
    """The C description of a projection (None: not a native kernel)."""
    k = getattr(module, "kernel", None)
    bias = None if getattr(k, "bias", None) is None else k.bias.data_ptr()
    if isinstance(k, NativeInt4Kernel):
        n, half = k.packed.shape
        return _Linear(2, n, half * 2, 0, k.packed.data_ptr(), k.scale.data_ptr(), k.minimum.data_ptr(), bias)
    if isinstance(k, NativeInt8Kernel):
        n, kk = k.q.shape
        return _Linear(1, n, kk, 0, k.q.data_ptr(), k.scale.data_ptr(), None, bias)
    if isinstance(k, NativeF32Kernel):
        n, kk = k.weight.shape
        return _Linear(0, n, kk, 0, k.weight.data_ptr(), None, None, bias)
    if isinstance(k, GGUFLinearKernel):  # the block kernels of specserve/_C, through their C entry point
        fn, ctx = k.native()
        return _Linear(3, k.out_features, k.in_features, 0, ctx, None, None, None, fn)
    return None


class NativeDecoder:
    """One model's layers as C structs, bound to one KV cache."""

    def __init__(self, layers: ctypes.Array, cfg: Any, kv_bf16: bool, eps: float) -> None:
        self._layers = layers
        self._cfg = cfg
        self._kv_bf16 = kv_bf16
        self._eps = eps

    @staticmethod
    def available() -> bool:
        """Whether the layer loop's library builds on this machine."""
        return _lib() is not None

    @staticmethod
    def build(model: Any, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> "NativeDecoder | None":
        """None unless every layer can run natively: float32 on the CPU, native projections, a
        float32 or bfloat16 cache."""
        if _lib() is None or not kv_cache:
            return None
        k0 = kv_cache[0][0]
        if k0.device.type != "cpu" or k0.dtype not in (torch.float32, torch.bfloat16):
            return None
        structs = (_Layer * len(model.layers))()
        for i, (layer, (kc, vc)) in enumerate(zip(model.layers, kv_cache)):
            parts = [_linear(layer.self_attn.qkv_proj), _linear(layer.self_attn.o_proj),
                     _linear(layer.mlp.gate_up_proj), _linear(layer.mlp.down_proj)]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(p is None for p in parts) or any(n.dtype != torch.float32 for n in norms):
                return None
            structs[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *parts,
                                kc.data_ptr(), vc.data_ptr())
        return NativeDecoder(structs, model.config, k0.dtype == torch.bfloat16,
                             model.layers[0].input_layernorm.eps)

    def __call__(self, x: torch.Tensor, num_layers: int, cos: torch.Tensor, sin: torch.Tensor, meta: Any,
                 scale: float, block_size: int) -> torch.Tensor:
        """x: [T, hidden] float32 embeddings; returns the residual stream after `num_layers` layers."""
        cfg = self._cfg
        x = x.contiguous().clone()
        rc = _lib().decoder_forward(
            x.data_ptr(), x.shape[0], cfg.hidden_size, cfg.intermediate_size, ctypes.addressof(self._layers),
            num_layers, self._eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, int(self._kv_bf16),
            cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), meta.n_items, meta.q_start.data_ptr(),
            meta.q_len.data_ptr(), meta.ctx_len.data_ptr(), meta.tables.data_ptr(), meta.table_off.data_ptr(),
            meta.masks.data_ptr(), meta.mask_off.data_ptr(), scale,
        )
        if rc != 0:
            raise RuntimeError(f"native decoder failed (code {rc})")
        return x
