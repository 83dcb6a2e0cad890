"""The reference attention backend: torch SDPA over K/V gathered from the paged cache (CPU, CUDA).

`plan` sorts the items into a few `AttentionGroup`s. A group is a set of requests whose new
tokens are attended together: each request contributes up to `Qp` query rows and up to `Lp` key
slots gathered (whole blocks at a time) from the cache, with a boolean mask saying which query
sees which key: a tree node sees its request's cached prefix and its own ancestors, a causal
chunk the prefix and the tokens before it. A request whose whole context is its new tokens
attends them directly, with no gather.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.model.attention.base import AttentionBackend, AttentionBatch, write_kv

# Requests with at most this many new tokens (decodes, draft trees) share one padded SDPA call.
SMALL_QUERY = 16

# The SDPA kernels the backend lets torch choose among: every one but cuDNN's, which builds and
# compiles an execution graph for each new (query length, key length) shape. Decoding changes
# the key length every block and a draft tree the query length nearly every step, so on an H100
# a step carrying a new tree shape cost 3x a plain step while the same shape, warm, cost 1.0-1.3x
# (BENCHMARKS.md, GPU session 20). Flash and memory-efficient attention take any shape as it comes.
SDPA_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


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
    valid_rows: [N] position of each real query row in the flattened [G * Qp] rows (integer
        indices made on the host: a boolean index would make the device wait for the host on
        every layer, which on a GPU serializes the kernel launches with the kernels)
    out_index: [N] flat token index of each valid query row, in valid_rows order
    causal_range: (start, end) when the group is one request whose whole context is
        the new tokens [start, end) with a causal mask; SDPA then needs no gather.
    """

    kv_blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None
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


class SdpaBackend(AttentionBackend):
    """Writes new K/V into the paged cache and attends each group with SDPA.

    Grouped-query attention is done without repeating K/V: the query heads that
    share a KV head are stacked along the query axis, and the mask is tiled to match.
    """

    name = "sdpa"

    def kernels(self) -> AbstractContextManager[object]:
        """SDPA_KERNELS only, for the whole forward (entered once, not per layer: ~9 us each)."""
        return sdpa_kernel(list(SDPA_KERNELS))

    def plan(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
        groups: list[AttentionGroup] = []
        small: list[int] = []
        for i in range(batch.num_items):
            n = batch.q_len[i]
            if batch.ctx_len[i] == n and batch.masks[i] is None:
                groups.append(AttentionGroup(causal_range=(batch.q_start[i], batch.q_start[i] + n)))
            elif n <= SMALL_QUERY:
                small.append(i)
            else:
                groups.append(self._padded_group(batch, [i], device))
        if small:
            groups.append(self._padded_group(batch, small, device))
        return AttentionMetadata(slot_mapping=batch.slot_mapping, groups=tuple(groups))

    def _padded_group(self, batch: AttentionBatch, items: list[int], device: torch.device) -> AttentionGroup:
        """Requests with cached context: each new token sees the cached prefix and, among the new
        tokens, those its mask allows (causal by default)."""
        bs = batch.block_size
        n_new_list = [batch.q_len[i] for i in items]
        ctx_lens = [batch.ctx_len[i] for i in items]
        n_blocks = [-(-c // bs) for c in ctx_lens]
        nb = max(n_blocks)
        tables = [list(batch.block_tables[i][:k]) + [0] * (nb - k) for i, k in zip(items, n_blocks)]
        kv_blocks = torch.tensor(tables, dtype=torch.long, device=device)
        offsets_list = [batch.q_start[i] for i in items]
        first = offsets_list[0]
        single_token_run = max(n_new_list) == 1 and all(off == first + r for r, off in enumerate(offsets_list))
        if single_token_run and all(c == nb * bs for c in ctx_lens):
            return AttentionGroup(kv_blocks=kv_blocks, q_start=first)  # every query sees every key

        q_pad, kv_len = max(n_new_list), nb * bs
        arange_q = torch.arange(q_pad)
        arange_kv = torch.arange(kv_len)
        n_new = torch.tensor(n_new_list)
        ctx = torch.tensor(ctx_lens)
        q_valid = arange_q[None, :] < n_new[:, None]
        # Query j of a row sits at logical slot ctx - n_new + j and sees keys at slots <= its own.
        q_slot = (ctx - n_new)[:, None] + arange_q[None, :]
        mask = arange_kv[None, None, :] <= q_slot[:, :, None]
        for row, i in enumerate(items):
            tree = batch.masks[i]
            if tree is not None:  # among the new tokens, ancestors only
                n, start = batch.q_len[i], batch.ctx_len[i] - batch.q_len[i]
                mask[row, :n, start : start + n] = tree
        mask &= q_valid[:, :, None] | (arange_kv == 0)[None, None, :]  # padding rows see key 0 only
        rep = self.num_heads // self.num_kv_heads
        tiled = mask[:, None].repeat(1, 1, rep, 1).to(device)  # query axis: head-group-major, as SDPA sees it
        if single_token_run:
            return AttentionGroup(kv_blocks=kv_blocks, mask=tiled, q_start=first)
        offsets = torch.tensor(offsets_list)
        q_index = offsets[:, None] + torch.minimum(arange_q[None, :], n_new[:, None] - 1)
        valid_rows = q_valid.flatten().nonzero().flatten()  # on the host, once a step
        return AttentionGroup(kv_blocks=kv_blocks, mask=tiled, q_index=q_index.to(device),
                              valid_rows=valid_rows.to(device), out_index=q_index.flatten()[valid_rows].to(device))

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if k_cache.dtype != k.dtype:  # attend to K/V as the cache holds them, as every later read will
            k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
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
            kg = k_cache[group.kv_blocks].view(g, nb * k_cache.shape[1], self.num_kv_heads, self.head_dim).to(q.dtype)
            vg = v_cache[group.kv_blocks].view(g, nb * v_cache.shape[1], self.num_kv_heads, self.head_dim).to(q.dtype)
            kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [G, KVH, L, D]
            o = F.scaled_dot_product_attention(
                _to_kv_major(qs, self.num_kv_heads), kg, vg, attn_mask=group.mask, scale=self.scale
            )
            o = _from_kv_major(o, self.num_heads, q_len)
            if group.q_index is None:
                out[group.q_start : group.q_start + g] = o[:, 0]
            else:
                out[group.out_index] = o.flatten(0, 1)[group.valid_rows]
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
