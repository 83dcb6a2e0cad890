"""How many draft tokens each request gets this step."""

from __future__ import annotations

from specserve.engine.sequence import Sequence


class FixedController:
    """A fixed budget of K draft tokens per decoding request, never past the request's end.

    The scheduler trims the grant further to its token budget and to free KV blocks.
    """

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def __call__(self, seq: Sequence) -> int:
        # The bonus token always comes on top of the drafts, so the request can take at most
        # (tokens left) - 1 drafts; positions must also stay inside the context.
        left = seq.max_total_len - seq.num_tokens
        return max(0, min(self.num_tokens, left - 1, seq.params.max_tokens - len(seq.output_token_ids) - 1))
