"""`AsyncEngine`: the engine stepping in one background thread, shared by every HTTP request.

The engine is not thread-safe, so everything that touches it (adding, aborting, stepping,
reading stats) runs on that one thread. Requests arrive as data, token ids and sampling parameters
(`EngineRequest`): prompts are tokenized and chat templates rendered before, in the server's own
thread for that (specserve.tokenizer.PromptEncoder), never on the engine's. The event loop talks to it through
an inbox of commands (a deque plus a `threading.Event` the thread sleeps on when idle); results
and per-step outputs come back with `loop.call_soon_threadsafe` into asyncio futures and
per-request queues. After every pass the thread publishes an immutable `EngineSnapshot` for
`/metrics` and for admission control.

Build the engine with `build_on_passing_thread`, not on the event loop's thread: see there why.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Any, AsyncIterator, Callable, Generic, Protocol, Sequence, TypeVar

from specserve.engine.engine import EngineStats, LLMEngine
from specserve.outputs import DraftCounters
from specserve.speculation.speculator import SpeculationStats
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger("specserve.server")

T = TypeVar("T")

Command = Callable[[LLMEngine], None]


class QueueFullError(RuntimeError):
    """More requests would be waiting than the server accepts (HTTP 429)."""


class EngineError(RuntimeError):
    """The engine failed or stopped while a request was in flight."""


class ServerShuttingDown(EngineError):
    """The server is shutting down: a new request is refused, one in flight past the timeout aborted."""


class GenerationFailed(EngineError):
    """This request alone failed in the engine (e.g. its sampling numbers broke down); the others go on."""


class EngineUnavailable(EngineError):
    """No engine can take or finish the request now (a replica died or is restarting): retry later."""


def build_on_passing_thread(build: Callable[[], T]) -> T:
    """`build()` run on a thread that ends before this returns (for loading a model to serve).

    GNU OpenMP (PyTorch's, and the native kernels') gives every thread that starts a parallel
    region a pool of worker threads of its own, kept until that thread ends. Once the process holds
    more pool threads than CPUs, libgomp throttles every pool: idle workers sleep in the kernel at
    each barrier instead of spinning. Loading and tuning a model runs parallel regions; done on the
    event loop's thread, they left a second pool beside the engine thread's and every decode step
    paid futex sleeps and wake-ups at each of its barriers (per token through the server: 20% slower
    than LLM.generate on 2 cores). A thread that ends takes its pool with it."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = build()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, name="specserve-load", daemon=True)  # Ctrl-C does not wait for it
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class EngineRequest:
    """One request for the engine, as plain data (it crosses to Ray replicas as it is)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the background thread's latest pass."""

    stats: EngineStats
    drafts: DraftCounters
    queued: int  # requests submitted but not yet added to the engine
    control: SpeculationStats = SpeculationStats()  # the speculation controller's record

    @property
    def num_waiting(self) -> int:
        return self.stats.num_waiting + self.queued


def merge_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """The snapshots of several engines as one engine's: gauges and counters summed (counters of a
    restarted engine start again from zero, which Prometheus reads as a counter reset)."""
    if not snapshots:
        return EngineSnapshot(EngineStats(0, 0, 0, 0, 0, 0, 0), DraftCounters(), 0)
    stats = EngineStats(*(sum(getattr(s.stats, f.name) for s in snapshots) for f in fields(EngineStats)))
    drafts = DraftCounters()
    for s in snapshots:
        drafts.add(s.drafts)
    control: dict[str, Any] = {}
    for f in fields(SpeculationStats):
        values = [getattr(s.control, f.name) for s in snapshots]
        if isinstance(values[0], tuple):  # (key, count) pairs
            counts: dict[Any, Any] = {}
            for pairs in values:
                for key, n in pairs:
                    counts[key] = counts.get(key, 0) + n
            control[f.name] = tuple(sorted(counts.items()))
        else:
            control[f.name] = sum(values)
    return EngineSnapshot(stats, drafts, sum(s.queued for s in snapshots), SpeculationStats(**control))


