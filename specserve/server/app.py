"""The FastAPI app: OpenAI-compatible endpoints over one AsyncEngine.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    POST /v1/tokenize, /v1/detokenize
    GET  /v1/models, /health, /metrics
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.engine.engine import LLMEngine
from specserve.entrypoints.llm import LLM
from specserve.errors import InvalidRequestError
from specserve.server.engine_loop import AsyncEngine, EngineError
from specserve.server.errors import APIError, body_too_large
from specserve.server.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from specserve.server.serving import (
    ChatFormat, ChatPrompt, CompletionFormat, GenerationRun, ServingContext, TokenTexts, chat_job, completion_job,
)

logger = logging.getLogger("specserve.server")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
M = TypeVar("M", bound=BaseModel)


class BodyLimitMiddleware:
    """Rejects a request body over `max_bytes` with 413: at once when Content-Length says so, else
    as soon as the bytes received pass the limit. The accepted body is replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return dict(await receive())  # afterwards: http.disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_reject(scope.get("path", ""))
        err = body_too_large(self.max_bytes)
        await JSONResponse(err.body(), status_code=err.status, headers={"Connection": "close"})(scope, receive, send)


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise APIError.from_validation(e) from None


def _detokenize(tokens: list[int]) -> Callable[[LLMEngine], str]:
    def run(engine: LLMEngine) -> str:
        engine.check_token_ids(tokens, field="tokens")
        if engine.tokenizer is None:
            raise InvalidRequestError("tokens", "this model has no tokenizer")
        try:
            return str(engine.tokenizer.decode(tokens))
        except Exception as e:  # noqa: BLE001 - ids the tokenizer does not know
            raise InvalidRequestError("tokens", f"cannot decode: {e}") from None

    return run


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(request: Request, err: APIError) -> JSONResponse:
        if request.url.path in GENERATION_PATHS:
            metrics.request_done("error")
        if err.status >= 500:
            logger.error("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return answer(request, e)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        return answer(request, APIError.invalid(e))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(request, APIError(400, f"invalid request: {e.errors()[:1]}", code="invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return answer(request, APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, APIError(500, "internal server error", type="server_error", code="internal_error"))


def create_app(llm: LLM, *, served_model_name: str, max_waiting: int, max_body_bytes: int) -> FastAPI:
    """The ASGI app serving `llm`. The engine thread starts with the app (lifespan) and stops with
    it, aborting whatever is still in flight."""
    engine = AsyncEngine(llm.engine, max_waiting)
    started = int(time.time())
    metrics = ServerMetrics(engine.snapshot)
    ctx = ServingContext(engine, metrics, TokenTexts(llm.tokenizer), served_model_name,
                         llm.engine.config.max_model_len, max_choices=max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("serving %r (context %d tokens)", served_model_name, ctx.max_model_len)
        try:
            yield
        finally:
            engine.stop()
            logger.info("engine stopped")

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _install_error_handlers(app, metrics)

    def count_rejected(path: str) -> None:
        if path in GENERATION_PATHS:
            metrics.request_done("error")

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_reject=count_rejected)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        job = completion_job(await _parse(request, CompletionRequest), ctx)
        return await GenerationRun(ctx, job, CompletionFormat(ctx.texts)).respond(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        job = chat_job(await _parse(request, ChatCompletionRequest), ctx)
        return await GenerationRun(ctx, job, ChatFormat(ctx.texts)).respond(request)

    async def on_engine(fn: Callable[[LLMEngine], Any]) -> Any:
        try:
            return await engine.call(fn)
        except EngineError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None

    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _parse(request, TokenizeRequest)
        ctx.check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            fn: Callable[[LLMEngine], list[int]] = ChatPrompt([m.to_template(i) for i, m in enumerate(body.messages)])
        else:
            text = body.prompt or ""
            fn = lambda engine: engine.tokenize(text)  # noqa: E731
        tokens = await on_engine(fn)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _parse(request, DetokenizeRequest)
        ctx.check_model(body.model)
        return {"prompt": await on_engine(_detokenize(body.tokens))}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": started, "owned_by": "specserve",
                "root": served_model_name, "max_model_len": ctx.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
