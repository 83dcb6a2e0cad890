"""Completions and chat completions: a request body becomes engine requests (one per choice), and
their outputs become OpenAI responses or server-sent-event chunks."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specserve.outputs import DraftCounters, TokenLogprob
from specserve.errors import InvalidRequestError
from specserve.outputs import RequestOutput
from specserve.server.engine_loop import (
    EngineClient, EngineError, EngineRequest, EngineUnavailable, GenerationFailed, OutputStream, QueueFullError,
    ServerShuttingDown,
)
from specserve.server.errors import APIError
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.tools import (
    ToolCallParser, ToolPlan, fallback_messages, parse_tool_calls, special_markers, syntax_for,
)
from specserve.tokenizer import PromptEncoder

logger = logging.getLogger("specserve.server")
R = TypeVar("R")

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2's bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Each token's text and raw bytes, for logprobs; memoized. Decoding is read-only tokenizer
    use, which fast tokenizers allow from any thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._byte_decoder = _gpt2_byte_decoder()
        self._cache: dict[int, tuple[str, bytes]] = {}

    def text(self, token_id: int) -> str:
        return self._get(token_id)[0]

    def byte_values(self, token_id: int) -> list[int]:
        return list(self._get(token_id)[1])

    def _get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if self._tok is None:
            return f"<{token_id}>", str(token_id).encode()
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode()
        piece = self._tok.convert_ids_to_tokens(token_id)  # part of a character: recover its bytes
        if isinstance(piece, str):
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte
                return text, bytes([int(piece[3:5], 16)])
            if all(ch in self._byte_decoder for ch in piece):  # byte-level BPE
                return text, bytes(self._byte_decoder[ch] for ch in piece)
        return text, text.encode()


@dataclass(frozen=True)
class ServingContext:
    engine: EngineClient
    metrics: ServerMetrics
    texts: TokenTexts
    prompts: PromptEncoder  # run through `encode`, on the server's tokenizer thread
    served_model_name: str
    max_model_len: int
    max_choices: int  # engine requests one HTTP request may make (prompts x n): the waiting queue's size
    # one thread for every prompt to tokenize: off the event loop, and a tokenizer is not for concurrent calls
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-tokenizer"))

    async def encode(self, fn: Callable[..., R], *args: Any) -> R:
        """fn(*args) (a PromptEncoder method) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.served_model_name!r}",
                           param="model", code="model_not_found")

    def check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_choices:
            raise InvalidRequestError(
                "n", f"{num_prompts} prompt(s) x n={n} is more than the {self.max_choices} choices a request may have"
            )


@dataclass(frozen=True)
class Job:
    """One HTTP generation request; choice i is requests[i], made from prompt prompt_of[i]."""

    id: str
    model: str
    requests: list[EngineRequest]
    prompt_of: list[int]
    stream: bool
    include_usage: bool
    logprobs: bool
    rename: dict[str, str]  # engine field name -> this endpoint's name for it
    created: int = field(default_factory=lambda: int(time.time()))
    echo: tuple[str, ...] | None = None  # completions with echo: each prompt's text, put before its choices' text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field in each choice, with this many alternatives
    tools: ToolPlan | None = None  # chat with tools: calls are parsed out of the text

    def index_of(self) -> dict[str, int]:
        return {r.request_id: i for i, r in enumerate(self.requests)}

    def usage(self, outs: dict[int, RequestOutput]) -> dict[str, Any]:
        """OpenAI's usage, with what speculation did for these choices in OpenAI's fields for
        predicted outputs: draft tokens the model accepted (each one a forward pass saved) and draft
        tokens it rejected (verified for nothing); both 0 when nothing was drafted."""
        prompt_lens = {self.prompt_of[i]: len(o.prompt_token_ids) for i, o in outs.items()}
        prompt = sum(prompt_lens.values())
        completion = sum(len(o.token_ids) for o in outs.values())
        spec = DraftCounters()
        for o in outs.values():
            spec.add(o.metrics.speculation)
        details = {"accepted_prediction_tokens": spec.accepted, "rejected_prediction_tokens": spec.proposed - spec.accepted}
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "completion_tokens_details": details}


def _new_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """The logprobs of this output's new tokens."""
    if not out.logprobs or not out.new_token_ids:
        return []
    return out.logprobs[len(out.token_ids) - len(out.new_token_ids) :]


def _pairs(lps: list[TokenLogprob]) -> list[tuple[int, TokenLogprob | None]]:
    return [(lp.token_id, lp) for lp in lps]


