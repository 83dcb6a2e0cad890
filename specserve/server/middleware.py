"""ASGI middleware in front of the endpoints: who may call (Host, API key), what they may send
(JSON, bounded in size and in time)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any, Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.server.errors import APIError, body_too_large

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the server on this machine."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """On loopback, only the names of this machine (a web page that rebinds its own DNS name to
    127.0.0.1 is refused); beyond loopback, any name the clients use."""
    if is_loopback(bind_host):
        return tuple(dict.fromkeys((*LOOPBACK_NAMES, bind_host.strip("[]").lower())))
    return ("*",)


def _host_name(value: str) -> str:
    """The host of a Host header value, without the port; IPv6 without brackets; lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class AccessPolicy:
    """api_key: the Bearer token /v1/* requires (and /metrics, unless metrics_public); None = open.
    allowed_hosts: Host header names accepted ("*" = any)."""

    api_key: str | None = None
    metrics_public: bool = False
    allowed_hosts: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key: must not be empty")
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts: give at least one host name, or '*'")

    def needs_key(self, path: str) -> bool:
        if self.api_key is None:
            return False
        return path.startswith("/v1/") or (path == "/metrics" and not self.metrics_public)

    def host_allowed(self, host: str | None) -> bool:
        if host is None or "*" in self.allowed_hosts:
            return True
        return _host_name(host) in {h.strip("[]").lower() for h in self.allowed_hosts}

    def key_matches(self, authorization: str | None) -> bool:
        assert self.api_key is not None
        if authorization is None:
            return False
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


async def _answer(
    scope: Scope, receive: Receive, send: Send, err: APIError, headers: dict[str, str] | None = None
) -> None:
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class AccessMiddleware:
    """Checks, in order: the Host header (400), the API key (401), and that a POST body is JSON (415)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy
        if not policy.host_allowed(_header(scope, b"host")):
            err = APIError(400, "Host header: this server does not answer to that name (see --allowed-hosts)",
                           code="invalid_host")
            return await _answer(scope, receive, send, err)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # routes match the path below the mount point
            path = path[len(root):]
        if policy.needs_key(path) and not policy.key_matches(_header(scope, b"authorization")):
            err = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")
            return await _answer(scope, receive, send, err, {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            media = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                shown = media or "none"
                err = APIError(415, f"Content-Type: request bodies must be application/json, got {shown}",
                               code="unsupported_media_type")
                return await _answer(scope, receive, send, err)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole request body before the app sees it: 413 if it is over `max_bytes` (at once
    when Content-Length says so, else as soon as the bytes received pass the limit), 408 if it has
    not all arrived `timeout` seconds after the request head. The body is then replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float, on_reject: Callable[[str], None],
                 on_timeout: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.on_reject = on_reject
        self.on_timeout = on_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                self.on_timeout()
                err = APIError(408, f"request body not received within {self.timeout:g} s", code="request_timeout")
                return await _answer(scope, receive, send, err, {"Connection": "close"})
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
        await _answer(scope, receive, send, err, {"Connection": "close"})
