"""The decoder layers of a step in one native call (torch.ops.specserve.decoder_forward over csrc/decoder.c).

Used when every projection runs one of the package's CPU operators and attention is the in-place
CPU kernel: the hot path of decoding, and prefill too. It computes what the layer-by-layer Python
path computes, with the same kernels in the same variant, without the interpreter between them.
The layers' weights and caches are described once, to a `torch.classes.specserve.Decoder` that
holds them.
"""

from __future__ import annotations

from typing import Any

import torch

from specserve.model import ops
from specserve.model.quant import (PREFETCH_POLICIES, GGUFLinearKernel, NativeF32Kernel, NativeInt4Kernel,
                                   NativeInt8Kernel)

# Decoder.set_linear's projection kinds (csrc/cpu_kernels.h: LIN_*)
_F32, _INT8, _INT4, _GGUF = 0, 1, 2, 3


_Linear = tuple[int, list[torch.Tensor], list[int], torch.Tensor | None, int, int]


def _linear(module: Any, isa: int) -> _Linear | None:
    """set_linear's arguments for a projection (None: not a kernel the layer loop runs in variant `isa`)."""
    k = getattr(module, "kernel", None)
    if isinstance(k, GGUFLinearKernel):
        return _GGUF, list(k.parts), list(k.types), k.bias, ops.isa_id(k.isa), k.prefetch
    if getattr(k, "isa", None) != isa:
        return None
    unused = PREFETCH_POLICIES["next-group"]
    if isinstance(k, NativeInt4Kernel):
        return _INT4, [k.packed, k.scale, k.minimum], [], k.bias, isa, unused
    if isinstance(k, NativeInt8Kernel):
        return _INT8, [k.q, k.scale], [], k.bias, isa, unused
    if isinstance(k, NativeF32Kernel):
        return _F32, [k.weight], [], k.bias, isa, unused
    return None


class NativeDecoder:
    """One model's layers, bound to one KV cache."""

    def __init__(self, decoder: Any, eps: float) -> None:
        self._decoder = decoder
        self._eps = eps

    @staticmethod
    def build(model: Any, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> "NativeDecoder | None":
        """None unless every layer can run natively: float32 on the CPU, native projections, a
        float32 or bfloat16 cache."""
        if not kv_cache:
            return None
        k0 = kv_cache[0][0]
        if k0.device.type != "cpu" or k0.dtype not in (torch.float32, torch.bfloat16):
            return None
        cfg = model.config
        isa = ops.layer_isa()
        eps = model.layers[0].input_layernorm.eps
        decoder = torch.classes.specserve.Decoder(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                                  cfg.num_kv_heads, cfg.head_dim, eps, isa)
        for layer, (kc, vc) in zip(model.layers, kv_cache):
            parts = [_linear(layer.self_attn.qkv_proj, isa), _linear(layer.self_attn.o_proj, isa),
                     _linear(layer.mlp.gate_up_proj, isa), _linear(layer.mlp.down_proj, isa)]
            norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
            if any(p is None for p in parts) or any(n.dtype != torch.float32 for n in norms):
                return None
            index = decoder.add_layer(*norms, kc, vc)
            for which, (kind, tensors, types, bias, part_isa, prefetch) in enumerate(parts):
                decoder.set_linear(index, which, kind, tensors, types, bias, part_isa, prefetch)
        return NativeDecoder(decoder, eps)

    def __call__(self, x: torch.Tensor, num_layers: int, cos: torch.Tensor, sin: torch.Tensor, meta: Any,
                 scale: float, first_layer: int = 0) -> torch.Tensor:
        """x: [T, hidden] float32 residual stream entering layer `first_layer`; returns it after
        `num_layers` layers from there."""
        return torch.ops.specserve.decoder_forward(
            self._decoder, x, num_layers, cos, sin, meta.slot_mapping, meta.q_start, meta.q_len, meta.ctx_len,
            meta.tables, meta.table_off, meta.masks, meta.mask_off, scale, first_layer, meta.lanes)
