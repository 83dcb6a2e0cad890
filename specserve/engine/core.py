"""The engine core: token ids and sampling parameters in, token deltas out, one step at a time.

    schedule -> propose -> forward -> verify (accept) -> commit -> emit -> observe

A step's data is one record (engine/step.py: a row per scheduled sequence). Everything speculative
(which drafter, how many nodes, verification, learning from the outcome) is behind one
`Speculator`; with speculation off it only samples. The input processor checks a request and
makes its sequence; a step's accepted tokens leave as `TokenDelta`s, ending a request at a
token-level stop (end-of-sequence id, grammar complete, length). Text (detokenizing, stop strings,
`RequestOutput`) is the output processor's, around the core (engine/engine.py: LLMEngine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from specserve.config import EngineConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ModelRunner, allocate_kv_cache, kv_bytes_per_block
from specserve.engine.prompt_logprobs import PromptLogprobStore
from specserve.engine.drafting import DraftBuilder, ProbeCache, build_speculator
from specserve.engine.input_processor import InputProcessor
from specserve.engine.scheduler import ScheduledSeq, Scheduler
from specserve.engine.sequence import Sequence
from specserve.engine.step import StepRow, step_rows
from specserve.errors import InvalidRequestError
from specserve.model.attention import make_backend
from specserve.model.llama import LlamaForCausalLM
from specserve.outputs import DraftCounters, RequestMetrics, TokenDelta, TokenLogprob
from specserve.sampling_params import SamplingParams
from specserve.speculation.config import SpeculativeConfig
from specserve.speculation.controller import StepShape
from specserve.speculation.drafter import DraftRequest, RequestView
from specserve.speculation.sampler import token_logprobs
from specserve.speculation.speculator import Decode, SampleItem, SpeculationStats, Speculator
from specserve.structured import GrammarCompiler
from specserve.tokenizer import end_of_generation_ids

logger = logging.getLogger("specserve.engine")
# (request id, position of the first, the target's states [n, width]) of tokens a step committed
StateSink = Callable[[str, int, torch.Tensor], None]
PROMPT_LOGPROB_ROWS = 256  # prompt rows turned into log-probabilities at once (bounds the float32 copy)


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
    return RequestView(seq.request_id, seq.prompt_tuple, tuple(seq.output_token_ids), seq.params)


def request_metrics(seq: Sequence) -> RequestMetrics:
    """A snapshot of the sequence's timings and counters."""
    return RequestMetrics(
        arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time,
        finish_time=seq.finish_time,
        num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
        num_preemptions=seq.num_preemptions,
        speculation=replace(seq.speculation, accepted_per_position=list(seq.speculation.accepted_per_position)),
    )


