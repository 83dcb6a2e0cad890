"""Turns a scheduled batch into flat tensors, runs the model, returns logits to sample from."""

from __future__ import annotations

import torch

from specserve.engine.scheduler import ScheduledSeq
from specserve.model.attention import AttentionGroup, AttentionMetadata
from specserve.model.llama import KVCache, LlamaForCausalLM

# Requests with at most this many new tokens (decodes, later draft trees) share one padded SDPA call.
SMALL_QUERY = 16


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: tuple[ScheduledSeq, ...], all_logits: bool = False) -> torch.Tensor:
        """Run one forward over every scheduled token.

        Returns float32 logits [number of sampling requests, vocab], one row per request
        whose step reaches its last token; with `all_logits`, one row per scheduled token.
        """
        input_ids, positions, slots, sample_idx = self._flatten(batch)
        meta = AttentionMetadata(slot_mapping=slots, groups=self._groups(batch))
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden if all_logits else hidden[sample_idx])

    def _flatten(self, batch: tuple[ScheduledSeq, ...]) -> tuple[torch.Tensor, ...]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        for item in batch:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            ids.extend(seq.token_slice(start, end))
            table = seq.block_table
            for p in range(start, end):
                slots.append(table[p // bs] * bs + p % bs)
            pos.extend(range(start, end))
            if item.samples:
                sample_idx.append(len(ids) - 1)
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            torch.tensor(sample_idx, dtype=torch.long, device=dev),
        )

    def _groups(self, batch: tuple[ScheduledSeq, ...]) -> tuple[AttentionGroup, ...]:
        groups: list[AttentionGroup] = []
        small: list[tuple[int, ScheduledSeq]] = []
        offset = 0
        for item in batch:
            n = item.num_new_tokens
            if item.seq.num_computed_tokens == 0:
                groups.append(self._causal_group(offset, n))
            elif n <= SMALL_QUERY:
                small.append((offset, item))
            else:
                groups.append(self._padded_group([(offset, item)]))
            offset += n
        if small:
            groups.append(self._padded_group(small))
        return tuple(groups)

    def _causal_group(self, offset: int, n: int) -> AttentionGroup:
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        return AttentionGroup(
            q_index=empty, q_valid=empty.bool(), kv_slots=empty, mask=empty.bool(), out_index=empty,
            causal_range=(offset, offset + n),
        )

    def _padded_group(self, items: list[tuple[int, ScheduledSeq]]) -> AttentionGroup:
        """Requests with cached context: each query sees the cached prefix and earlier new tokens."""
        bs = self.block_size
        dev = self.device
        q_pad = max(it.num_new_tokens for _, it in items)
        ctx_lens = [it.seq.num_computed_tokens + it.num_new_tokens for _, it in items]
        kv_pad = max(ctx_lens)
        g = len(items)
        arange_q = torch.arange(q_pad, device=dev)
        arange_kv = torch.arange(kv_pad, device=dev)
        q_index = torch.empty(g, q_pad, dtype=torch.long, device=dev)
        kv_slots = torch.zeros(g, kv_pad, dtype=torch.long, device=dev)
        n_new = torch.tensor([it.num_new_tokens for _, it in items], device=dev)
        ctx = torch.tensor(ctx_lens, device=dev)
        for row, (offset, item) in enumerate(items):
            q_index[row] = offset + torch.clamp(arange_q, max=item.num_new_tokens - 1)
            table = torch.tensor(item.seq.block_table, dtype=torch.long, device=dev)
            n_ctx = ctx_lens[row]
            kv_slots[row, :n_ctx] = table[arange_kv[:n_ctx] // bs] * bs + arange_kv[:n_ctx] % bs
        q_valid = arange_q[None, :] < n_new[:, None]
        # Query j of a row sits at position ctx - n_new + j and sees keys at positions <= its own.
        q_pos = (ctx - n_new)[:, None] + arange_q[None, :]
        mask = arange_kv[None, None, :] <= q_pos[:, :, None]
        mask &= q_valid[:, :, None] | (arange_kv == 0)[None, None, :]  # padding rows see key 0 only
        return AttentionGroup(
            q_index=q_index,
            q_valid=q_valid,
            kv_slots=kv_slots,
            mask=mask[:, None],
            out_index=q_index[q_valid],
        )
