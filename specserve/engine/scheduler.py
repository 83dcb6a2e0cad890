"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Each step: running requests first, in arrival order (decodes take one token,
a request still in prefill takes its next chunk), then waiting requests are
admitted first come, first served while the budget, `max_num_seqs` and the
KV blocks allow. Prefill chunks thus ride along with the running decodes
(Sarathi-Serve). When a running request needs a block and none is free, the
most recently admitted request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed later (prefix caching often
finds its blocks still there).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from specserve.config import SchedulerConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    draft_budget: int = 0  # draft nodes reserved (token budget and KV slots) for this decode

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so the next token is sampled (never for
        a request with max_tokens 0, which only computes its prompt)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens and self.seq.params.max_tokens > 0

    @property
    def prompt_logprobs(self) -> bool:
        """Whether this step computes prompt tokens whose logprobs the request still needs (then
        every token of the chunk gets logits)."""
        return self.draft_budget == 0 and self.seq.wants_prompt_logprobs

    @property
    def completes_prompt_only(self) -> bool:
        """Whether this step ends a max_tokens-0 request's prompt: it finishes without a token."""
        return self.seq.params.max_tokens == 0 and self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]


def no_speculation(seq: Sequence) -> int:
    return 0


class Scheduler:
    """`draft_budget(seq)` says how many draft nodes a decoding request may get this step (the
    controller's grant); the scheduler trims it to the token budget and to free KV blocks, and
    never preempts anyone to make room for speculation."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        draft_budget: Callable[[Sequence], int] = no_speculation,
        scoring_prefix: Callable[[Sequence, list[int]], list[int]] = lambda seq, cached: [],
        admitting_max_decodes: int = 1 << 30,
    ) -> None:
        """scoring_prefix(seq, cached): of the cached blocks found for a request that asks for
        prompt logprobs, those it may use (cached K/V has no logits; by default none).
        admitting_max_decodes: while requests wait to be admitted and at least this many are
        scheduled, no draft slots at all (the engine passes `Speculator.LATENCY_ROWS`: at that size
        drafts stay only where they slow nobody, which the guard cannot know of a shape it has not
        judged yet; 48 ShareGPT requests at once on the bundled model, the p99 TPOT, a 14-token
        request living only through the admission steps, was 1.23, 1.17, 1.06, 0.94 of plain's by
        round with drafts there, 0.96 and 1.03 without; BENCHMARKS.md, session 37)."""
        self.config = config
        self.admitting_max_decodes = admitting_max_decodes
        self.blocks = block_manager
        self.draft_budget = draft_budget
        self.scoring_prefix = scoring_prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            while not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # preempted itself: nothing after it is running either
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # Drafts only from what is left once every running request has its own tokens and blocks.
        scheduled, budget = self._grant_drafts(scheduled, budget)

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq.token_ids())
            if seq.wants_prompt_logprobs:  # prompt logprobs need every prompt token's logits
                cached = self.scoring_prefix(seq, cached)
            computed = len(cached) * self.blocks.block_size
            n = self._chunk(seq.num_tokens - computed, budget)
            if n == 0 or not self.blocks.can_admit(cached, computed + n):
                break
            self.waiting.popleft()
            first_admission = seq.num_preemptions == 0
            self.blocks.admit(seq, cached)
            if first_admission:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            allocated = self.blocks.allocate(seq, computed + n)
            assert allocated
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _grant_drafts(self, scheduled: list[ScheduledSeq], budget: int) -> tuple[list[ScheduledSeq], int]:
        """Give decoding requests draft slots from the token budget and free blocks left over. While
        requests wait to be admitted, drafts take at most half the budget left: they are granted
        before admission, and at 256 tokens a step 48 decodes' drafts left the waiting prompts so
        little that one waited 10.5 s for its first token (BENCHMARKS.md, session 31); with
        `admitting_max_decodes` or more scheduled, none."""
        out: list[ScheduledSeq] = []
        admitting = bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        room = budget // 2 if admitting else budget  # draft tokens this step, at most
        if admitting and len(scheduled) >= self.admitting_max_decodes:
            room = 0
        budget -= room
        for item in scheduled:
            seq = item.seq
            spec = 0
            if item.num_new_tokens == 1 and seq.output_token_ids and room > 0:
                slots = (len(seq.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size
                spec = max(0, min(self.draft_budget(seq), room, slots - seq.num_computed_tokens - 1))
                if spec > 0:
                    allocated = self.blocks.allocate(seq, seq.num_computed_tokens + 1 + spec)
                    assert allocated
            out.append(ScheduledSeq(seq, item.num_new_tokens, spec) if spec else item)
            room -= spec
        return out, budget + room

    def _chunk(self, remaining: int, budget: int) -> int:
        """How many of `remaining` tokens to compute within `budget`."""
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill or budget == self.config.max_num_batched_tokens:
            # Without chunked prefill a long prefill still runs, alone, in budget-sized pieces.
            return budget
        return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished (or aborted) and release its blocks. Safe to call once per sequence."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