class EngineCore:
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
                                                       draft_builder, ProbeCache())
        self.prompt_logprob_store = PromptLogprobStore(cache.block_size, num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self._draft_cap, self._scoring_prefix,
                                   admitting_max_decodes=Speculator.LATENCY_ROWS)
        self.draft_totals = DraftCounters()
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        if tokenizer is not None:
            eos |= end_of_generation_ids(tokenizer)
        self.eos_token_ids = frozenset(eos)
        self.inputs = InputProcessor(tokenizer, model.config.vocab_size, config.max_model_len, self.blocks,
                                     self.eos_token_ids)
        self._requests: dict[str, tuple[Sequence, frozenset[int]]] = {}  # running: sequence, its stop ids
        self._state_sink: tuple[tuple[int, ...], StateSink] | None = None

    def record_states(self, sink: StateSink | None, feature_layers: tuple[int, ...] = ()) -> None:
        """From the next step on, hand `sink` the target's states at every token a step commits, as
        hidden-state drafters get them (`Speculator.features`: the last layer's final-normed state,
        after those of `feature_layers`); None stops. What training a head on the model's own
        answers needs, from the forward that generates them. A speculator whose drafter reads other
        layers is an error naming `feature_layers`."""
        layers = tuple(feature_layers)
        if sink is not None and self.speculator.wants_hidden and self.speculator.feature_layers != layers:
            raise ValueError(f"feature_layers: the drafter reads layers {self.speculator.feature_layers}, "
                             f"the recording asks for {layers}")
        self._state_sink = None if sink is None else (layers, sink)

    # -- public API ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check and queue a request. Raises InvalidRequestError naming the bad field."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        seq = self.inputs.sequence(request_id, prompt_token_ids, params)
        self._requests[request_id] = (seq, self.inputs.eos_for(params))
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.scheduler.finish(entry[0], "abort")
            self._drafter_finish(entry[0])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenDelta]:
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

    def _step(self, batch: tuple[ScheduledSeq, ...]) -> list[TokenDelta]:
        rows = step_rows(batch)
        drafts = self.speculator.propose(self._decodes(batch), _shape(batch), sum(it.samples for it in batch),
                                         waiting=len(self.scheduler.waiting))
        sink = self._state_sink
        out = self.runner.execute(batch, drafts, all_hidden=self.speculator.wants_hidden or sink is not None,
                                  feature_layers=sink[0] if sink is not None else self.speculator.feature_layers)
        for i, row in enumerate(rows):
            row.tree, row.logits = drafts.get(i), out.rows[i]
            if row.item.prompt_logprobs:  # every row of the chunk: prompt logprobs, then the last one samples
                first, count = out.rows[i]  # type: ignore[misc]
                self._prompt_logprobs(row.seq, out.logits[first : first + count])
                row.scored = True
                row.logits = (first + count - 1, 1) if row.item.samples else None
            row.hidden_offset = out.offsets[i] if out.offsets else 0
        verdicts = self.speculator.verify(
            [SampleItem(i, row.seq, row.logits) for i, row in enumerate(rows) if row.logits is not None], drafts, out.logits)
        for i, row in enumerate(rows):
            row.verdict = verdicts.get(i)
        if out.all_hidden is not None:  # before the commit moves num_computed_tokens
            committed = [(row.seq.request_id, row.seq.num_computed_tokens, row.committed_hidden(out.all_hidden))
                         for row in rows if not row.failed]
            if self.speculator.wants_hidden:
                self.speculator.features(committed)
            if sink is not None:
                for request_id, start, states in committed:
                    sink[1](request_id, start, states)
        return [output for row in rows if (output := self._finish_row(row)) is not None]

    def _finish_row(self, row: StepRow) -> TokenDelta | None:
        """Commit a row's tokens and emit them; a failure here ends this request alone."""
        if row.failed:
            return self._fail(row.seq, row.verdict.error)  # type: ignore[union-attr]
        try:
            prompt_only = row.item.completes_prompt_only  # before the commit moves num_computed_tokens
            self._commit(row)
            # before the emit: a request that ends in this step still publishes its computed blocks
            self.blocks.register_full_blocks(row.seq)
            if row.scored:  # after the registration: its blocks' hashes are known
                self.prompt_logprob_store.save(row.seq)
            if prompt_only:
                return self._finish_prompt_only(row.seq)
            return self._emit(row) if row.verdict is not None else None
        except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
            logger.exception("request %s failed in its commit or emit", row.seq.request_id)
            return self._fail(row.seq, f"internal error: {type(e).__name__}: {e}")

    def _scoring_prefix(self, seq: Sequence, cached: list[int]) -> list[int]:
        """The cached blocks a request asking for prompt logprobs may use: those whose logprobs are
        stored too (they are written into the sequence, which then computes only the rest)."""
        n, entries = self.prompt_logprob_store.prefix(seq, [self.blocks.hash_of(b) for b in cached])  # type: ignore[misc]
        seq.prompt_logprobs = entries
        return cached[:n]

    def _draft_cap(self, seq: Sequence) -> int:
        """The most draft nodes `seq` may be given this step (the scheduler reserves room for them)."""
        left = min(seq.max_total_len - seq.num_tokens, seq.params.max_tokens - len(seq.output_token_ids))
        return self.speculator.cap(left)

    @staticmethod
    def _decodes(batch: tuple[ScheduledSeq, ...]) -> list[Decode]:
        """The batch items with room reserved for drafts, as their drafters may see them."""
        return [
            Decode(i, DraftRequest(_view(item.seq), item.draft_budget, tuple(item.seq.block_table),
                                   item.seq.num_computed_tokens), item.seq.grammar)
            for i, item in enumerate(batch) if item.draft_budget > 0
        ]

    def _commit(self, row: StepRow) -> None:
        """Make the computed (and accepted) tokens' K/V part of the sequence; release rejected slots."""
        seq, item, tree, verdict = row.seq, row.item, row.tree, row.verdict
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

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model's tokenizer (built when first asked)."""
        return self.inputs.grammar_compiler

    # -- internals -------------------------------------------------------
    def _emit(self, row: StepRow) -> TokenDelta:
        """Append the step's tokens, finishing the request at the first token-level stop."""
        seq, verdict = row.seq, row.verdict
        assert verdict is not None
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        stop_ids = self._requests[seq.request_id][1]
        n_tokens, n_logprobs = len(seq.output_token_ids), len(seq.logprobs)
        reason = None
        for token, logprob in zip(verdict.tokens, verdict.logprobs):
            if seq.grammar is not None and not seq.grammar.accept(token):
                raise RuntimeError(f"token {token} is not allowed by the request's grammar")
            seq.output_token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            reason = _stop_reason(seq, token, stop_ids)
            if reason is not None:
                break
        if reason is not None:
            self._end(seq, reason, now)
        return TokenDelta(seq.request_id, seq.output_token_ids[n_tokens:], seq.logprobs[n_logprobs:], reason,
                          request_metrics(seq), prompt_logprobs=self._prompt_out(seq) if n_tokens == 0 else None)

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Append the logprobs of the prompt tokens a chunk's logits predict (row r: the token after
        the chunk's r-th), under the model's raw distribution, as generated tokens' logprobs are."""
        start, prompt = seq.num_computed_tokens, seq.prompt_token_ids
        rows = [r for r in range(len(logits)) if start + r + 1 < len(prompt) and start + r + 1 > len(seq.prompt_logprobs)]
        k = seq.params.prompt_logprobs
        for lo in range(0, len(rows), PROMPT_LOGPROB_ROWS):  # a [rows, vocab] float32 copy at a time
            part = rows[lo : lo + PROMPT_LOGPROB_ROWS]
            raw = torch.log_softmax(logits[part].float(), dim=-1)
            seq.prompt_logprobs.extend(token_logprobs(raw, [prompt[start + r + 1] for r in part], [k] * len(part)))  # type: ignore[arg-type]

    def _finish_prompt_only(self, seq: Sequence) -> TokenDelta:
        """End a max_tokens-0 request once its prompt is computed (its prompt logprobs go with it)."""
        self._end(seq, "length")
        return TokenDelta(seq.request_id, [], [], "length", request_metrics(seq), prompt_logprobs=self._prompt_out(seq))

    @staticmethod
    def _prompt_out(seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs as a caller gets them: None for the first token, which nothing predicts."""
        return None if seq.params.prompt_logprobs is None else [None, *seq.prompt_logprobs]

    def _fail(self, seq: Sequence, error: str) -> TokenDelta:
        """End the request alone with finish_reason "error": its blocks are freed, the batch goes on."""
        logger.warning("request %s ended with an error: %s", seq.request_id, error)
        self._end(seq, "error")
        seq.finish_reason = "error"  # also when the failure came after its last token was emitted
        return TokenDelta(seq.request_id, [], [], "error", request_metrics(seq), error)

    def _end(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """Finish a request: its blocks freed, its drafters told, the core forgets it."""
        seq.finish_time = time.perf_counter() if now is None else now
        self.scheduler.finish(seq, reason)
        self._requests.pop(seq.request_id, None)
        self._drafter_finish(seq)

    def _drafter_finish(self, seq: Sequence) -> None:
        self.speculator.finish(seq.request_id, _view(seq))


def _stop_reason(seq: Sequence, token: int, stop_ids: frozenset[int]) -> str | None:
    """Why the request ends at this token, if it does: an end-of-sequence id, its grammar complete
    (only the end of sequence may follow), or its length."""
    if token in stop_ids or (seq.grammar is not None and seq.grammar.done):
        return "stop"
    if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_total_len:
        return "length"
    return None
