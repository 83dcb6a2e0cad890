"""The engine: requests in, one step at a time, outputs out.

    schedule -> propose -> forward -> verify (accept) -> commit -> emit -> observe

Everything speculative (which drafter, how many nodes, verification, learning from the
outcome) is behind one `Speculator`; with speculation off it only samples.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ModelRunner, allocate_kv_cache, kv_bytes_per_block
from specserve.engine.drafting import DraftBuilder, build_speculator
from specserve.engine.scheduler import ScheduledSeq, Scheduler
from specserve.engine.sequence import Sequence
from specserve.errors import InvalidRequestError
from specserve.model.attention import make_backend
from specserve.model.llama import LlamaForCausalLM
from specserve.outputs import DraftCounters, RequestMetrics, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.speculation.config import SpeculativeConfig
from specserve.speculation.controller import StepShape
from specserve.speculation.drafter import DraftRequest, RequestView
from specserve.speculation.speculator import Decode, SampleItem, SpeculationStats, Speculator
from specserve.speculation.tree import DraftTree
from specserve.speculation.verifier import Verdict
from specserve.structured import GrammarCompiler, TokenGrammar
from specserve.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("specserve.engine")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def _shape(batch: tuple[ScheduledSeq, ...]) -> StepShape:
    """The step's shape before drafts: its tokens and the context they attend to."""
    tokens = sum(it.num_new_tokens for it in batch)
    attended = sum(it.num_new_tokens * (it.seq.num_computed_tokens + it.num_new_tokens) for it in batch)
    return StepShape(tokens, 0, attended)


def _view(seq: Sequence) -> RequestView:
    return RequestView(seq.request_id, tuple(seq.prompt_token_ids), tuple(seq.output_token_ids), seq.params)


