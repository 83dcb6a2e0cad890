"""One record per step: a row per scheduled sequence, filled by each stage in turn.

    schedule -> ScheduledSeq        (sequence, new tokens, draft budget)
    propose  -> tree                (the draft verified with it, if any)
    forward  -> logits, hidden      (its logits rows and where its tokens' hidden states start)
    verify   -> verdict             (accepted nodes and tokens, or its error)

Stages read and fill rows instead of passing dicts keyed by batch index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledSeq
from specserve.engine.sequence import Sequence
from specserve.speculation.tree import DraftTree
from specserve.speculation.verifier import Verdict


@dataclass(eq=False, slots=True)
class StepRow:
    item: ScheduledSeq
    tree: DraftTree | None = None
    logits: tuple[int, int] | None = None  # (first row, count) of its logits; None: it samples nothing
    hidden_offset: int = 0  # where its tokens' hidden states start in the step's all-hidden tensor
    verdict: Verdict | None = None
    scored: bool = False  # its chunk's prompt logprobs were computed

    @property
    def seq(self) -> Sequence:
        return self.item.seq

    @property
    def failed(self) -> bool:
        return self.verdict is not None and self.verdict.error is not None

    def committed_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states of the tokens this step commits: a chunk's tokens, or the
        root and the accepted nodes of a verified tree."""
        off = self.hidden_offset
        if self.tree is None or self.verdict is None:
            return hidden[off : off + self.item.num_new_tokens]
        return hidden[[off] + [off + 1 + a for a in self.verdict.accepted]]


def step_rows(batch: tuple[ScheduledSeq, ...]) -> list[StepRow]:
    return [StepRow(item) for item in batch]
