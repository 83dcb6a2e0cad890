"""The FastAPI app: OpenAI-compatible endpoints over an engine client (the engine in this process,
or a pool of engine replicas on Ray Serve).

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    POST /v1/tokenize, /v1/detokenize
    GET  /v1/models, /health, /metrics
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence, TypeVar

from fastapi import FastAPI
from prometheus_client.registry import Collector
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.entrypoints.llm import LLM
from specserve.errors import InvalidRequestError
from specserve.server.engine_loop import AsyncEngine, EngineClient
from specserve.server.errors import APIError
from specserve.server.guard import ConnectionGuard, RequestTracking
from specserve.server.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.middleware import AccessMiddleware, AccessPolicy, BodyLimitMiddleware
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from specserve.tokenizer import PromptEncoder
from specserve.server.serving import (
    ChatFormat, CompletionFormat, GenerationRun, ServingContext, TokenTexts, chat_job, completion_job,
)

logger = logging.getLogger("specserve.server")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerOptions:
    """What the HTTP layer enforces (the engine's own limits live in the engine config).

    max_waiting: requests that may wait for the engine before new ones get 429
    max_body_bytes: largest request body (413 beyond); body_timeout: seconds to receive it (408)
    access: Host names, API key, public metrics; allowed_origins: CORS origins (none = no CORS)
    """

    served_model_name: str
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout: float = 60.0
    access: AccessPolicy = field(default_factory=AccessPolicy)
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting: must be >= 1, got {self.max_waiting}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout: must be > 0, got {self.body_timeout}")


async def _parse(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise APIError.from_validation(e) from None


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
        response = answer(request, APIError(e.status_code, str(e.detail), type=kind))
        response.headers.update(e.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, APIError(500, "internal server error", type="server_error", code="internal_error"))


# The request body of each POST endpoint, declared in /openapi.json (the handlers parse bodies
# themselves, to answer in OpenAI's error format).
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/tokenize": TokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
}


def _body_spec(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _install_openapi(app: FastAPI) -> None:
    """Add the request models to the generated schema's components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer knows of the model: its tokenizer (prompts to token ids, token texts for
    logprobs) and vocabulary size, context length and KV block size (reported to routers in /metrics)."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    block_size: int

    @classmethod
    def of(cls, llm: LLM) -> ServedModel:
        config = llm.engine.config
        return cls(llm.tokenizer, llm.engine.model.config.vocab_size, config.max_model_len, config.cache.block_size)


def create_app(llm: LLM, options: ServerOptions, guard: ConnectionGuard | None = None) -> FastAPI:
    """The ASGI app serving `llm` in this process. The engine thread starts with the app (lifespan)
    and stops with it, aborting whatever is still in flight. `guard`: the server's connection guard,
    told when each connection's request starts and ends (see specserve.server.guard)."""
    return build_app(AsyncEngine(llm.engine, options.max_waiting), ServedModel.of(llm), options, guard)


def build_app(engine: EngineClient, model: ServedModel, options: ServerOptions,
              guard: ConnectionGuard | None = None, collectors: Sequence[Collector] = ()) -> FastAPI:
    """The ASGI app over any engine client; `collectors`: more Prometheus series for /metrics."""
    served_model_name = options.served_model_name
    started = int(time.time())
    metrics = ServerMetrics(engine.snapshot, model.block_size, collectors)
    ctx = ServingContext(engine, metrics, TokenTexts(model.tokenizer), PromptEncoder(model.tokenizer, model.vocab_size),
                         served_model_name, model.max_model_len, max_choices=options.max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if guard is not None:
            guard.attach(asyncio.get_running_loop())
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
    _install_openapi(app)

    def count_rejected(path: str) -> None:
        if path in GENERATION_PATHS:
            metrics.request_done("error")

    def count_timeout() -> None:
        metrics.request_done("error")
        if guard is not None:
            guard.events.add(f"request bodies not received within {options.body_timeout:g} s (408)")

    # Added innermost first: a request meets tracking, CORS, access checks, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_body_bytes, timeout=options.body_timeout,
                       on_reject=count_rejected, on_timeout=count_timeout)
    app.add_middleware(AccessMiddleware, policy=options.access)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])  # OpenAI SDKs send x-stainless-*
    if guard is not None:
        app.add_middleware(RequestTracking, guard=guard)

    @app.post("/v1/completions", openapi_extra=_body_spec(CompletionRequest))
    async def completions(request: Request) -> Response:
        job = await completion_job(await _parse(request, CompletionRequest), ctx)
        return await GenerationRun(ctx, job, CompletionFormat(ctx.texts)).respond(request)

    @app.post("/v1/chat/completions", openapi_extra=_body_spec(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        job = await chat_job(await _parse(request, ChatCompletionRequest), ctx)
        return await GenerationRun(ctx, job, ChatFormat(ctx.texts)).respond(request)

    @app.post("/v1/tokenize", openapi_extra=_body_spec(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _parse(request, TokenizeRequest)
        ctx.check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            tokens = await ctx.encode(ctx.prompts.chat, [m.to_template(i) for i, m in enumerate(body.messages)])
        else:
            tokens = await ctx.encode(ctx.prompts.tokenize, body.prompt or "")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/v1/detokenize", openapi_extra=_body_spec(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _parse(request, DetokenizeRequest)
        ctx.check_model(body.model)
        return {"prompt": await ctx.encode(ctx.prompts.decode, body.tokens)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": started, "owned_by": "specserve",
                "root": served_model_name, "max_model_len": ctx.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if engine.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
