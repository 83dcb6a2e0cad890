"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability, the top alternatives (token id, logprob), and the chosen
    token's rank in the distribution (1: the most likely; ties share the better rank)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int = 1


@dataclass
class DraftCounters:
    """Speculation bookkeeping for one request (or, summed, for the engine)."""

    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    steps: int = 0  # verification steps (decode steps that carried a draft)
    accepted_per_position: list[int] = field(default_factory=list)  # [d]: accepted at depth d + 1

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        while len(self.accepted_per_position) < accepted:
            self.accepted_per_position.append(0)
        for d in range(accepted):
            self.accepted_per_position[d] += 1

    def add(self, other: "DraftCounters") -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.steps += other.steps
        while len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.append(0)
        for d, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[d] += n

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_cached_prompt_tokens: int
    num_preemptions: int
    speculation: DraftCounters  # draft tokens proposed/accepted, verification steps, accepted per position

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(frozen=True)
class TokenDelta:
    """What one engine step did for a request, at the engine core's boundary: token ids, no text.

    finish_reason: "stop" (an end-of-sequence token, or the grammar complete), "length", "error",
    or None while it runs; stop strings are text, found by the output processor, which then aborts
    the request in the core."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]  # one per new token when the request asked for logprobs, else empty
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    # with the request's first delta, when it asked for prompt logprobs: one per prompt token, None first
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: everything so far plus what is new since the last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    error: str | None = None  # with finish_reason "error": what went wrong for this request alone
    # prompt_logprobs asked: each prompt token's logprob and top alternatives (None for the first token)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second after the first token (decode speed)."""
        m = self.metrics
        if m.finish_time is None or m.first_token_time is None or len(self.token_ids) < 2:
            return None
        dt = m.finish_time - m.first_token_time
        return (len(self.token_ids) - 1) / dt if dt > 0 else None
