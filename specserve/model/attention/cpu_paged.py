"""Paged attention on the CPU that reads K/V blocks in place (csrc/paged_attention.c).

Decodes, draft trees, prefill chunks and fresh prompts all go to one native call per layer,
after the new K/V are written. A query row's result depends only on its own keys, visited a
cache block at a time in position order: the same whether its keys arrived in this step or an
earlier one, and whatever else is in the batch (SDPA on a fresh prompt's new K/V would be
another order of sums, and chunking or preemption would then change a sequence's numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.model import cpu_ops, ops
from specserve.model.attention.base import AttentionBackend, AttentionBatch, write_kv

@dataclass(frozen=True)
class PagedMetadata:
    slot_mapping: torch.Tensor
    n_items: int  # items for the native kernel
    q_start: torch.Tensor  # int32 [n_items]
    q_len: torch.Tensor
    ctx_len: torch.Tensor
    tables: torch.Tensor  # int32, the items' block tables back to back
    table_off: torch.Tensor  # int32 [n_items]
    masks: torch.Tensor  # uint8, the tree masks back to back
    mask_off: torch.Tensor  # int64 [n_items], -1 = causal
    lanes: int = 0  # the kernel's vector width (0: the widest compiled; 8: eight lanes), the backend's


class CpuPagedBackend(AttentionBackend):
    name = "cpu-paged"
    KV_DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, lanes: int = 0) -> None:
        """lanes: 0, the kernel's widest task for this head dim; 8, its eight-lane one (which is
        faster on a machine is measured: specserve.model.tuning.attention_lanes)."""
        super().__init__(num_heads, num_kv_heads, head_dim)
        if lanes not in (0, 8):
            raise ValueError(f"lanes: must be 0 (the widest) or 8, got {lanes}")
        ops.load()
        self._isa = ops.layer_isa()
        self.lanes = lanes

    def plan(self, batch: AttentionBatch, device: torch.device) -> PagedMetadata:
        q_start, q_len, ctx_len, table_off, mask_off = [], [], [], [], []
        tables: list[int] = []
        masks: list[torch.Tensor] = []
        mask_pos = 0
        bs = batch.block_size
        for i in range(batch.num_items):
            n, ctx, mask = batch.q_len[i], batch.ctx_len[i], batch.masks[i]
            q_start.append(batch.q_start[i])
            q_len.append(n)
            ctx_len.append(ctx)
            table_off.append(len(tables))
            tables.extend(batch.block_tables[i][: -(-ctx // bs)])
            if mask is None:
                mask_off.append(-1)
            else:
                mask_off.append(mask_pos)
                masks.append(mask.reshape(-1).to(torch.uint8))
                mask_pos += n * n

        def i32(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32)

        return PagedMetadata(
            slot_mapping=batch.slot_mapping, n_items=len(q_len), q_start=i32(q_start), q_len=i32(q_len),
            ctx_len=i32(ctx_len), tables=i32(tables), table_off=i32(table_off),
            masks=torch.cat(masks) if masks else torch.zeros(1, dtype=torch.uint8),
            mask_off=torch.tensor(mask_off, dtype=torch.int64), lanes=self.lanes,
        )

    def native_metadata(self, meta: PagedMetadata) -> PagedMetadata | None:
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedMetadata,
    ) -> torch.Tensor:
        if k_cache.dtype not in self.KV_DTYPES:
            raise TypeError(f"attention backend {self.name}: no kernel for a {k_cache.dtype} KV cache")
        if cpu_ops.fits(k, v) and k.stride(0) == v.stride(0) and k.stride(1) == k.shape[2] == v.stride(1):
            cpu_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        q32 = q if q.dtype == torch.float32 and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] else (
            q.float().contiguous())
        out = torch.ops.specserve.paged_attention(
            q32, k_cache, v_cache, meta.q_start, meta.q_len, meta.ctx_len, meta.tables, meta.table_off, meta.masks,
            meta.mask_off, self.scale, self._isa, self.lanes)
        return out if q.dtype == torch.float32 else out.to(q.dtype)
