"""Output processing: a request's accepted tokens become text and `RequestOutput`s.

Detokenizes incrementally, checks stop conditions token by token (end-of-sequence ids, stop
strings, a finished grammar, length), keeps back the characters of a stop string that may still be
forming, and says what is new since the last output. Knows nothing of scheduling or the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from specserve.engine.sequence import Sequence
from specserve.outputs import RequestMetrics, RequestOutput, TokenLogprob
from specserve.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class RequestState:
    """A sequence plus what emitting its text needs."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    eos_ids: frozenset[int]
    text: str = ""
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    holdback: int = 0  # characters kept back while a stop string may be forming

    @classmethod
    def start(cls, seq: Sequence, tokenizer: Any | None, eos_ids: frozenset[int]) -> RequestState:
        """eos_ids: the ids that end this request (its stop_token_ids, and the model's unless ignore_eos)."""
        detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids) if tokenizer is not None else None
        holdback = max((len(s) for s in seq.params.stop), default=1) - 1
        return cls(seq, detok, eos_ids, holdback=holdback)


def append_tokens(req: RequestState, tokens: list[int], logprobs: list[TokenLogprob | None]) -> str | None:
    """Append a step's tokens one by one, stopping at the first stop condition; the finish reason
    ("stop", "length") or None. A token the request's grammar does not allow is an error."""
    seq = req.seq
    for token, logprob in zip(tokens, logprobs):
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar")
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = _check_stop(req, token)
        if reason is not None:
            if req.detok is not None and reason == "length":
                req.text += req.detok.flush()
            return reason
    return None


def new_output(req: RequestState) -> RequestOutput:
    """What the request has produced since its last output (all its text once it is finished;
    before, less the characters a stop string may still claim)."""
    seq = req.seq
    visible = len(req.text) if seq.is_finished else max(req.emitted_text_len, len(req.text) - req.holdback)
    new_text = req.text[req.emitted_text_len : visible]
    req.emitted_text_len = visible
    new_ids = seq.output_token_ids[req.emitted_tokens :]
    req.emitted_tokens = len(seq.output_token_ids)
    return _output(req, new_text, new_ids, req.text[:visible])


def error_output(req: RequestState, error: str) -> RequestOutput:
    """The last output of a request that ended with an error: no new text, what it had emitted."""
    return _output(req, new_text="", new_ids=[], text=req.text[: req.emitted_text_len], error=error)


def _output(req: RequestState, new_text: str, new_ids: list[int], text: str, error: str | None = None) -> RequestOutput:
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


def _check_stop(req: RequestState, token: int) -> str | None:
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
