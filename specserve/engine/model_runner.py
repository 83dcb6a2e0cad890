"""Turns a scheduled batch into flat tensors, runs the model, returns logits to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledSeq
from specserve.spec.tree import DraftTree
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


@dataclass(frozen=True)
class ForwardItem:
    """One request's slice of a forward: new tokens written after `start` cached tokens.

    block_table: the request's KV blocks; new token i goes to logical slot start + i
    positions: RoPE positions of the new tokens (default start, start + 1, ...)
    mask: [n, n] bool visibility among the new tokens (default causal); a draft tree
        passes its ancestor mask. Every new token sees all `start` cached tokens.
    logits: which rows' logits to return: "last", "all" or "none"
    """

    block_table: list[int]
    start: int
    tokens: list[int]
    positions: list[int] | None = None
    mask: torch.Tensor | None = None
    logits: str = "last"


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    def execute(
        self, batch: tuple[ScheduledSeq, ...], drafts: dict[int, DraftTree] | None = None
    ) -> tuple[torch.Tensor, list[tuple[int, int] | None]]:
        """Run one forward over a scheduled batch, with draft trees for some decodes.

        drafts maps an index into `batch` to that request's draft tree. Returns float32 logits and,
        per batch item, (first row, number of rows) into them, or None when the item does not
        sample this step: one row for a plain step, 1 + len(tree) rows (root, then each node) for a
        step carrying a draft.
        """
        drafts = drafts or {}
        items: list[ForwardItem] = []
        for i, sched in enumerate(batch):
            seq = sched.seq
            start = seq.num_computed_tokens
            tree = drafts.get(i)
            if tree is not None and len(tree) > 0:
                root = seq.token_slice(start, start + 1)
                items.append(ForwardItem(
                    seq.block_table, start, root + list(tree.tokens),
                    positions=[start] + [start + d for d in tree.depths()],
                    mask=tree.ancestor_mask(), logits="all",
                ))
            else:
                items.append(ForwardItem(
                    seq.block_table, start, seq.token_slice(start, start + sched.num_new_tokens),
                    logits="last" if sched.samples else "none",
                ))
        return self.run(items)

    @torch.inference_mode()
    def run(
        self, items: list[ForwardItem], num_layers: int | None = None
    ) -> tuple[torch.Tensor, list[tuple[int, int] | None]]:
        """Forward `items` through the model (or its first `num_layers` layers, as a self-drafter);
        returns logits for the requested rows and each item's (first row, count) or None."""
        input_ids, positions, slots, logit_idx, rows = self._flatten(items)
        meta = AttentionMetadata(slot_mapping=slots, groups=self._groups(items))
        hidden = self.model(input_ids, positions, self.kv_cache, meta, num_layers=num_layers)
        return self.model.compute_logits(hidden[logit_idx]), rows

    def copy_slots(self, block_table: list[int], moves: list[tuple[int, int]]) -> None:
        """Copy K/V between logical slots of one request, in every layer: (src, dst) pairs."""
        if not moves:
            return
        bs = self.block_size
        src = torch.tensor([block_table[s // bs] * bs + s % bs for s, _ in moves], device=self.device)
        dst = torch.tensor([block_table[d // bs] * bs + d % bs for _, d in moves], device=self.device)
        for k_cache, v_cache in self.kv_cache:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst] = flat[src]

    def _flatten(self, items: list[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int] | None]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_idx: list[int] = []
        rows: list[tuple[int, int] | None] = []
        for item in items:
            offset = len(ids)
            n = len(item.tokens)
            ids.extend(item.tokens)
            pos.extend(item.positions if item.positions is not None else range(item.start, item.start + n))
            table = item.block_table
            for p in range(item.start, item.start + n):
                slots.append(table[p // bs] * bs + p % bs)
            if item.logits == "all":
                rows.append((len(logit_idx), n))
                logit_idx.extend(range(offset, offset + n))
            elif item.logits == "last":
                rows.append((len(logit_idx), 1))
                logit_idx.append(offset + n - 1)
            else:
                rows.append(None)
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            torch.tensor(logit_idx, dtype=torch.long, device=dev),
            rows,
        )

    def _groups(self, items: list[ForwardItem]) -> tuple[AttentionGroup, ...]:
        groups: list[AttentionGroup] = []
        small: list[tuple[int, ForwardItem]] = []
        offset = 0
        for item in items:
            n = len(item.tokens)
            if item.start == 0 and item.mask is None:
                groups.append(AttentionGroup(causal_range=(offset, offset + n)))
            elif n <= SMALL_QUERY:
                small.append((offset, item))
            else:
                groups.append(self._padded_group([(offset, item)]))
            offset += n
        if small:
            groups.append(self._padded_group(small))
        return tuple(groups)

    def _padded_group(self, items: list[tuple[int, ForwardItem]]) -> AttentionGroup:
        """Requests with cached context: each new token sees the cached prefix and, among the new
        tokens, those its mask allows (causal by default)."""
        bs = self.block_size
        dev = self.device
        n_new_list = [len(it.tokens) for _, it in items]
        ctx_lens = [it.start + len(it.tokens) for _, it in items]
        n_blocks = [-(-c // bs) for c in ctx_lens]
        nb = max(n_blocks)
        tables = [it.block_table[:k] + [0] * (nb - k) for (_, it), k in zip(items, n_blocks)]
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
        # Query j of a row sits at logical slot ctx - n_new + j and sees keys at slots <= its own.
        q_slot = (ctx - n_new)[:, None] + arange_q[None, :]
        mask = arange_kv[None, None, :] <= q_slot[:, :, None]
        for row, (_, item) in enumerate(items):
            if item.mask is not None:  # a tree: among the new tokens, ancestors only
                n, start = len(item.tokens), item.start
                mask[row, :n, start : start + n] = item.mask
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
