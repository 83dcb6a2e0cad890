"""`LLMEngine`: the engine core with input and output processing around it, in one thread.

    prompt -> PromptEncoder (token ids) -> EngineCore (token deltas) -> OutputProcessor (RequestOutput)

The core (engine/core.py) takes token ids and sampling parameters and gives token deltas; this
wrapper tokenizes text prompts before it and turns its deltas into text and outputs after it,
aborting in the core a request a stop string ended. The offline `LLM` and the server's engine
thread use it; its attributes (scheduler, blocks, runner, speculator, ...) are the core's.
"""

from __future__ import annotations

import itertools
from typing import Any

from specserve.config import EngineConfig
from specserve.engine.core import EngineCore, EngineStats
from specserve.engine.drafting import DraftBuilder
from specserve.engine.output_processor import OutputProcessor
from specserve.errors import InvalidRequestError
from specserve.model.llama import LlamaForCausalLM
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.speculation.config import SpeculativeConfig
from specserve.speculation.speculator import SpeculationStats
from specserve.structured import GrammarCompiler

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        tokenizer: Any | None,
        spec: SpeculativeConfig | None = None,
        draft_builder: DraftBuilder | None = None,
    ) -> None:
        """draft_builder: loads a draft model by name (for the draft-model drafter)."""
        self.core = EngineCore(config, model, tokenizer, spec, draft_builder)
        self.outputs = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request. Raises InvalidRequestError naming the bad field."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.outputs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        # text is tokenized here; the core checks the ids (once)
        ids = self.core.inputs.encoder.prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self.core.add_request(request_id, ids, params)
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                         self.core.inputs.eos_for(params))
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self.outputs.drop(request_id)

    def step(self) -> list[RequestOutput]:
        """One core step (see EngineCore.step), its deltas as outputs."""
        outputs, stopped = self.outputs.process(self.core.step())
        for request_id in stopped:  # a stop string ended it: the core stops computing it
            self.core.abort_request(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, exactly as a text prompt is tokenized for generation."""
        return self.core.inputs.encoder.tokenize(text)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def speculation_stats(self) -> SpeculationStats:
        return self.core.speculation_stats()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        return self.core.grammar_compiler

    # the core's parts, for callers and tests that read them
    config = property(lambda self: self.core.config)
    model = property(lambda self: self.core.model)
    tokenizer = property(lambda self: self.core.tokenizer)
    device = property(lambda self: self.core.device)
    speculative_config = property(lambda self: self.core.speculative_config)
    blocks = property(lambda self: self.core.blocks)
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    speculator = property(lambda self: self.core.speculator)
    draft_totals = property(lambda self: self.core.draft_totals)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
