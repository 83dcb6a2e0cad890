"""Llama-family decoder over flat token batches (Llama 2/3, Mistral, Qwen2, SmolLM).

Inputs are flat: token ids [T], positions [T], and attention metadata that
says where K/V go in the paged cache and who attends to whom. The model knows
nothing of requests, schedules or trees.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig, RopeScaling
from specserve.model import cpu_ops
from specserve.model.attention.base import PlannedAttention
from specserve.model.native_decoder import NativeDecoder

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Linear(nn.Module):
    """y = x W^T (+ b), like nn.Linear, until `kernel` is set (see specserve.model.quant): then the
    kernel holds the weights, in whatever precision and layout it runs fastest."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernel: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


class VocabSpanHead(nn.Module):
    """An LM head that computes only the rows [0, keep) and [tail, vocab) of the full head (FR-Spec's
    cut for a draft model: the most frequent tokens, and the special ones at the end of the
    vocabulary); the other tokens' logits are -inf, so they are never proposed. `inner` computes
    the kept rows, stacked."""

    def __init__(self, inner: nn.Module, keep: int, tail: int, vocab: int) -> None:
        super().__init__()
        self.inner = inner
        self.keep, self.tail, self.vocab = keep, tail, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        out = y.new_full((*y.shape[:-1], self.vocab), float("-inf"))
        out[..., : self.keep] = y[..., : self.keep]
        out[..., self.tail :] = y[..., self.keep :]
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_ops.contiguous_f32(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
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

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                 freq_factors: torch.Tensor | None = None) -> None:
        """`freq_factors`: per-frequency divisors given as a tensor (Llama 3.x GGUF files carry their
        scaling so), applied instead of `scaling`."""
        super().__init__()
        if freq_factors is not None:
            inv_freq = rope_inv_freq(head_dim, theta, RopeScaling()) / freq_factors.float()
        else:
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # both halves of a row take the same angles; filled in place (at 32k positions the
        # intermediate tables were 40 MB more at load, for a 32 MB result)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        half = freqs.shape[-1]
        cos, sin = freqs.new_empty(max_positions, 2 * half), freqs.new_empty(max_positions, 2 * half)
        torch.cos(freqs, out=cos[:, :half])
        torch.sin(freqs, out=sin[:, :half])
        del freqs
        cos[:, half:] = cos[:, :half]
        sin[:, half:] = sin[:, :half]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, D] for these positions, looked up once per forward."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


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

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        attn: PlannedAttention,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        native_rope = cpu_ops.fits(qkv)
        if native_rope:  # q and k rotated in place: one call instead of a dozen tensor operations
            cpu_ops.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not native_rope:
            cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
            q, k = apply_rope(q, k, cos, sin)
        out = attn(q, k, v, kv[0], kv[1])
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        # gate and up projections fused into one matmul.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.dim() == 2 and cpu_ops.contiguous_f32(gate_up):
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
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
        attn: PlannedAttention,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        # no random init (built on the meta device, a normal_ there imports torch._dynamo: 2.7 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.device("cpu"):  # computed, not loaded (and on the meta device its ops import torch._dynamo)
            self.rope = RotaryEmbedding(
                cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
            )
        self._native_decoder: tuple[int, NativeDecoder | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: KVCache,
        attn: PlannedAttention,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for every new token. With `num_layers`, only the
        first that many layers run (self-speculation by layer skipping) and write their K/V."""
        return self.forward_features(input_ids, positions, kv_caches, attn, num_layers)[0]

    def forward_features(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        attn: PlannedAttention,
        num_layers: int | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`'s hidden states, and for each n in `feature_layers` the residual stream after
        the first n layers through the final norm [T, hidden] (the low and middle layers' features
        an EAGLE-3-style head fuses with the last)."""
        n = len(self.layers) if num_layers is None else num_layers
        for f in feature_layers:
            if not 1 <= f <= n:
                raise ValueError(f"feature_layers: {f} is not among the {n} layers that run")
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype)
        native = self._native(kv_caches, x)
        meta = attn.native_metadata() if native is not None else None
        by_layer: dict[int, torch.Tensor] = {}
        done = 0
        for stop in sorted(set(feature_layers) | {n}):
            if native is not None and meta is not None:  # a small step: the layers in one native call
                x = native(x, stop - done, rope[0], rope[1], meta, attn.backend.scale, done)
            else:
                for layer, kv in zip(self.layers[done:stop], kv_caches[done:stop]):
                    x = layer(x, rope, kv, attn)
            done = stop
            if stop in feature_layers:
                by_layer[stop] = self.norm(x)
        return self.norm(x), [by_layer[f] for f in feature_layers]

    def kernels_changed(self) -> None:
        """Call after replacing a projection's kernel: the native layer loop is rebuilt from them."""
        self._native_decoder = None

    def _native(self, kv_caches: KVCache, x: torch.Tensor) -> NativeDecoder | None:
        """The native layer loop for these caches, when every layer can run there (built once per
        KV cache)."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not kv_caches:
            return None
        key = kv_caches[0][0].data_ptr()
        if self._native_decoder is None or self._native_decoder[0] != key:
            self._native_decoder = (key, NativeDecoder.build(self, kv_caches))
        return self._native_decoder[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # A GGUF head's rows are kept in whole spans of this many: every packed layout's group divides it.
    GGUF_HEAD_ALIGN = 64

    def read_out_vocabulary(self, first: int, keep_ids: Iterable[int] = ()) -> tuple[int, int] | None:
        """Make the LM head compute the logits of the first `first` token ids and of every id from
        the smallest of `keep_ids` past them to the end (for a GGUF head, rounded out to whole spans
        of GGUF_HEAD_ALIGN rows), the rest -inf: what a draft model's head needs (byte-level BPE ids
        run roughly from frequent to rare, and tokenizers add their special tokens at the end), at
        a fraction of the full head's bytes. Returns the kept spans' bounds (keep, tail), or None
        where nothing is cut (the vocabulary is no larger, or the head's kernel cannot be cut by rows)."""
        from specserve.model.quant import GGUFLinearKernel

        head, vocab = self.lm_head, self.config.vocab_size
        gguf = isinstance(head, Linear) and isinstance(head.kernel, GGUFLinearKernel)
        dense = isinstance(head, Linear) and head.kernel is None and head.weight is not None
        if not (gguf or dense):
            return None
        align = self.GGUF_HEAD_ALIGN if gguf else 1
        keep = min(vocab, -(-first // align) * align)
        later = [i for i in keep_ids if keep <= i < vocab]
        tail = min(later) // align * align if later else vocab
        if tail - keep < align:
            return None
        spans = [(0, keep)] + ([(tail, vocab)] if tail < vocab else [])
        if gguf:
            inner: nn.Module = head.kernel.row_spans(spans, copy=True)  # type: ignore[union-attr]  # the full head's memory goes
        else:
            inner = Linear(self.config.hidden_size, keep + vocab - tail, bias=head.bias is not None)
            inner.weight = nn.Parameter(torch.cat([head.weight[a:b] for a, b in spans]).detach(), requires_grad=False)
            if head.bias is not None:
                inner.bias = nn.Parameter(torch.cat([head.bias[a:b] for a, b in spans]).detach(), requires_grad=False)
        self.lm_head = VocabSpanHead(inner, keep, tail, vocab)  # type: ignore[assignment]
        return keep, tail
