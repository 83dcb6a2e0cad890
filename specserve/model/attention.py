"""Reference attention backend over a paged KV cache (torch SDPA, CPU and CUDA).

The model sees only flat tensors. Per step, the model runner builds one
`AttentionMetadata`: where each new token's K/V goes (`slot_mapping`) and a few
`AttentionGroup`s. A group is a set of requests whose new tokens are attended
together: each request contributes up to `Qp` query rows and up to `Lp` key
slots gathered from the cache, with a boolean mask saying which query sees
which key. The mask is what makes token trees possible later: a tree node sees
its request's cached prefix and its own ancestors, nothing else. Causal
chunks are the special case where the mask among new tokens is lower-triangular.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended in one SDPA call.

    kv_blocks: [G, NB] each row's block table (padding: block 0); keys are the
        NB * block_size slots of those blocks, in position order
    mask: [G, 1, rep * Qp, NB * block_size] True where the query may attend to the key, with the
        query axis laid out head-group-major (see `_to_kv_major`); None when every
        query sees every key
    q_index: [G, Qp] flat token index of each query row (padding rows repeat a valid
        index), or None when row g's single query is token `q_start + g`
    q_valid: [G, Qp] True for real query rows (unused when q_index is None)
    out_index: [N] flat token index of each valid query row, in q_valid order
    causal_range: (start, end) when the group is one request whose whole context is
        the new tokens [start, end) with a causal mask; SDPA then needs no gather.
    """

    kv_blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None
    out_index: torch.Tensor | None = None
    q_start: int = 0
    causal_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    groups: tuple[AttentionGroup, ...]


def _to_kv_major(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[G, Q, H, D] -> [G, KVH, rep*Q, D] so that heads sharing a KV head share one SDPA row block."""
    g, q, h, d = x.shape
    rep = h // num_kv_heads
    return x.view(g, q, num_kv_heads, rep, d).permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, rep * q, d)


def _from_kv_major(x: torch.Tensor, num_heads: int, q_len: int) -> torch.Tensor:
    """Inverse of `_to_kv_major`: [G, KVH, rep*Q, D] -> [G, Q, H, D]."""
    g, kvh, _, d = x.shape
    rep = num_heads // kvh
    return x.view(g, kvh, rep, q_len, d).permute(0, 3, 1, 2, 4).reshape(g, q_len, num_heads, d)


class PagedAttention:
    """Writes new K/V into the paged cache and attends each group with SDPA.

    Grouped-query attention is done without repeating K/V: the query heads that
    share a KV head are stacked along the query axis, and the mask is tiled to match.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].causal_range == (0, q.shape[0]):
            return self._causal(q, k, v)
        out = torch.empty_like(q)
        for group in meta.groups:
            if group.causal_range is not None:
                s, e = group.causal_range
                out[s:e] = self._causal(q[s:e], k[s:e], v[s:e])
                continue
            assert group.kv_blocks is not None
            g, nb = group.kv_blocks.shape
            if group.q_index is None:
                qs = q[group.q_start : group.q_start + g, None]  # [G, 1, H, D]
            else:
                qs = q[group.q_index]
            q_len = qs.shape[1]
            # Gather whole blocks (contiguous runs), then view them as one key axis.
            kg = k_cache[group.kv_blocks].view(g, nb * k_cache.shape[1], self.num_kv_heads, self.head_dim)
            vg = v_cache[group.kv_blocks].view(g, nb * v_cache.shape[1], self.num_kv_heads, self.head_dim)
            kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [G, KVH, L, D]
            o = F.scaled_dot_product_attention(
                _to_kv_major(qs, self.num_kv_heads), kg, vg, attn_mask=group.mask, scale=self.scale
            )
            o = _from_kv_major(o, self.num_heads, q_len)
            if group.q_index is None:
                out[group.q_start : group.q_start + g] = o[:, 0]
            else:
                out[group.out_index] = o[group.q_valid]
        return out

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One request whose context is exactly these new tokens, causal."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1)