class OutputStream(Protocol):
    """The outputs of a group of engine requests; `close()` aborts the unfinished ones, `aclose()`
    does too and returns once the engine has carried the abort out (their KV blocks are free and
    the published snapshot says so), so whatever is counted after it is true of the engine."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    """What the HTTP layer needs of an engine: one in this process (AsyncEngine) or a pool of
    replicas elsewhere (specserve.server.replicas). Errors: InvalidRequestError (bad input),
    QueueFullError (429), EngineError and its kinds (ServerShuttingDown, EngineUnavailable, ...)."""

    async def submit(self, requests: Sequence[EngineRequest]) -> OutputStream: ...

    def snapshot(self) -> EngineSnapshot: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def drain(self, timeout: float) -> None: ...

    @property
    def draining(self) -> bool: ...

    @property
    def alive(self) -> bool: ...


def _copy_spec(c: DraftCounters) -> DraftCounters:
    return replace(c, accepted_per_position=list(c.accepted_per_position))


class RequestStream:
    """The outputs of a group of engine requests (e.g. the n choices of one HTTP request), in
    the order the engine emits them; ends when every request has finished. `close()` aborts the
    unfinished ones (a client that went away) and is safe to call more than once. A stream dropped
    without being closed (its handler never ran: the client left first) aborts them when collected."""

    def __init__(self, owner: AsyncEngine, request_ids: Sequence[str], queue: asyncio.Queue[Any]) -> None:
        self._owner = owner
        self._queue = queue
        self._unfinished = set(request_ids)
        abort_when_collected(self, owner._require_loop(), functools.partial(_abandon, owner, self._unfinished))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if item.error is not None:
                raise GenerationFailed(item.error)
        return item

    def close(self) -> None:
        if self._unfinished:
            self._owner.abort(sorted(self._unfinished))
            self._unfinished.clear()

    async def aclose(self) -> None:
        if self._unfinished:
            ids = sorted(self._unfinished)
            self._unfinished.clear()
            await self._owner.abort_and_wait(ids)


def _abandon(owner: AsyncEngine, unfinished: set[str]) -> None:
    """A RequestStream was collected with requests unfinished: abort them."""
    if unfinished:
        ids = sorted(unfinished)
        unfinished.clear()
        owner.abort(ids)


def abort_when_collected(stream: object, loop: asyncio.AbstractEventLoop, abort: Callable[[], None]) -> None:
    """When `stream` is garbage-collected (in whatever thread), run `abort` on `loop`: an output
    stream dropped unclosed (its handler never ran: the client left first) must not keep generating.
    `abort` must not refer to `stream`, and must do nothing for a stream that was closed."""
    def schedule() -> None:
        try:
            loop.call_soon_threadsafe(abort)
        except RuntimeError:  # the loop has closed: nothing runs any more
            pass

    weakref.finalize(stream, schedule).atexit = False


class _Reply(Generic[T]):
    """Delivers a result computed on the engine thread to an asyncio future on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.future: asyncio.Future[T] = loop.create_future()

    def set(self, value: T | None = None, error: BaseException | None = None) -> None:
        def deliver() -> None:
            if self.future.done():  # the awaiting handler was cancelled
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)  # type: ignore[arg-type]

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass


class AsyncEngine:
    """Owns an LLMEngine and steps it in a dedicated thread; async API for the HTTP handlers.

    `max_waiting`: once this many requests wait (in the scheduler's queue, or submitted but not yet
    added), `submit` raises QueueFullError. A group (n choices) is admitted whole while the queue is
    not full, so a large n is never refused forever.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int) -> None:
        self._engine = engine
        self._max_waiting = max_waiting
        self._inbox: deque[Command] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._draining = False  # event-loop side: shutdown has begun, new requests are refused
        self._lock = threading.Lock()  # guards _snapshot and _queued (both threads)
        self._queued = 0
        self._snapshot = EngineSnapshot(engine.stats(), _copy_spec(engine.draft_totals), 0, engine.speculation_stats())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._routes: dict[str, asyncio.Queue[Any]] = {}  # event-loop side only
        self._active: set[str] = set()  # engine-thread side only: added, not yet finished
        self._carried = 0  # engine-thread side only: requests in the add commands of this pass

    # -- lifecycle (event loop) --------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the thread (returns once it has ended)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():  # commands sent during the last pass; the engine is ours now
                self._run_commands(self._engine)
                self._abort(self._engine, sorted(self._active))
        for queue in set(self._routes.values()):
            queue.put_nowait(ServerShuttingDown("the server is shutting down"))  # a new instance per queue
        self._routes.clear()

    async def drain(self, timeout: float) -> None:
        """Shutdown, first part: refuse new requests, give those in flight up to `timeout` seconds to
        finish, then abort the rest; their callers get ServerShuttingDown, so every response ends
        (a stream with an error event) before the HTTP server stops waiting for them."""
        self._draining = True
        loop = self._require_loop()
        deadline = loop.time() + timeout
        while self._routes and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._routes:
            ids = sorted(self._routes)
            logger.warning("shutdown: aborting %d request(s) still running after %.3g s", len(ids), timeout)
            self._fail(ids, ServerShuttingDown("the server is shutting down; the request was aborted"))
            self._send(lambda engine: self._abort(engine, ids))
            await asyncio.sleep(0)  # let the handlers see their streams end

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def snapshot(self) -> EngineSnapshot:
        """Thread-safe: the state published after the engine thread's latest pass."""
        with self._lock:
            return replace(self._snapshot, queued=self._queued)

    # -- requests (event loop) ---------------------------------------------
    async def submit(self, requests: Sequence[EngineRequest]) -> RequestStream:
        """Add a group of requests (all or none); raises InvalidRequestError (bad input, from the
        engine's validation), QueueFullError or EngineError. Returns their output stream."""
        if self._draining:
            raise ServerShuttingDown("the server is shutting down")
        if not self.alive:
            raise EngineError("the engine is not running")
        ids = [r.request_id for r in requests]
        with self._lock:
            if self._snapshot.stats.num_waiting + self._queued >= self._max_waiting:
                raise QueueFullError(
                    f"too many requests waiting (at most {self._max_waiting}); retry later"
                )
            self._queued += len(requests)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for rid in ids:
            self._routes[rid] = queue
        reply: _Reply[None] = _Reply(self._require_loop())
        self._send(lambda engine: self._add(engine, requests, reply))
        try:
            await reply.future
        except asyncio.CancelledError:
            self.abort(ids)  # the add may have gone through; the abort comes after it
            raise
        except BaseException:
            for rid in ids:
                self._routes.pop(rid, None)
            raise
        return RequestStream(self, ids, queue)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop delivering outputs for these requests and abort them in the engine."""
        ids = list(request_ids)
        for rid in ids:
            self._routes.pop(rid, None)
        self._send(lambda engine: self._abort(engine, ids))

    async def abort_and_wait(self, request_ids: Sequence[str]) -> None:
        """`abort`, returning once the engine thread has aborted them and published a snapshot that
        shows it (at once if the engine thread is not running: nothing is left to wait for)."""
        ids = list(request_ids)
        for rid in ids:
            self._routes.pop(rid, None)
        if not self.alive:
            self._send(lambda engine: self._abort(engine, ids))
            return
        reply: _Reply[None] = _Reply(self._require_loop())

        def command(engine: LLMEngine) -> None:
            self._abort(engine, ids)
            self._publish(engine, 0)
            reply.set(None)

        self._send(command)
        await reply.future

    def _send(self, command: Command) -> None:
        self._inbox.append(command)
        self._wake.set()

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise EngineError("the engine loop has not been started")
        return self._loop

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: route each output to its request's queue."""
        for out in outputs:
            queue = self._routes.get(out.request_id)
            if queue is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            queue.put_nowait(out)

    def _fail(self, request_ids: list[str], error: EngineError) -> None:
        """On the event loop: end these requests' streams with an error like `error` (one each)."""
        for rid in request_ids:
            queue = self._routes.pop(rid, None)
            if queue is not None:
                queue.put_nowait(type(error)(*error.args))

    # -- the engine thread ---------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        while not self._stopping.is_set():
            added = self._run_commands(engine)
            if engine.has_unfinished_requests():
                self._step(engine)
            self._publish(engine, added)
            if not engine.has_unfinished_requests() and not self._inbox:
                self._wake.wait()
                self._wake.clear()
        self._run_commands(engine)  # aborts sent by handlers that finished during shutdown
        self._abort(engine, sorted(self._active))
        self._publish(engine, 0)

    def _run_commands(self, engine: LLMEngine) -> int:
        """Run every queued command; returns how many requests the adds among them carried."""
        self._carried = 0
        while self._inbox:
            command = self._inbox.popleft()
            try:
                command(engine)
            except Exception:  # noqa: BLE001 - a command must never take the thread down
                logger.exception("engine command failed")
        return self._carried

    def _add(self, engine: LLMEngine, requests: Sequence[EngineRequest], reply: _Reply[None]) -> None:
        self._carried += len(requests)
        added: list[str] = []
        try:
            for r in requests:
                engine.add_request(list(r.prompt_token_ids), r.params, r.request_id)
                added.append(r.request_id)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            for rid in added:
                engine.abort_request(rid)
            reply.set(error=e)
            return
        self._active.update(added)
        reply.set(None)

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        for rid in request_ids:
            try:
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - abort the others all the same
                logger.exception("aborting request %s failed", rid)
            self._active.discard(rid)

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except Exception:  # noqa: BLE001 - fail the requests in flight, keep serving
            logger.exception("engine step failed; aborting %d request(s)", len(self._active))
            failed = sorted(self._active)
            self._abort(engine, failed)
            self._post(self._fail, failed, EngineError("internal engine error; the request was aborted"))
            return
        for out in outputs:
            if out.finished:
                self._active.discard(out.request_id)
        if outputs:
            self._post(self._dispatch, outputs)

    def _publish(self, engine: LLMEngine, added: int) -> None:
        snapshot = EngineSnapshot(engine.stats(), _copy_spec(engine.draft_totals), 0, engine.speculation_stats())
        with self._lock:
            self._snapshot = snapshot
            self._queued -= added

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._require_loop().call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is gone (shutdown)
            pass