def chunk_envelope(job: Job, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields every stream chunk of `job` carries around its choices."""
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": choices}


class Format(Protocol):
    """How one endpoint shapes a request's response or stream chunks (one instance per request)."""

    chunk_object: str

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]: ...

    def opening_chunks(self, job: Job) -> list[dict[str, Any]]: ...

    def chunk(self, job: Job, index: int, out: RequestOutput) -> dict[str, Any] | None: ...


def vllm_prompt_logprobs(texts: TokenTexts, out: RequestOutput, k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) a dict from token id to its
    logprob, rank and text: the prompt's own token and the top k alternatives."""
    if out.prompt_logprobs is None:
        return None
    result: list[dict[str, Any] | None] = []
    for lp in out.prompt_logprobs:
        if lp is None:
            result.append(None)
            continue
        entry = {str(t): {"logprob": _finite(v), "rank": r, "decoded_token": texts.text(t)}
                 for r, (t, v) in enumerate(lp.top[:k], start=1)}
        entry[str(lp.token_id)] = {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": texts.text(lp.token_id)}
        result.append(entry)
    return result


class CompletionFormat:
    """/v1/completions: `text_completion` objects; logprobs as tokens / token_logprobs /
    top_logprobs / text_offset. With echo, a choice's text (and its logprobs, the first token's
    null) starts with its prompt's: in the response, or in a stream's first chunk of the choice."""

    chunk_object = "text_completion"

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token (streams)
        self._echoed: set[int] = set()  # choices whose prompt a stream has sent

    def _logprobs(self, job: Job, index: int, lps: list[tuple[int, TokenLogprob | None]]) -> dict[str, Any] | None:
        """(token id, its logprob or None) pairs in the legacy completions shape."""
        if not job.logprobs:
            return None
        k = job.requests[index].params.logprobs or 0
        offset = self._offsets.get(index, 0)
        tokens, offsets, values, tops = [], [], [], []
        for token, lp in lps:
            text = self._texts.text(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            values.append(None if lp is None else _finite(lp.logprob))
            tops.append(None if lp is None else {self._texts.text(t): _finite(v) for t, v in lp.top[:k]})
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echo(self, job: Job, index: int, out: RequestOutput) -> tuple[str, list[tuple[int, TokenLogprob | None]]]:
        """The prompt's text and logprobs a choice starts with ("" and [] without echo); the first
        prompt token's logprob is None: nothing predicts it."""
        if job.echo is None:
            return "", []
        text = job.echo[job.prompt_of[index]]
        if not job.logprobs:
            return text, []
        return text, list(zip(out.prompt_token_ids, out.prompt_logprobs or []))

    def _choice(self, job: Job, index: int, out: RequestOutput, text: str,
                lps: list[tuple[int, TokenLogprob | None]], final: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": self._logprobs(job, index, lps),
                                  "finish_reason": out.finish_reason if final else None}
        if job.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self._texts, out, job.prompt_logprobs)
        return choice

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, o in enumerate(finals):
            echo_text, echo_lps = self._echo(job, i, o)
            choices.append(self._choice(job, i, o, echo_text + o.text, [*echo_lps, *_pairs(o.logprobs or [])], True))
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                "choices": choices, "usage": job.usage(dict(enumerate(finals)))}

    def opening_chunks(self, job: Job) -> list[dict[str, Any]]:
        return []

    def chunk(self, job: Job, index: int, out: RequestOutput) -> dict[str, Any] | None:
        first = index not in self._echoed
        if not (out.new_text or out.finished or (job.logprobs and out.new_token_ids) or (first and job.echo)):
            return None
        self._echoed.add(index)
        echo_text, echo_lps = self._echo(job, index, out) if first else ("", [])
        return self._envelope(job, [self._choice(job, index, out, echo_text + out.new_text,
                                                 [*echo_lps, *_pairs(_new_logprobs(out))], out.finished)])

    def _envelope(self, job: Job, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk_envelope(job, self.chunk_object, choices)


class ChatFormat:
    """/v1/chat/completions: `chat.completion(.chunk)` objects; logprobs.content entries. With
    tools, the model's calls leave its text as `message.tool_calls` (streamed as `delta.tool_calls`,
    one entry per call once its arguments are complete), and a choice that called ends with
    finish_reason "tool_calls"."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._parsers: dict[int, ToolCallParser] = {}  # streams with tools: one per choice

    @staticmethod
    def _finish_reason(out: RequestOutput, called: bool) -> str | None:
        return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason

    def _message(self, job: Job, out: RequestOutput) -> tuple[dict[str, Any], bool]:
        if job.tools is None:
            return {"role": "assistant", "content": out.text}, False
        content, calls = parse_tool_calls(out.text, job.tools.parser())
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, bool(calls)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self._texts.text(token_id), "logprob": _finite(logprob), "bytes": self._texts.byte_values(token_id)}

    def _logprobs(self, job: Job, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not job.logprobs:
            return None
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, o in enumerate(finals):
            message, called = self._message(job, o)
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(job, o.logprobs or []),
                            "finish_reason": self._finish_reason(o, called)})
        if job.prompt_logprobs is not None:
            for choice, o in zip(choices, finals):
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self._texts, o, job.prompt_logprobs)
        return {"id": job.id, "object": "chat.completion", "created": job.created, "model": job.model,
                "choices": choices, "usage": job.usage(dict(enumerate(finals)))}

    def opening_chunks(self, job: Job) -> list[dict[str, Any]]:
        return [self._envelope(job, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                for i in range(len(job.requests))]

    def chunk(self, job: Job, index: int, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.new_text or out.finished or (job.logprobs and out.new_token_ids)):
            return None
        text, calls, called = out.new_text, [], False
        if job.tools is not None:
            parser = self._parsers.setdefault(index, job.tools.parser())
            first = parser.calls
            text, calls = parser.feed(out.new_text)
            if out.finished:
                tail, more = parser.finish()
                text, calls = text + tail, calls + more
            calls = [c.openai(first + k) for k, c in enumerate(calls)]
            called = parser.calls > 0
            if not (text or calls or out.finished or job.logprobs):
                return None  # all held back: it may be a call forming
        delta: dict[str, Any] = {"content": text} if text or not (out.finished or calls) else {}
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(job, _new_logprobs(out)),
                  "finish_reason": self._finish_reason(out, called) if out.finished else None}
        return self._envelope(job, [choice])

    def _envelope(self, job: Job, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk_envelope(job, self.chunk_object, choices)


class RequestTracker:
    """Metrics and the one log line of a generation request (all its choices)."""

    def __init__(self, job: Job, metrics: ServerMetrics) -> None:
        self._job = job
        self._metrics = metrics
        self._start = time.perf_counter()
        self._index = job.index_of()
        self._last: dict[int, RequestOutput] = {}
        self._closed = False

    def observe(self, out: RequestOutput) -> None:
        self._last[self._index[out.request_id]] = out
        if out.finished:
            self._metrics.output_finished(out)

    @property
    def complete(self) -> bool:
        return len(self._last) == len(self._job.requests) and all(o.finished for o in self._last.values())

    def close(self, status: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        status = status or ("success" if self.complete else "abort")
        for out in self._last.values():
            if not out.finished:
                self._metrics.output_aborted(out)
        self._metrics.request_done(status)
        usage = self._job.usage(self._last)
        ttfts = [o.metrics.ttft for o in self._last.values() if o.metrics.ttft is not None]
        spec = DraftCounters()
        for o in self._last.values():
            spec.add(o.metrics.speculation)
        logger.info(
            "%s %s: prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs mean_accepted_len=%s",
            self._job.id, status, usage["prompt_tokens"], usage["completion_tokens"],
            f"{min(ttfts):.3f}s" if ttfts else "-", time.perf_counter() - self._start,
            f"{spec.mean_accepted_length:.2f}" if spec.steps else "-",
        )


def engine_failure(e: EngineError) -> APIError:
    """The HTTP error for a request the engine could not finish."""
    if isinstance(e, ServerShuttingDown):
        return APIError(503, str(e), type="server_error", code="server_shutting_down")
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, GenerationFailed):
        return APIError(500, str(e), type="server_error", code="generation_failed")
    return APIError(500, str(e), type="server_error", code="engine_error")


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


ABORT_WAIT_SECONDS = 10.0


async def _close(stream: OutputStream) -> None:
    """Close `stream`, waiting (shielded from the handler's own cancellation, bounded) until the
    engine has carried out the abort of what was unfinished: a request is counted as aborted once
    its blocks are free, never before."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(ABORT_WAIT_SECONDS):
        await stream.aclose()
    stream.close()  # a no-op unless the wait was cut short


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run `work`; give up (cancelling it) if the client disconnects first. True if it finished."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        return False
    task.result()  # re-raise its error, if any
    return True


class GenerationRun:
    """Runs one Job on the engine and answers with a JSON response or an event stream."""

    def __init__(self, ctx: ServingContext, job: Job, fmt: Format) -> None:
        self._ctx = ctx
        self._job = job
        self._fmt = fmt

    async def respond(self, request: Request) -> Response:
        job = self._job
        try:
            stream = await self._ctx.engine.submit(job.requests)
        except InvalidRequestError as e:
            raise APIError.invalid(e, job.rename) from None
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ServerShuttingDown as e:
            raise engine_failure(e) from None
        except EngineError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        tracker = RequestTracker(job, self._ctx.metrics)
        if job.stream:
            return StreamingResponse(self._events(job, stream, tracker), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(job, stream, tracker, request)

    async def _complete(self, job: Job, stream: OutputStream, tracker: RequestTracker, request: Request) -> Response:
        finals: dict[int, RequestOutput] = {}
        index = job.index_of()

        async def drain() -> None:
            async for out in stream:
                tracker.observe(out)
                if out.finished:
                    finals[index[out.request_id]] = out

        try:
            done = await _unless_disconnected(request, drain())
        except EngineError as e:
            tracker.close("abort" if isinstance(e, ServerShuttingDown) else "error")
            err = engine_failure(e)
            return JSONResponse(err.body(), status_code=err.status)
        finally:
            await _close(stream)
            tracker.close()
        if not done:  # nobody to answer
            return Response(status_code=499)
        return JSONResponse(self._fmt.response(job, [finals[i] for i in range(len(job.requests))]))

    async def _events(self, job: Job, stream: OutputStream, tracker: RequestTracker) -> AsyncIterator[str]:
        index = job.index_of()
        status: str | None = None
        try:
            for opening in self._fmt.opening_chunks(job):
                yield _sse(self._with_usage_field(job, opening))
            finals: dict[int, RequestOutput] = {}
            async for out in stream:
                tracker.observe(out)
                if out.finished:
                    finals[index[out.request_id]] = out
                chunk = self._fmt.chunk(job, index[out.request_id], out)
                if chunk is not None:
                    yield _sse(self._with_usage_field(job, chunk))
            if job.include_usage:
                yield _sse({**chunk_envelope(job, self._fmt.chunk_object, []), "usage": job.usage(finals)})
            yield _sse("[DONE]")
        except EngineError as e:
            status = "abort" if isinstance(e, ServerShuttingDown) else "error"
            yield _sse(engine_failure(e).body())
            yield _sse("[DONE]")
        finally:
            await _close(stream)
            tracker.close(status)

    @staticmethod
    def _with_usage_field(job: Job, chunk: dict[str, Any]) -> dict[str, Any]:
        if job.include_usage:
            chunk["usage"] = None
        return chunk


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def completion_job(body: CompletionRequest, ctx: ServingContext) -> Job:
    """Engine requests for a completions body: prompt p's choice i is choice p * n + i."""
    ctx.check_model(body.model)
    try:
        body.check_supported()
        texts = body.prompts()
        ctx.check_choices(len(texts), body.n)
        params = [body.sampling_params(i) for i in range(body.n)]
        prompts = [await ctx.encode(ctx.prompts.prompt, p) for p in texts]
        echo = None if not body.echo else tuple(
            [p if isinstance(p, str) else await ctx.encode(ctx.prompts.decode, p, "prompt") for p in texts])
    except InvalidRequestError as e:
        raise APIError.invalid(e) from None
    job_id = _request_id("cmpl")
    requests: list[EngineRequest] = []
    prompt_of: list[int] = []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            requests.append(EngineRequest(f"{job_id}-{len(requests)}", prompt, params[i]))
            prompt_of.append(p)
    return Job(job_id, body.model or ctx.served_model_name, requests, prompt_of, body.stream, body.include_usage,
               body.logprobs is not None, {}, echo=echo, prompt_logprobs=body.prompt_logprobs)


async def chat_job(body: ChatCompletionRequest, ctx: ServingContext) -> Job:
    ctx.check_model(body.model)
    rename = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": body.max_tokens_field}
    try:
        body.check_supported()
        messages = body.template_messages()
        ctx.check_choices(1, body.n)
        tokenizer = ctx.prompts.tokenizer
        syntax, native = syntax_for(getattr(tokenizer, "chat_template", None))
        plan = body.tool_plan(syntax, special_markers(syntax, tokenizer))
        params = [body.sampling_params(i, ctx.max_model_len, plan) for i in range(body.n)]
        tools = body.template_tools()
        if native:
            prompt = await ctx.encode(ctx.prompts.chat, messages, tools)
        else:  # the template knows no tools: they are described in a system message
            prompt = await ctx.encode(ctx.prompts.chat, fallback_messages(messages, tools or []))
    except InvalidRequestError as e:
        raise APIError.invalid(e, rename) from None
    job_id = _request_id("chatcmpl")
    requests = [EngineRequest(f"{job_id}-{i}", prompt, params[i]) for i in range(body.n)]
    return Job(job_id, body.model or ctx.served_model_name, requests, [0] * body.n, body.stream, body.include_usage,
               body.logprobs, rename, prompt_logprobs=body.prompt_logprobs, tools=plan)
