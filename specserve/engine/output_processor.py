"""Output processing: a request's token deltas from the engine core become text and `RequestOutput`s.

Detokenizes incrementally, finds stop strings token by token (the core stops at token-level
conditions: end-of-sequence ids, a complete grammar, length; text is only here), keeps back the
characters of a stop string that may still be forming, and says what is new since the last output.
A request a stop string ends is named for the caller to abort in the core. Knows nothing of
scheduling or the model; needs only the tokenizer, so it can run in the caller's thread or process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.outputs import RequestMetrics, RequestOutput, TokenDelta, TokenLogprob
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class RequestState:
    """What emitting one request's text needs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    eos_ids: frozenset[int]  # ids that end it (its stop_token_ids, and the model's unless ignore_eos)
    holdback: int  # characters kept back while a stop string may be forming
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str = ""
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    finish_reason: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            eos_ids: frozenset[int]) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids) if self.tokenizer is not None else None
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self._requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, detok, eos_ids,
                                                  holdback)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, deltas: list[TokenDelta]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of a step's deltas, and the requests a stop string ended (to abort in the core)."""
        outputs, stopped = [], []
        for delta in deltas:
            req = self._requests.get(delta.request_id)
            if req is None:  # aborted meanwhile
                continue
            if delta.error is not None:
                req.finish_reason = "error"
                outputs.append(_output(req, "", [], req.text[: req.emitted_text_len], delta.metrics, delta.error))
            else:
                _append(req, delta)
                metrics = delta.metrics
                if req.finish_reason is not None and delta.finish_reason is None:  # a stop string ended it
                    stopped.append(req.request_id)
                    metrics = replace(metrics, finish_time=time.perf_counter())
                outputs.append(_new_output(req, metrics))
            if req.finish_reason is not None:
                del self._requests[req.request_id]
        return outputs, stopped


def _append(req: RequestState, delta: TokenDelta) -> None:
    """Append a delta's tokens one by one, stopping at the first stop condition: an end-of-sequence
    id (not text), a stop string (the text cut there), or the core's reason at its last token."""
    if delta.prompt_logprobs is not None:
        req.prompt_logprobs = delta.prompt_logprobs
    if not delta.new_token_ids and delta.finish_reason is not None:  # max_tokens 0: the prompt only
        req.finish_reason = delta.finish_reason
    logprobs = iter(delta.new_logprobs)
    last = len(delta.new_token_ids) - 1
    for i, token in enumerate(delta.new_token_ids):
        req.token_ids.append(token)
        logprob = next(logprobs, None)
        if logprob is not None:
            req.logprobs.append(logprob)
        if token in req.eos_ids:
            req.finish_reason = "stop"
            return
        if req.detok is not None and _stop_string(req, req.detok.add([token])):
            req.finish_reason = "stop"
            return
        if i == last and delta.finish_reason is not None:
            req.finish_reason = delta.finish_reason
            if req.detok is not None and delta.finish_reason == "length":
                req.text += req.detok.flush()


def _stop_string(req: RequestState, piece: str) -> bool:
    """Append a token's text; whether it completes one of the request's stop strings (then the
    text ends at it, or after it with include_stop_str_in_output)."""
    before = len(req.text)
    req.text += piece
    stop = req.params.stop
    if not stop or len(req.text) == before:
        return False
    start = max(0, before - max(len(s) for s in stop) + 1)
    hits = [(i, s) for s in stop if (i := req.text.find(s, start)) >= 0]
    if not hits:
        return False
    idx, s = min(hits)
    req.text = req.text[: idx + (len(s) if req.params.include_stop_str_in_output else 0)]
    return True


def _new_output(req: RequestState, metrics: RequestMetrics) -> RequestOutput:
    """What the request has produced since its last output (all its text once it is finished;
    before, less the characters a stop string may still claim)."""
    finished = req.finish_reason is not None
    visible = len(req.text) if finished else max(req.emitted_text_len, len(req.text) - req.holdback)
    new_text = req.text[req.emitted_text_len : visible]
    req.emitted_text_len = visible
    new_ids = req.token_ids[req.emitted_tokens :]
    req.emitted_tokens = len(req.token_ids)
    return _output(req, new_text, new_ids, req.text[:visible], metrics)


def _output(req: RequestState, new_text: str, new_ids: list[int], text: str, metrics: RequestMetrics,
            error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        text=text,
        token_ids=list(req.token_ids),
        new_text=new_text,
        new_token_ids=new_ids,
        finished=req.finish_reason is not None,
        finish_reason=req.finish_reason,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        error=error,
        metrics=metrics,
        prompt_logprobs=req.prompt_logprobs,
    )