@dataclass(eq=False)
class _Request:
    """A sequence plus what emitting its text needs."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    eos_ids: frozenset[int]
    text: str = ""
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    holdback: int = 0  # characters kept back while a stop string may be forming


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
        self.config = config
        self.speculative_config = spec or SpeculativeConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        cache = config.cache
        kv_dtype = cache.dtype or config.dtype
        num_blocks = cache.num_blocks or max(
            1, cache.kv_cache_bytes // kv_bytes_per_block(model, cache.block_size, kv_dtype)
        )
        self.blocks = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        kv = allocate_kv_cache(model, num_blocks, cache.block_size, kv_dtype, self.device)
        cfg = model.config
        attention = make_backend(config.attention_backend, self.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 kv_dtype)
        self.runner = ModelRunner(model, kv, cache.block_size, self.device, attention)
        self.speculator: Speculator = build_speculator(self.speculative_config, config, self.runner, tokenizer,
                                                       draft_builder)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self._draft_cap)
        self.draft_totals = DraftCounters()
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built on the first structured request

    # -- public API ------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request. Raises InvalidRequestError naming the bad field."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if len(ids) >= limit:
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
        grammar = self._grammar(params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_time=time.perf_counter(),
            max_total_len=max_total,
            generator=generator,
            prompt=text,
            grammar=grammar,
        )
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self._requests[request_id] = _Request(seq, detok, self._eos_for(params), holdback=holdback)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self._drafter_finish(req.seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, propose, verify (one forward), accept, commit, emit.

        A request whose numbers go wrong (a distribution that is not one) or whose own bookkeeping
        fails ends alone with finish_reason "error"; the rest of the batch goes on. Speculation's
        failures cost drafts, never requests. Only a failure of the shared forward pass raises
        (and then no request has committed anything).
        """
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return []
        try:
            return self._step(batch.scheduled)
        finally:  # also when the forward raised: the speculator closes the step either way
            self.speculator.observe(time.perf_counter() - start)

    def _step(self, batch: tuple[ScheduledSeq, ...]) -> list[RequestOutput]:
        decodes = self._decodes(batch)
        drafts = self.speculator.propose(decodes, _shape(batch), sum(it.samples for it in batch))
        out = self.runner.execute(batch, drafts, all_hidden=self.speculator.wants_hidden)
        items = [SampleItem(i, batch[i].seq, r) for i, r in enumerate(out.rows) if r is not None]
        verdicts = self.speculator.verify(items, drafts, out.logits)
        if out.all_hidden is not None:
            self.speculator.features(self._committed_hidden(batch, drafts, verdicts, out.all_hidden, out.offsets))
        outputs = []
        for i, item in enumerate(batch):
            req = self._requests[item.seq.request_id]
            verdict = verdicts.get(i)
            if verdict is not None and verdict.error is not None:
                outputs.append(self._fail(req, verdict.error))
                continue
            try:
                self._commit(item, drafts.get(i), verdict)
                if verdict is not None:
                    outputs.append(self._emit(req, verdict))
                if not item.seq.is_finished:
                    self.blocks.register_full_blocks(item.seq)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                logger.exception("request %s failed in its commit or emit", item.seq.request_id)
                outputs.append(self._fail(req, f"internal error: {type(e).__name__}: {e}"))
        return outputs

    @staticmethod
    def _committed_hidden(
        batch: tuple[ScheduledSeq, ...], drafts: dict[int, DraftTree], verdicts: dict[int, Verdict],
        hidden: torch.Tensor, offsets: tuple[int, ...],
    ) -> list[tuple[str, int, torch.Tensor]]:
        """Per request, the target's hidden states of the tokens this step commits (before the
        commit): a chunk's tokens, or the root and the accepted nodes of a verified tree."""
        out = []
        for i, item in enumerate(batch):
            verdict = verdicts.get(i)
            if verdict is not None and verdict.error is not None:
                continue
            seq, off = item.seq, offsets[i]
            tree = drafts.get(i)
            if tree is None or verdict is None:
                rows = hidden[off : off + item.num_new_tokens]
            else:
                rows = hidden[[off] + [off + 1 + a for a in verdict.accepted]]
            out.append((seq.request_id, seq.num_computed_tokens, rows))
        return out

    def _draft_cap(self, seq: Sequence) -> int:
        """The most draft nodes `seq` may be given this step (the scheduler reserves room for them)."""
        left = min(seq.max_total_len - seq.num_tokens, seq.params.max_tokens - len(seq.output_token_ids))
        return self.speculator.cap(left)

    @staticmethod
    def _decodes(batch: tuple[ScheduledSeq, ...]) -> list[Decode]:
        """The batch items with room reserved for drafts, as their drafters may see them."""
        return [
            Decode(i, DraftRequest(_view(item.seq), item.draft_budget, tuple(item.seq.block_table),
                                   item.seq.num_computed_tokens, item.seq.generator), item.seq.grammar)
            for i, item in enumerate(batch) if item.draft_budget > 0
        ]

    def _commit(self, item: ScheduledSeq, tree: DraftTree | None, verdict: Verdict | None) -> None:
        """Make the computed (and accepted) tokens' K/V part of the sequence; release rejected slots."""
        seq = item.seq
        start = seq.num_computed_tokens
        if tree is None or verdict is None:
            seq.num_computed_tokens += item.num_new_tokens
        else:
            depths_slots = [(start + 1 + node, start + 1 + d) for d, node in enumerate(verdict.accepted)]
            self.runner.copy_slots(seq.block_table, [(s, d) for s, d in depths_slots if s != d])
            seq.num_computed_tokens += 1 + len(verdict.accepted)
            seq.speculation.record(len(tree), len(verdict.accepted))
            self.draft_totals.record(len(tree), len(verdict.accepted))
        if item.draft_budget > 0:  # slots reserved for drafts beyond what the sequence now holds
            self.blocks.trim(seq, seq.num_tokens + (len(verdict.tokens) if verdict else 0))

    def speculation_stats(self) -> SpeculationStats:
        """The controller's record: grants, predicted vs realised acceptance, cost-model error."""
        return self.speculator.stats()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, exactly as a text prompt is tokenized for generation."""
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer; pass token ids instead")
        return list(self.tokenizer(text).input_ids)

    def check_token_ids(self, ids: list[int], field: str = "prompt") -> None:
        """Raise InvalidRequestError naming `field` unless every id is in the vocabulary."""
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(field, f"token ids must be integers in [0, {vocab})")

    # -- internals -------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            ids = self.tokenize(prompt)
            if not ids:
                raise InvalidRequestError("prompt", "tokenizes to zero tokens")
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        self.check_token_ids(ids)
        return None, ids

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model's tokenizer (built when first asked)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured_outputs", "this model has no tokenizer to constrain")
            self._grammars = GrammarCompiler.from_hf(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def _grammar(self, params: SamplingParams) -> TokenGrammar | None:
        """The request's structured-output grammar at its start; InvalidRequestError naming the field
        when the schema, regex or grammar is not one."""
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler.compile(params.structured_outputs)

    def _eos_for(self, params: SamplingParams) -> frozenset[int]:
        stops = frozenset(params.stop_token_ids)
        return stops if params.ignore_eos else stops | self.eos_token_ids

    def _emit(self, req: _Request, verdict: Verdict) -> RequestOutput:
        """Append the step's tokens one by one, stopping at the first stop condition."""
        seq = req.seq
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = None
        for token, logprob in zip(verdict.tokens, verdict.logprobs):
            if seq.grammar is not None and not seq.grammar.accept(token):
                raise RuntimeError(f"token {token} is not allowed by the request's grammar")
            seq.output_token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            reason = self._check_stop(req, token)
            if reason is not None:
                break
        if reason is not None:
            if req.detok is not None and reason == "length":
                req.text += req.detok.flush()
            seq.finish_time = now
            self.scheduler.finish(seq, reason)
            del self._requests[seq.request_id]
            self._drafter_finish(seq)
        visible = len(req.text) if seq.is_finished else max(req.emitted_text_len, len(req.text) - req.holdback)
        new_text = req.text[req.emitted_text_len : visible]
        req.emitted_text_len = visible
        new_ids = seq.output_token_ids[req.emitted_tokens :]
        req.emitted_tokens = len(seq.output_token_ids)
        return self._output(req, new_text, new_ids, req.text[:visible])

    @staticmethod
    def _output(req: _Request, new_text: str, new_ids: list[int], text: str, error: str | None = None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=list(seq.output_token_ids),
            new_text=new_text,
            new_token_ids=new_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            error=error,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_token_time=seq.first_token_time,
                finish_time=seq.finish_time,
                num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
                num_preemptions=seq.num_preemptions,
                speculation=replace(seq.speculation, accepted_per_position=list(seq.speculation.accepted_per_position)),
            ),
        )

    def _fail(self, req: _Request, error: str) -> RequestOutput:
        """End `req` alone with finish_reason "error": its blocks are freed, the batch goes on."""
        seq = req.seq
        logger.warning("request %s ended with an error: %s", seq.request_id, error)
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"  # also when the failure came after its last token was emitted
        self._requests.pop(seq.request_id, None)
        self._drafter_finish(seq)
        return self._output(req, new_text="", new_ids=[], text=req.text[: req.emitted_text_len], error=error)

    def _drafter_finish(self, seq: Sequence) -> None:
        self.speculator.finish(seq.request_id, _view(seq))

    def _check_stop(self, req: _Request, token: int) -> str | None:
        """Append the token's text and say why the request should finish, if it should."""
        seq = req.seq
        if token in req.eos_ids:
            return "stop"
        if req.detok is not None:
            before = len(req.text)
            req.text += req.detok.add([token])
            stop = seq.params.stop
            if stop and len(req.text) > before:
                start = max(0, before - max(len(s) for s in stop) + 1)
                hits = [(i, s) for s in stop if (i := req.text.find(s, start)) >= 0]
                if hits:
                    idx, s = min(hits)
                    req.text = req.text[: idx + (len(s) if seq.params.include_stop_str_in_output else 0)]
                    return "stop"
        if seq.grammar is not None and seq.grammar.done:  # complete: only the end of sequence may follow
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_total_len:
            return "length"
        return None
