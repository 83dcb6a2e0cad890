"""Attention backends: `sdpa` (reference: torch SDPA over gathered blocks, any device) and
`cpu-paged` (reads blocks in place: torch.ops.specserve.paged_attention, built at install)."""

from __future__ import annotations

import logging

import torch

from specserve.model.attention.base import AttentionBackend, AttentionBatch, PlannedAttention

logger = logging.getLogger("specserve.model")

ATTENTION_BACKENDS = ("auto", "sdpa", "cpu-paged")

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionBatch", "PlannedAttention", "in_place_attention",
           "make_backend"]


def in_place_attention(name: str, device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether `make_backend(name, ...)` gives the in-place CPU kernel (the one the native layer
    loop runs with) for this device and KV cache dtype."""
    from specserve.model.attention.cpu_paged import CpuPagedBackend

    if name == "cpu-paged":
        return True
    return name == "auto" and device.type == "cpu" and kv_dtype in CpuPagedBackend.KV_DTYPES


def make_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend `name` for this device and KV cache dtype; "auto" takes the in-place CPU
    kernel on the CPU (float32 or bfloat16 caches), else SDPA. The CPU kernel's vector width is the
    one measured fastest for these heads on this machine (`tuning.attention_lanes`)."""
    from specserve.model.attention.cpu_paged import CpuPagedBackend
    from specserve.model.attention.sdpa import SdpaBackend

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "cpu-paged" and device.type != "cpu":
        raise ValueError(f"attention_backend: cpu-paged runs on the CPU, not on {device.type}")
    if name == "cpu-paged" and kv_dtype not in CpuPagedBackend.KV_DTYPES:
        raise ValueError(f"attention_backend: cpu-paged reads float32 or bfloat16 caches, not {kv_dtype}")
    if in_place_attention(name, device, kv_dtype):
        from specserve.model.tuning import KernelTuner, attention_lanes

        lanes = attention_lanes(KernelTuner(device), num_heads, num_kv_heads, head_dim, kv_dtype)
        return CpuPagedBackend(num_heads, num_kv_heads, head_dim, lanes)
    return SdpaBackend(num_heads, num_kv_heads, head_dim)
