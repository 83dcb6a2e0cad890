"""Connection limits: slow or hostile clients cannot hold the server.

uvicorn reads a request head for as long as a client takes to send it, and accepts connections
until the process runs out of file descriptors. Here every connection is tracked from the moment
it is accepted:

- it must deliver a complete request head within `header_timeout` seconds of connecting, or of
  the end of its previous response (keep-alive), else it is closed (408 if it had sent part of
  one); the body's own deadline is kept by the app (middleware.BodyLimitMiddleware);
- at most `max_connections` are open: a new connection beyond that closes the one that has waited
  longest for a request head, or, when every open connection is serving a request, is refused
  with 503;
- these events are counted and logged at most once per `log_interval` seconds, never per event.

Two parts cooperate: `GuardedProtocol` wraps uvicorn's HTTP protocol (it sees connections open,
receive bytes and close) and `RequestTracking`, an ASGI middleware, tells the guard when a
connection's request head has arrived and when its response is done. They meet on the peer
address, which is what uvicorn puts in the ASGI scope as "client" (with proxy headers off).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("specserve.server")

Peer = tuple[str, int]

# File descriptors kept for everything that is not a client connection (model files, pipes, threads).
FD_RESERVE = 64
# Descriptors left free beyond those in use when the limits are fitted (files opened later, logs).
FD_SPARE = 16


@dataclass(frozen=True)
class ConnectionLimits:
    """max_connections: open client connections at most; header_timeout: seconds to send a whole
    request head; log_interval: at most one log line per this many seconds about connections
    closed or refused."""

    max_connections: int = 1024
    header_timeout: float = 20.0
    log_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {self.max_connections}")
        for name in ("header_timeout", "log_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name.replace('_', '-')}: must be > 0, got {value}")


def _fds_in_use() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def fit_to_fd_limit(limits: ConnectionLimits) -> tuple[ConnectionLimits, int]:
    """Raise this process's open-file limit as far as allowed, then choose the listen backlog and
    cap max_connections so that accepting never fails for lack of a file descriptor. Call it once
    everything else is loaded (the model's files and threads hold descriptors too).

    The backlog matters as much as the cap: asyncio accepts up to `backlog` connections in one go
    before any of them reaches the guard, so the fds open at once can reach in-use + cap + backlog.
    Returns the limits to use and the backlog.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * (limits.max_connections + FD_RESERVE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return limits, 2048
    headroom = soft - _fds_in_use() - FD_SPARE
    backlog = max(8, min(2048, headroom // 8))
    cap = max(1, headroom - backlog)
    if cap < limits.max_connections:
        logger.warning("max-connections: %d does not fit the open-file limit of %d; using %d",
                       limits.max_connections, soft, cap)
        limits = ConnectionLimits(cap, limits.header_timeout, limits.log_interval)
    return limits, backlog


class EventLog:
    """Counts events and logs them together, at most once per `interval` seconds."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._last = clock()

    def add(self, what: str, n: int = 1) -> None:
        self._counts[what] = self._counts.get(what, 0) + n

    def flush(self, force: bool = False) -> str | None:
        """Log (and return) the summary if one is due."""
        now = self._clock()
        if not self._counts or (not force and now - self._last < self._interval):
            return None
        line = "; ".join(f"{what}: {n}" for what, n in self._counts.items())
        logger.warning("connections in the last %.0f s: %s", now - self._last, line)
        self._counts.clear()
        self._last = now
        return line


@dataclass(eq=False)
class _Conn:
    transport: asyncio.BaseTransport
    since: float  # when it started waiting for a request head
    partial: bool = False  # bytes of a request head received
    busy: bool = False  # a request is being served
    serving: Callable[[], bool] = lambda: False  # whether the HTTP protocol has a request under way


_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
)
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


def _error_json(message: str, code: str) -> bytes:
    import json

    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return json.dumps(body).encode()


class ConnectionGuard:
    """The state of every open connection of one server (event-loop thread only)."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._conns: dict[Peer, _Conn] = {}
        self._idle: OrderedDict[Peer, None] = OrderedDict()  # waiting for a request head, oldest first
        self._timer: asyncio.TimerHandle | None = None
        self.events = EventLog(limits.log_interval, clock)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count the loop's 'out of file descriptors' accept errors into the summary instead of
        logging each (asyncio would log one per pending connection, with a traceback)."""
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == "socket.accept() out of system resource":
                self.events.add(f"accept failed: {context.get('exception')}")
                self._arm()
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def opened(self, peer: Peer, transport: asyncio.BaseTransport,
               serving: Callable[[], bool] = lambda: False) -> bool:
        """A connection was accepted. False: it is refused (answered 503 and closed).
        `serving` says whether the connection's HTTP protocol has a request under way (its head
        parsed, the app perhaps not called yet); such a connection is never closed as idle."""
        if len(self._conns) >= self.limits.max_connections:
            oldest = next((p for p in self._idle if not self._conns[p].serving()), None)
            if oldest is not None:
                self.events.add(f"closed while waiting for a request, to admit new ones "
                                f"(limit {self.limits.max_connections} open)")
                self._close(oldest, timed_out=False)
            else:
                self.events.add(f"refused: {self.limits.max_connections} connections all serving requests")
                body = _error_json("too many open connections; retry later", "too_many_connections")
                try:
                    transport.write(_REFUSED % (len(body), body))  # type: ignore[attr-defined]
                finally:
                    transport.close()
                return False
        self._conns[peer] = _Conn(transport, self._clock(), serving=serving)
        self._idle[peer] = None
        self._arm()
        return True

    def received(self, peer: Peer) -> None:
        conn = self._conns.get(peer)
        if conn is not None and not conn.busy:
            conn.partial = True

    def closed(self, peer: Peer, transport: asyncio.BaseTransport) -> None:
        conn = self._conns.get(peer)
        if conn is not None and conn.transport is transport:
            del self._conns[peer]
            self._idle.pop(peer, None)

    def request_started(self, peer: Peer) -> None:
        conn = self._conns.get(peer)
        if conn is not None:
            conn.busy = True
            conn.partial = False
            self._idle.pop(peer, None)

    def request_finished(self, peer: Peer) -> None:
        conn = self._conns.get(peer)
        if conn is not None and conn.busy:
            conn.busy = False
            conn.since = self._clock()
            self._idle[peer] = None
            self._idle.move_to_end(peer)

    def sweep(self) -> None:
        """Close connections whose request head is overdue; log what happened if a summary is due."""
        now = self._clock()
        deadline = now - self.limits.header_timeout
        while self._idle:
            peer = next(iter(self._idle))
            conn = self._conns[peer]
            if conn.since > deadline:
                break
            if conn.serving():  # its head is in, the app just has not started on it: not idle
                self.request_started(peer)
                continue
            self.events.add(f"closed after {self.limits.header_timeout:g} s without a complete request head")
            self._close(peer, timed_out=True)
        self.events.flush()

    def _close(self, peer: Peer, timed_out: bool) -> None:
        conn = self._conns.pop(peer)
        self._idle.pop(peer, None)
        if timed_out and conn.partial and not conn.transport.is_closing():
            conn.transport.write(_TIMED_OUT)  # type: ignore[attr-defined]
        conn.transport.close()

    def _arm(self) -> None:
        """Sweep a few times per header timeout while any connection is open."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def tick() -> None:
            self._timer = None
            self.sweep()
            if self._conns or self.events._counts:
                self._arm()

        self._timer = loop.call_later(min(1.0, self.limits.header_timeout / 4), tick)


def _peer(address: Any) -> Peer | None:
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


class GuardedProtocol(asyncio.Protocol):
    """uvicorn's HTTP protocol (`inner`), with every connection reported to the guard. Use as
    uvicorn's `http=functools.partial(GuardedProtocol, guard=..., inner=...)`."""

    def __init__(
        self, *args: Any, guard: ConnectionGuard, inner: Callable[..., asyncio.Protocol], **kwargs: Any
    ) -> None:
        self._guard = guard
        self._inner = inner(*args, **kwargs)
        self._peer: Peer | None = None
        self._transport: asyncio.BaseTransport | None = None
        self._refused = False

    def _serving(self) -> bool:
        """Whether uvicorn's protocol has a request cycle under way (its `cycle`, in both the h11
        and the httptools protocol); False where a protocol does not say."""
        cycle = getattr(self._inner, "cycle", None)
        return cycle is not None and not getattr(cycle, "response_complete", True)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._peer = _peer(transport.get_extra_info("peername"))
        if self._peer is not None and not self._guard.opened(self._peer, transport, self._serving):
            self._refused = True
            return
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._peer is not None:
            self._guard.received(self._peer)
        self._inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return None if self._refused else self._inner.eof_received()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None and self._transport is not None:
            self._guard.closed(self._peer, self._transport)
        if not self._refused:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()


class RequestTracking:
    """ASGI middleware: tells the guard when a connection's request head arrived (the app is
    called) and when its response is complete."""

    def __init__(self, app: ASGIApp, guard: ConnectionGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = _peer(scope.get("client")) if scope["type"] == "http" else None
        if peer is None:
            await self.app(scope, receive, send)
            return
        self.guard.request_started(peer)
        done = False

        async def tracked_send(message: Message) -> None:
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.guard.request_finished(peer)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            if not done:
                self.guard.request_finished(peer)
