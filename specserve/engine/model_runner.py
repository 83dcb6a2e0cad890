"""Turns a scheduled batch into flat tensors, runs the model, returns logits to sample from."""

from __future__ import annotations

import itertools
import math
import mmap

import torch

from specserve.engine.scheduler import ScheduledSeq
from specserve.model.attention.base import AttentionBackend, AttentionBatch, PlannedAttention
from specserve.model.forward import ForwardItem, ForwardOutput
from specserve.model.llama import KVCache, LlamaForCausalLM
from specserve.speculation.tree import DraftTree

__all__ = ["ForwardItem", "ForwardOutput", "ModelRunner", "allocate_kv_cache", "kv_bytes_per_block"]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost memory only where written: on the CPU an anonymous mapping, whose pages the
    kernel hands out zero-filled on first touch (torch.zeros would touch all of them now)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """Per layer (K, V) [num_blocks, block_size, KVH, D]; a block's memory is committed when first
    written, so a large cache costs what the requests use."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(cfg.num_layers)]


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device,
        attention: AttentionBackend,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.attention = attention

    def execute(
        self, batch: tuple[ScheduledSeq, ...], drafts: dict[int, DraftTree] | None = None, all_hidden: bool = False,
        feature_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run one forward over a scheduled batch, with draft trees for some decodes.

        drafts maps an index into `batch` to that request's draft tree. Returns float32 logits, the
        hidden states they came from, and per batch item (first row, number of rows) into them, or
        None when the item does not sample this step: one row for a plain step, 1 + len(tree) rows
        (root, then each node) for a step carrying a draft, one per token for a prefill chunk whose
        prompt logprobs are asked (`ScheduledSeq.prompt_logprobs`). `all_hidden`: also every new token's
        hidden state (for drafters that learn from them), after those of `feature_layers` (`run`).
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
                    logits="all" if sched.prompt_logprobs else "last" if sched.samples else "none",
                ))
        return self.run(items, all_hidden=all_hidden, feature_layers=feature_layers)

    @torch.inference_mode()
    def run(self, items: list[ForwardItem], num_layers: int | None = None, all_hidden: bool = False,
            feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Forward `items` through the model (or its first `num_layers` layers, as a self-drafter);
        returns logits and hidden states for the requested rows and each item's (first row, count)
        or None. With `all_hidden`, every new token's final-normed hidden state as well, preceded
        (columns) by the normed residual stream after each of `feature_layers` layers:
        [T, (len(feature_layers) + 1) * hidden]."""
        input_ids, positions, slots, logit_idx, rows = self._flatten(items)
        attn = PlannedAttention(self.attention, self.attention.plan(self._attention_batch(items, slots), self.device))
        with self.attention.kernels():
            every, features = self.model.forward_features(input_ids, positions, self.kv_cache, attn,
                                                          num_layers=num_layers, feature_layers=feature_layers)
        hidden = every[logit_idx]
        if not all_hidden:
            return ForwardOutput(self.model.compute_logits(hidden), hidden, rows)
        offsets = tuple(itertools.accumulate((len(it.tokens) for it in items[:-1]), initial=0))
        every = torch.cat((*features, every), dim=-1) if features else every
        return ForwardOutput(self.model.compute_logits(hidden), hidden, rows, every, offsets)

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

    def _attention_batch(self, items: list[ForwardItem], slots: torch.Tensor) -> AttentionBatch:
        q_start, q_len, ctx_len = [], [], []
        offset = 0
        for item in items:
            n = len(item.tokens)
            q_start.append(offset)
            q_len.append(n)
            ctx_len.append(item.start + n)
            offset += n
        return AttentionBatch(
            slot_mapping=slots, q_start=tuple(q_start), q_len=tuple(q_len), ctx_len=tuple(ctx_len),
            block_tables=tuple(tuple(item.block_table) for item in items),
            masks=tuple(item.mask for item in items), num_tokens=offset, block_size=self.block_size,
        )
