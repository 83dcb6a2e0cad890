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
                groups.append(AttentionGroup(causal_range=(offset, offset + n)))
            elif n <= SMALL_QUERY:
                small.append((offset, item))
            else:
                groups.append(self._padded_group([(offset, item)]))
            offset += n
        if small:
            groups.append(self._padded_group(small))
        return tuple(groups)

    def _padded_group(self, items: list[tuple[int, ScheduledSeq]]) -> AttentionGroup:
        """Requests with cached context: each query sees the cached prefix and earlier new tokens."""
        bs = self.block_size
        dev = self.device
        n_new_list = [it.num_new_tokens for _, it in items]
        ctx_lens = [it.seq.num_computed_tokens + it.num_new_tokens for _, it in items]
        n_blocks = [-(-c // bs) for c in ctx_lens]
        nb = max(n_blocks)
        tables = [it.seq.block_table[:k] + [0] * (nb - k) for (_, it), k in zip(items, n_blocks)]
        kv_blocks = torch.tensor(tables, dtype=torch.long, device=dev)
        first = items[0][0]
        single_token_run = max(n_new_list) == 1 and all(off == first + r for r, (off, _) in enumerate(items))
        if single_token_run and all(c == nb * bs for c in ctx_lens):
            return AttentionGroup(kv_blocks=kv_blocks, q_start=first)  # every query sees every key

        q_pad, kv_len = max(n_new_list), nb * bs
        arange_q = torch.arange(q_pad)
        arange_kv = torch.arange(kv_len)
        n_new = torch.tensor(n_new_list)
        ctx = torch.tensor(ctx_lens)
        q_valid = arange_q[None, :] < n_new[:, None]
        # Query j of a row sits at position ctx - n_new + j and sees keys at positions <= its own.
        q_pos = (ctx - n_new)[:, None] + arange_q[None, :]
        mask = arange_kv[None, None, :] <= q_pos[:, :, None]
        mask &= q_valid[:, :, None] | (arange_kv == 0)[None, None, :]  # padding rows see key 0 only
        rep = self.model.config.num_heads // self.model.config.num_kv_heads
        tiled = mask[:, None].repeat(1, 1, rep, 1).to(dev)  # query axis: head-group-major, as SDPA sees it
        if single_token_run:
            return AttentionGroup(kv_blocks=kv_blocks, mask=tiled, q_start=first)
        offsets = torch.tensor([off for off, _ in items])
        q_index = (offsets[:, None] + torch.minimum(arange_q[None, :], n_new[:, None] - 1)).to(dev)
        q_valid = q_valid.to(dev)
        return AttentionGroup(
            kv_blocks=kv_blocks, mask=tiled, q_index=q_index, q_valid=q_valid, out_index=q_index[q_valid]
        )
