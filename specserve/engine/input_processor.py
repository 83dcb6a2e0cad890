"""Input processing: a prompt and its sampling parameters become a `Sequence` ready to schedule.

Text prompts go through the PromptEncoder (the tokenizer side, which a server runs in its own
process and thread, handing the engine token ids); here token ids and lengths are checked against
the model's vocabulary, context and KV cache, and a structured-output grammar is compiled (a
request's seed stays a number: the sampler, verifier and drafters derive their draws from it by
position). Every failure is an InvalidRequestError naming the field. Knows nothing of scheduling or
of other requests.
"""

from __future__ import annotations

import time
from typing import Any

from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence
from specserve.errors import InvalidRequestError
from specserve.sampling_params import SamplingParams
from specserve.structured import GrammarCompiler, TokenGrammar
from specserve.tokenizer import PromptEncoder


class InputProcessor:
    def __init__(self, tokenizer: Any | None, vocab_size: int, max_model_len: int, blocks: BlockManager,
                 eos_token_ids: frozenset[int]) -> None:
        """blocks: the KV cache, to check that a request fits in it."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.encoder = PromptEncoder(tokenizer, vocab_size)
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self._grammars: GrammarCompiler | None = None  # built on the first structured request

    def sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """The request as a sequence; InvalidRequestError naming the field when it cannot run."""
        ids = self.encoder.prompt(prompt_token_ids)  # checked against the vocabulary
        limit = self.max_model_len
        if len(ids) > limit or (len(ids) == limit and params.max_tokens > 0):
            raise InvalidRequestError(
                "prompt", f"{len(ids)} tokens leave no room to generate within the context of {limit} tokens"
            )
        max_total = min(len(ids) + params.max_tokens, limit)
        if self.blocks.blocks_needed(max_total) > self.blocks.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens = {max_total} tokens need more KV blocks than the cache holds "
                f"({self.blocks.num_blocks} x {self.blocks.block_size} tokens)",
            )
        too_big = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if too_big:
            raise InvalidRequestError("logit_bias", f"token id {too_big[0]} is not in the model's vocabulary "
                                                    f"(ids 0..{self.vocab_size - 1})")
        grammar = self._grammar(params)
        return Sequence(request_id=request_id, prompt_token_ids=ids, params=params, arrival_time=time.perf_counter(),
                        max_total_len=max_total, grammar=grammar)

    def eos_for(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a request: its stop_token_ids, and the model's unless ignore_eos."""
        stops = frozenset(params.stop_token_ids)
        return stops if params.ignore_eos else stops | self.eos_token_ids

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model's tokenizer (built when first asked)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured_outputs", "this model has no tokenizer to constrain")
            self._grammars = GrammarCompiler.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _grammar(self, params: SamplingParams) -> TokenGrammar | None:
        """The request's structured-output grammar at its start; InvalidRequestError naming the field
        when the schema, regex or grammar is not one."""
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler.compile(params.structured_outputs)
