"""What one forward over a flat batch takes and gives back: the runner's and the drafters'
common language (model-level: token ids, positions, KV places, masks; no requests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ForwardOutput:
    """What one forward gives back.

    logits: [R, vocab] float32 for the rows asked for
    hidden: [R, hidden] the final-normed hidden states of those rows (what the LM head reads; a
        learned drafter drafts from them)
    rows: per item, (first row, number of rows) into both, or None when the item asked for none
    all_hidden: [T, hidden] the final-normed hidden states of every new token, when asked for
        (preceded by those of the feature layers asked for: [T, (layers + 1) * hidden])
    offsets: per item, its first token's row in `all_hidden`
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    rows: list[tuple[int, int] | None]
    all_hidden: torch.Tensor | None = None
    offsets: tuple[int, ...] = ()

    def __iter__(self):  # logits, rows = runner.run(...)
        return iter((self.logits, self.rows))


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


class Forward(Protocol):
    """Runs `items` through a model (or its first `num_layers` layers)."""

    def __call__(self, items: list[ForwardItem], num_layers: int | None = None) -> ForwardOutput: ...
