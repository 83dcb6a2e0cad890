"""Request state: tokens, how many have KV, block table, sampling params, counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.outputs import DraftCounters, TokenLogprob
from specserve.sampling_params import SamplingParams
from specserve.structured import TokenGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_total_len: int  # prompt + max_tokens, capped by the model's context
    grammar: TokenGrammar | None = None  # structured outputs: where the output is in its grammar

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks registered so far
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1, 2, ... (when asked)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    speculation: DraftCounters = field(default_factory=DraftCounters)
    _prompt_tuple: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def prompt_tuple(self) -> tuple[int, ...]:
        """The prompt as a tuple, made once (the prompt never changes; drafters' views take it every step)."""
        if self._prompt_tuple is None:
            self._prompt_tuple = tuple(self.prompt_token_ids)
        return self._prompt_tuple

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt token's logprob is still to compute."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
