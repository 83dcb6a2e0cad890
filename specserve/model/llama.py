"""Llama-family decoder over flat token batches (Llama 2/3, Mistral, Qwen2, SmolLM).

Inputs are flat: token ids [T], positions [T], and attention metadata that
says where K/V go in the paged cache and who attends to whom. The model knows
nothing of requests, schedules or trees.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig, RopeScaling
from specserve.model.attention import AttentionMetadata, PagedAttention

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Linear(nn.Module):
    """y = x W^T (+ b), like nn.Linear, with an optional oneDNN-packed copy of W for the CPU.

    On CPU in float32, oneDNN's matmul on a weight reordered into its blocked
    layout runs the whole SmolLM2-135M decode step's projections about 2x faster
    than the MKL path behind nn.Linear (one row and 32 rows alike; see
    BENCHMARKS.md). `pack()` makes that copy; the dense weight stays the parameter
    (state dicts, other devices), at the cost of holding the matrices twice in
    host memory.
    """

    # Rows the packed layout is tuned for; measured to matter little between 8 and 2048.
    PACK_BATCH_HINT = 32

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None

    def pack(self) -> bool:
        """Prepack for oneDNN when it can run this layer; returns whether it did."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.PACK_BATCH_HINT)
            probe = torch.randn(2, w.shape[1])
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            if not torch.allclose(got, F.linear(probe, w, self.bias), atol=1e-4, rtol=1e-4):
                return False
        except (RuntimeError, AttributeError):
            return False
        self._packed = packed
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, 1, D] for these positions, looked up once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, *rope)
        out = self.attn(q, k, v, kv[0], kv[1], meta)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        # gate and up projections fused into one matmul.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: KVCache,
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for every new token. With `num_layers`, only the
        first that many layers run (self-speculation by layer skipping) and write their K/V."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer, kv in zip(layers, kv_caches):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    def pack_weights(self) -> int:
        """Prepack every projection for the fastest kernel on this device; returns how many were packed."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
