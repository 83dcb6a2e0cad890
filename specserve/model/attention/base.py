"""The attention backend contract.

The model sees flat tensors only. Once per step the model runner describes the forward as an
`AttentionBatch` (per item: where its new tokens sit in the flat batch, how many keys it attends
over, its KV blocks, and a visibility mask among its new tokens when that is not causal, as for
a draft tree). The backend turns that into metadata of its own (`plan`), which every layer then
passes back to `forward`. A backend owns everything about its metadata: layout, padding, which
kernel runs which item.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionBatch:
    """One forward's attention work, per item (a request's slice of the flat batch).

    slot_mapping: [T] cache slot (block * block_size + offset) where each new token's K/V goes
    q_start, q_len: the item's new tokens are flat tokens [q_start, q_start + q_len)
    ctx_len: keys the item attends over, its cached tokens then its new ones (the new tokens are
        keys ctx_len - q_len .. ctx_len - 1)
    block_tables: the item's KV blocks, covering at least ctx_len slots
    masks: per item, None (causal among the new tokens) or a [q_len, q_len] bool tensor: new
        token i sees new token j where True (a draft tree passes its ancestor mask). Every new
        token sees all the item's cached tokens.
    """

    slot_mapping: torch.Tensor
    q_start: tuple[int, ...]
    q_len: tuple[int, ...]
    ctx_len: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    masks: tuple[torch.Tensor | None, ...]
    num_tokens: int
    block_size: int

    @property
    def num_items(self) -> int:
        return len(self.q_len)


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the paged cache and attends. One instance serves every
    layer of a model; `plan` runs once per forward, `forward` once per layer."""

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: {num_kv_heads} does not divide num_heads {num_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def plan(self, batch: AttentionBatch, device: torch.device) -> Any:
        """This backend's metadata for `batch`, built once and reused by every layer."""

    def kernels(self) -> AbstractContextManager[object]:
        """The context every layer's `forward` of one model forward runs in (the runner enters it
        once a forward): a choice among torch's kernels the backend relies on; none by default."""
        return nullcontext()

    def native_metadata(self, meta: Any) -> Any | None:
        """The metadata for csrc/decoder.c's native layer loop, when this backend and this step
        can run there; None otherwise."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """Store k, v at their slots, then attend every new token: [T, H, D]."""


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the new tokens' K/V in the paged cache (the cache's dtype)."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v.to(v_cache.dtype))


@dataclass(frozen=True)
class PlannedAttention:
    """A backend with its metadata for one forward: what every layer calls."""

    backend: AttentionBackend
    meta: Any

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta)

    def native_metadata(self) -> Any | None:
        return self.backend.native_metadata(self.meta)
