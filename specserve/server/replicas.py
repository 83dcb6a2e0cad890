"""Engine replicas on Ray Serve behind one endpoint (`specserve serve --replicas N`).

Each replica is a Ray Serve application of one deployment with one replica (`EngineReplica`: an
AsyncEngine over its own model), so Serve places it, health-checks it and restarts it when it
dies, and this process can address every replica by name. The HTTP front end is the single
server's app over a `ReplicaPool`, an EngineClient that routes each request (specserve.server.routing),
adds it to the chosen replica, and turns a replica's death into 503s for its requests in flight.
Nothing here reaches into the engine beyond its public API and snapshots.

Outputs come back multiplexed: the pool holds one streaming call per replica (`outputs`), in which
the replica sends, per engine pass, one message with the outputs of every group the pool has open
on it; a message per request and token costs the replica's event loop (serialization, Ray's
streaming protocol) about as much CPU as the engine's own Python work at batch 16 on two cores.

Errors cross the process boundary as `Refusal` values, not pickled exceptions (an exception whose
constructor takes other arguments than its message does not survive Ray's serialization).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray import serve
from ray.exceptions import RayTaskError, TaskCancelledError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from specserve.engine.engine import LLMEngine
from specserve.entrypoints.engine_args import EngineArgs
from specserve.entrypoints.llm import LLM
from specserve.errors import InvalidRequestError
from specserve.outputs import RequestOutput
from specserve.server.app import ServedModel
from specserve.server.engine_loop import (
    AsyncEngine, EngineError, EngineRequest, EngineSnapshot, EngineUnavailable, GenerationFailed, QueueFullError,
    RequestStream, ServerShuttingDown, abort_when_collected, build_on_passing_thread, merge_snapshots,
)
from specserve.server.routing import Decision, Router, messages_text
from specserve.server.serving import ChatPrompt

logger = logging.getLogger("specserve.server")

T = TypeVar("T")
ADMITTED = "admitted"  # a replica's answer to add(): the requests are in its engine


@dataclass(frozen=True)
class Refusal:
    """An error raised in a replica, as a value: `kind` says which exception to raise here."""

    kind: str  # invalid | queue_full | shutting_down | failed | engine
    message: str
    field: str = ""

    @classmethod
    def of(cls, e: BaseException) -> Refusal:
        if isinstance(e, InvalidRequestError):
            return cls("invalid", e.message, e.field)
        if isinstance(e, QueueFullError):
            return cls("queue_full", str(e))
        if isinstance(e, ServerShuttingDown):
            return cls("shutting_down", str(e))
        if isinstance(e, GenerationFailed):
            return cls("failed", str(e))
        if isinstance(e, EngineError):
            return cls("engine", str(e))
        logger.exception("engine replica: unexpected error", exc_info=e)
        return cls("engine", f"internal engine error ({type(e).__name__})")

    def error(self, replica: str) -> Exception:
        if self.kind == "invalid":
            return InvalidRequestError(self.field, self.message)
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        if self.kind == "shutting_down":  # the replica is going away, not this server
            return EngineUnavailable(f"engine replica {replica} is shutting down; retry")
        if self.kind == "failed":
            return GenerationFailed(self.message)
        return EngineError(f"engine replica {replica}: {self.message}")


@dataclass(frozen=True)
class ReplicaState:
    """What a replica reports to the pool's health poll. `instance` changes when it restarts."""

    instance: str
    alive: bool
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class GroupEnd:
    """In a replica's output stream: the group has ended; refusal None when every request finished."""

    group: str
    refusal: Refusal | None = None


class _Outbox:
    """In a replica, one subscriber's outputs gathered between its reads, and its groups' pumps."""

    def __init__(self) -> None:
        self.items: list[RequestOutput | GroupEnd] = []
        self.wake = asyncio.Event()
        self.groups: dict[str, tuple[asyncio.Future[None], RequestStream]] = {}
        self.readers = 0  # subscriptions so far; the latest one reads

    def put(self, item: RequestOutput | GroupEnd) -> None:
        self.items.append(item)
        self.wake.set()

    def abort(self, groups: Sequence[str]) -> list[RequestStream]:
        """Stop these groups' pumps; returns their streams (closing one aborts its requests)."""
        streams = []
        for group in groups:
            entry = self.groups.pop(group, None)
            if entry is not None:
                pump, stream = entry
                pump.cancel()  # its stream closes: the engine aborts the requests
                streams.append(stream)
        return streams


async def _pump(box: _Outbox, group: str, stream: RequestStream) -> None:
    """Move one group's outputs into the outbox, then its end (with the error, if it failed)."""
    try:
        async for out in stream:
            box.put(out)
        box.put(GroupEnd(group))
    except asyncio.CancelledError:
        raise  # aborted by its subscriber: nobody to tell
    except Exception as e:  # noqa: BLE001 - handed to the pool
        box.put(GroupEnd(group, Refusal.of(e)))
    finally:
        stream.close()
        box.groups.pop(group, None)


class EngineReplica:
    """One engine, as a Ray Serve deployment (methods called through DeploymentHandles)."""

    def __init__(self, engine_args: EngineArgs, max_waiting: int) -> None:
        self._instance = uuid.uuid4().hex
        self._llm = build_on_passing_thread(lambda: LLM.from_engine_args(engine_args))
        self._engine = AsyncEngine(self._llm.engine, max_waiting)
        self._outboxes: dict[str, _Outbox] = {}  # by subscriber (a front end's pool)

    def _started(self) -> AsyncEngine:
        self._engine.start()  # binds the replica's event loop on the first call; a no-op after
        return self._engine

    def _outbox(self, subscriber: str) -> _Outbox:
        box = self._outboxes.get(subscriber)
        if box is None:
            box = self._outboxes[subscriber] = _Outbox()
        return box

    async def add(self, subscriber: str, group: str, requests: list[EngineRequest]) -> str | Refusal:
        """Admit a group of requests (all or none): ADMITTED, or the Refusal. Their outputs, then
        GroupEnd(group), go to the subscriber's output stream."""
        engine = self._started()
        try:
            stream = await engine.submit(requests)
        except Exception as e:  # noqa: BLE001 - handed to the pool
            return Refusal.of(e)
        box = self._outbox(subscriber)
        box.groups[group] = (asyncio.ensure_future(_pump(box, group, stream)), stream)
        return ADMITTED

    async def abort(self, subscriber: str, groups: list[str]) -> None:
        """The subscriber has no one to give these groups' outputs to (its client left)."""
        box = self._outboxes.get(subscriber)
        if box is not None:
            for stream in box.abort(groups):
                await stream.aclose()  # returns once the engine has freed their blocks

    async def outputs(self, subscriber: str) -> Any:
        """The subscriber's output stream: lists of whatever outputs (and GroupEnds) of all its
        groups arrived together, one message per engine pass rather than one per request and token.
        When the subscriber goes away (the call is cancelled), its groups are aborted."""
        self._started()
        box = self._outbox(subscriber)
        box.readers += 1
        me = box.readers
        try:
            while True:
                await box.wake.wait()
                box.wake.clear()
                items, box.items = box.items, []
                if items:
                    yield items
        finally:
            if box.readers == me:  # not superseded by a newer subscription of the same subscriber
                box.abort(list(box.groups))
                self._outboxes.pop(subscriber, None)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T | Refusal:
        try:
            return await self._started().call(fn)
        except Exception as e:  # noqa: BLE001 - handed to the pool
            return Refusal.of(e)

    async def state(self) -> ReplicaState:
        engine = self._started()
        return ReplicaState(self._instance, engine.alive, engine.snapshot())

    async def describe(self) -> ServedModel:
        return ServedModel.of(self._llm)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread ended is restarted."""
        if self._engine.started and not self._engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:  # Serve's graceful shutdown: abort what is left, stop the thread
        self._engine.stop()


@dataclass(frozen=True)
class ReplicaOptions:
    """How each replica is deployed. cpus/gpus: Ray resources per replica (its engine's threads
    default to its CPUs); max_waiting: requests waiting in a replica before it answers 429."""

    replicas: int
    app_prefix: str = "specserve"
    cpus: float = 1.0
    gpus: float = 0.0
    max_waiting: int = 256
    health_check_period_s: float = 2.0
    start_timeout_s: float = 900.0  # for every replica to be placed and load its model

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"replica_cpus/replica_gpus: must be >= 0, got {self.cpus}/{self.gpus}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"replica_start_timeout: must be > 0, got {self.start_timeout_s}")

    def names(self) -> list[str]:
        return [f"{self.app_prefix}-{i}" for i in range(self.replicas)]


class ReplicaStartError(RuntimeError):
    """A replica could not start (its model did not load): the message carries the replica's error."""


def _last_error_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    for line in reversed(lines):  # the exception line of the replica's traceback
        if ":" in line and not line.startswith(("File ", "^", "~")):
            return line
    return lines[-1] if lines else message


def deploy_replicas(engine_args: EngineArgs, options: ReplicaOptions) -> list[DeploymentHandle]:
    """Deploy the replicas (all at once) and wait until every one has loaded its model; raises
    ReplicaStartError with the error of the first replica that could not."""
    threads = engine_args.threads
    if threads is None and options.cpus >= 1:
        threads = int(options.cpus)  # Ray pins OMP_NUM_THREADS to the CPUs it grants; PyTorch must agree
    args = EngineArgs(**{**engine_args.__dict__, "threads": threads})
    deployment = serve.deployment(EngineReplica)
    targets = []
    for name in options.names():
        app = deployment.options(
            name=name, num_replicas=1,
            ray_actor_options={"num_cpus": options.cpus, "num_gpus": options.gpus},
            max_ongoing_requests=options.max_waiting + 4096,  # the engine queues and refuses, not Serve
            health_check_period_s=options.health_check_period_s, health_check_timeout_s=60.0,
            graceful_shutdown_timeout_s=10.0,
            logging_config={"enable_access_log": False, "log_level": "WARNING"},  # the front end logs requests
        ).bind(args, options.max_waiting)
        targets.append(serve.RunTarget(app, name=name, route_prefix=None))
    handles = list(serve.run_many(targets, wait_for_applications_running=False))
    _wait_running(options.names(), options.start_timeout_s)
    return handles


def _wait_running(names: Sequence[str], timeout: float, poll: float = 0.5) -> None:
    """Wait until every application runs; raise ReplicaStartError naming the first that failed (with
    its replica's error), or, after `timeout` seconds, those still starting and what Serve says."""
    deadline = time.monotonic() + timeout
    while True:
        apps = serve.status().applications
        pending = []
        for name in names:
            app = apps.get(name)
            status = str(app.status).rsplit(".", 1)[-1] if app is not None else "NOT_STARTED"
            if status == "RUNNING":
                continue
            if app is not None and status in ("DEPLOY_FAILED", "UNHEALTHY"):
                for dep in app.deployments.values():
                    if dep.message:
                        raise ReplicaStartError(f"engine replica {name} failed to start: "
                                                f"{_last_error_line(dep.message)}")
                raise ReplicaStartError(f"engine replica {name} failed to start: {app.message or status}")
            detail = "; ".join(d.message for d in app.deployments.values() if d.message) if app is not None else ""
            pending.append(f"{name} ({status}{': ' + _last_error_line(detail) if detail else ''})")
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise ReplicaStartError(f"engine replicas not running after {timeout:g} s: {', '.join(pending)} "
                                    "(is the cluster short of the CPUs/GPUs each replica asks for?)")
        time.sleep(poll)


def delete_replicas(options: ReplicaOptions) -> None:
    """Remove the replicas' applications from the cluster (without waiting for them to stop)."""
    for name in options.names():
        try:
            serve.delete(name, _blocking=False)
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            logger.warning("could not delete Serve application %s", name)


def _affinity_source(prompt: Any) -> str | list[int] | None:
    if isinstance(prompt, (str, list)):
        return prompt
    if isinstance(prompt, ChatPrompt):
        return messages_text(prompt.messages)
    return None


class _Replica:
    """The pool's view of one replica."""

    def __init__(self, name: str, handle: DeploymentHandle) -> None:
        self.name = name
        self.handle = handle
        self.up = True  # deployed and answering (until a call or a poll says otherwise)
        self.instance: str | None = None
        self.restarts = 0
        self.in_flight = 0  # engine requests this pool has open on it
        self.snapshot: EngineSnapshot | None = None


class _Lease:
    """A request group's hold on a replica: its outputs as they arrive from the replica's channel,
    and its requests counted in the replica's load until released (once)."""

    def __init__(self, pool: ReplicaPool, index: int, request_ids: Sequence[str]) -> None:
        self.pool = pool
        self.index = index
        self.key = uuid.uuid4().hex
        self.request_ids = list(request_ids)
        self.count = len(self.request_ids)
        self.queue: asyncio.Queue[RequestOutput | GroupEnd | BaseException] = asyncio.Queue()
        self.open = True
        self.shutdown = False  # ended for the server's shutdown

    def deliver(self, item: RequestOutput | GroupEnd | BaseException) -> None:
        if self.open:
            self.queue.put_nowait(item)

    def release(self) -> None:
        if self.open:
            self.open = False
            self.pool.released(self)

    def cancel(self) -> None:
        """Abort the group in its replica and release the hold."""
        if self.open:
            self.pool.abort(self)
            self.release()

    async def cancel_and_wait(self) -> None:
        """`cancel`, returning once the replica has aborted the group (or failed to answer: a dead
        replica aborts nothing)."""
        if self.open:
            done = self.pool.abort(self)
            self.release()
            try:
                await done
            except Exception:  # noqa: BLE001 - see above
                pass

    def shut_down(self) -> None:
        """End for the server's shutdown: its reader gets ServerShuttingDown."""
        if self.open:
            self.shutdown = True
            self.deliver(ServerShuttingDown("the server is shutting down; the request was aborted"))


def _is_replica_failure(error: BaseException) -> bool:
    """Did the replica (its actor) die, or stop answering? Not: an error raised by the call itself,
    or a call cancelled (by Serve, say while it shuts the replica down)."""
    return not isinstance(error, (RayTaskError, TaskCancelledError, RequestCancelledError))


class RemoteStream:
    """A replica's outputs of one group of requests (OutputStream). Dropped without being closed
    (the client left before its handler read it), it aborts the group when collected."""

    def __init__(self, lease: _Lease) -> None:
        self._lease = lease
        abort_when_collected(self, asyncio.get_running_loop(), lease.cancel)

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        lease = self._lease
        if not lease.open:
            raise StopAsyncIteration
        item = await lease.queue.get()
        if isinstance(item, BaseException):
            lease.cancel()
            raise item
        if isinstance(item, GroupEnd):
            lease.release()
            if item.refusal is not None:
                raise item.refusal.error(lease.pool.name(lease.index))
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        self._lease.cancel()

    async def aclose(self) -> None:
        await self._lease.cancel_and_wait()


class _Channel:
    """The one output stream the pool reads from a replica (every group's outputs, demultiplexed
    to their leases). When it breaks, every group open on the replica ends with EngineUnavailable."""

    def __init__(self, pool: ReplicaPool, index: int) -> None:
        self._pool = pool
        self._index = index
        self._leases: dict[str, _Lease] = {}  # by group key
        self._routes: dict[str, _Lease] = {}  # by request id
        self._reader: asyncio.Task[None] | None = None

    def open(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read())

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    def reset(self, failure: Exception) -> None:
        """The replica restarted: a stream from its old instance has nothing more to say."""
        self.close()
        for lease in list(self._leases.values()):
            lease.deliver(failure)

    def leases(self) -> list[_Lease]:
        """The groups open on the replica, admitted or being admitted."""
        return list(self._leases.values())

    def add(self, lease: _Lease) -> None:
        self._leases[lease.key] = lease
        for rid in lease.request_ids:
            self._routes[rid] = lease

    def remove(self, lease: _Lease) -> None:
        self._leases.pop(lease.key, None)
        for rid in lease.request_ids:
            self._routes.pop(rid, None)

    async def _read(self) -> None:
        pool, index = self._pool, self._index
        gen: DeploymentResponseGenerator = (pool.replicas()[index].handle.options(stream=True)
                                            .outputs.remote(pool.subscriber))
        error: BaseException | None = None
        try:
            async for items in gen:
                for item in items:
                    lease = self._leases.get(item.group) if isinstance(item, GroupEnd) else \
                        self._routes.get(item.request_id)
                    if lease is not None:
                        lease.deliver(item)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - sorted out below
            error = e
        name = pool.name(index)
        if error is not None and not _is_replica_failure(error):
            logger.error("engine replica %s: its output stream failed: %s", name,
                         str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
            failure: Exception = EngineUnavailable(f"engine replica {name} failed the request; retry")
        else:
            pool.lost(index, error or EngineUnavailable("its output stream ended"))
            failure = EngineUnavailable(f"engine replica {name} failed while generating; the request was "
                                        "aborted (it is being restarted): retry")
        for lease in list(self._leases.values()):
            lease.deliver(failure)


class ReplicaPool:
    """EngineClient over engine replicas: routes, streams, tracks health and load.

    Health: each replica is polled every `poll_interval` s (its state: alive, snapshot, instance);
    one that fails a poll or a call is not routed to until a poll answers again, and one that
    answers with a new instance (Serve restarted it) has lost its caches, so the router forgets it.
    `admit_timeout`: seconds a replica has to admit a request before the pool tries another (a
    handle to a replica being restarted would otherwise wait for it)."""

    def __init__(self, names: Sequence[str], handles: Sequence[DeploymentHandle], router: Router,
                 poll_interval: float = 0.5, admit_timeout: float = 30.0, call_timeout: float = 60.0) -> None:
        if len(names) != len(handles) or len(handles) != router.num_replicas:
            raise ValueError("replicas: names, handles and router disagree on the number of replicas")
        self._replicas = [_Replica(n, h) for n, h in zip(names, handles)]
        self._router = router
        self._poll_interval = poll_interval
        self._admit_timeout = admit_timeout
        self._call_timeout = call_timeout
        self._channels = [_Channel(self, i) for i in range(len(self._replicas))]  # hold the open groups
        self.subscriber = uuid.uuid4().hex  # this pool, to the replicas
        self._poller: asyncio.Task[None] | None = None
        self._draining = False
        self._stopped = False
        self.decisions: dict[tuple[int, str], int] = {}  # (replica, reason) -> requests
        self.prompt_blocks = 0  # routing blocks of the prompts routed
        self.matched_blocks = 0  # of those, held by the replica they went to (by the router's index)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll_forever())

    def stop(self) -> None:
        self._stopped = True
        if self._poller is not None:
            self._poller.cancel()
        for lease in self._open_leases():
            lease.shut_down()
        for channel in self._channels:
            channel.close()

    async def drain(self, timeout: float) -> None:
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._open_leases() and loop.time() < deadline:  # admissions in progress count too
            await asyncio.sleep(0.05)
        if leases := self._open_leases():
            logger.warning("shutdown: aborting %d request group(s) still running after %.3g s", len(leases), timeout)
            for lease in leases:
                lease.shut_down()
            await asyncio.sleep(0)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def alive(self) -> bool:
        return not self._stopped and any(r.up for r in self._replicas)

    def snapshot(self) -> EngineSnapshot:
        return merge_snapshots([r.snapshot for r in self._replicas if r.snapshot is not None])

    def name(self, index: int) -> str:
        return self._replicas[index].name

    # -- requests ----------------------------------------------------------------
    async def submit(self, requests: Sequence[EngineRequest]) -> RemoteStream:
        if self._draining:
            raise ServerShuttingDown("the server is shutting down")
        source = _affinity_source(requests[0].prompt) if requests else None
        keys = self._router.keys(source) if source is not None else []
        return await self._admit(requests, keys)

    async def _admit(self, requests: Sequence[EngineRequest], keys: Sequence[bytes]) -> RemoteStream:
        """Offer the group to replicas in the router's order until one admits it. A replica that is
        down, full or going away is passed over; an invalid request is refused at the first."""
        tried: set[int] = set()
        full: Exception | None = None  # a replica's 429: the answer when every replica refused
        last: Exception = EngineUnavailable("no engine replica is available; retry later")
        while True:
            usable = [r.up and i not in tried for i, r in enumerate(self._replicas)]
            decision = self._router.choose(keys, [r.in_flight for r in self._replicas], usable)
            if decision is None:
                raise full or last
            i = decision.replica
            tried.add(i)
            replica = self._replicas[i]
            channel = self._channels[i]
            channel.open()
            lease = _Lease(self, i, [r.request_id for r in requests])
            channel.add(lease)  # before the add: outputs may come before its answer
            replica.in_flight += lease.count
            try:
                first = await asyncio.wait_for(replica.handle.add.remote(self.subscriber, lease.key, list(requests)),
                                               self._admit_timeout)
            except asyncio.CancelledError:
                lease.cancel()  # the add may have gone through
                raise
            except Exception as e:  # noqa: BLE001 - dead, restarting or stuck: try another replica
                lease.cancel()
                self.lost(i, e)
                last = EngineUnavailable(f"engine replica {replica.name} is unavailable; retry later")
                continue
            if isinstance(first, Refusal):
                lease.release()
                last = first.error(replica.name)
                if first.kind == "queue_full":
                    full = last  # another replica may have room
                    continue
                if first.kind in ("shutting_down", "engine"):  # this replica is going away or broken
                    self.lost(i, last)
                    continue
                raise last
            self._record(decision, keys)
            return RemoteStream(lease)

    def _open_leases(self) -> list[_Lease]:
        return [lease for channel in self._channels for lease in channel.leases()]

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        usable = [i for i, r in enumerate(self._replicas) if r.up]
        if not usable:
            raise EngineUnavailable("no engine replica is available; retry later")
        i = min(usable, key=lambda k: self._replicas[k].in_flight)
        replica = self._replicas[i]
        try:
            result = await asyncio.wait_for(replica.handle.call.remote(fn), self._call_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self.lost(i, e)
            raise EngineUnavailable(f"engine replica {replica.name} is unavailable; retry later") from None
        if isinstance(result, Refusal):
            raise result.error(replica.name)
        return result  # type: ignore[no-any-return]

    def _record(self, decision: Decision, keys: Sequence[bytes]) -> None:
        self._router.routed(decision.replica, keys)
        key = (decision.replica, decision.reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.prompt_blocks += len(keys)
        self.matched_blocks += decision.matched

    def released(self, lease: _Lease) -> None:
        self._channels[lease.index].remove(lease)
        self._replicas[lease.index].in_flight -= lease.count

    def abort(self, lease: _Lease) -> Any:
        """Tell the lease's replica to abort its group; returns the call's response (awaitable)."""
        return self._replicas[lease.index].handle.abort.remote(self.subscriber, [lease.key])

    def lost(self, index: int, error: BaseException) -> str:
        """A call to replica `index` failed: route around it until a poll finds it again."""
        replica = self._replicas[index]
        if replica.up:
            logger.warning("engine replica %s is unavailable (%s: %s)", replica.name, type(error).__name__,
                           str(error).splitlines()[0] if str(error) else "")
        replica.up = False
        replica.snapshot = None  # its load and cache no longer count in the merged metrics
        return replica.name

    # -- health ------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(i) for i in range(len(self._replicas))))
            await asyncio.sleep(self._poll_interval)

    async def _poll(self, index: int) -> None:
        replica = self._replicas[index]
        try:
            state: ReplicaState = await asyncio.wait_for(replica.handle.state.remote(),
                                                         max(1.0, 4 * self._poll_interval))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - dead or restarting
            self.lost(index, e)
            return
        if replica.instance is not None and state.instance != replica.instance:
            replica.restarts += 1
            self._router.forget(index)
            self._channels[index].reset(EngineUnavailable(f"engine replica {replica.name} restarted; the request "
                                                          "was aborted: retry"))
            logger.warning("engine replica %s restarted; its caches are empty", replica.name)
        if not replica.up and state.alive:
            logger.info("engine replica %s is back", replica.name)
        replica.instance = state.instance
        replica.up = state.alive
        replica.snapshot = state.snapshot

    async def refresh(self) -> None:
        """Poll every replica once now (before serving, and in tests)."""
        await asyncio.gather(*(self._poll(i) for i in range(len(self._replicas))))

    def collector(self) -> Collector:
        return PoolCollector(self)

    def replicas(self) -> list[_Replica]:
        return list(self._replicas)

    @property
    def router(self) -> Router:
        return self._router


class PoolCollector(Collector):
    """Per-replica gauges and the router's decisions, for the front end's /metrics."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        replicas = pool.replicas()
        up = GaugeMetricFamily("specserve_replica_up", "1 if the replica answers and its engine runs",
                               labels=["replica"])
        flight = GaugeMetricFamily("specserve_replica_requests_in_flight", "Engine requests the router has open on "
                                   "the replica", labels=["replica"])
        running = GaugeMetricFamily("specserve_replica_num_requests_running", "Requests running in the replica's "
                                    "engine", labels=["replica"])
        waiting = GaugeMetricFamily("specserve_replica_num_requests_waiting", "Requests waiting in the replica's "
                                    "engine", labels=["replica"])
        kv = GaugeMetricFamily("specserve_replica_kv_cache_usage_perc", "Fraction of the replica's KV blocks in use",
                               labels=["replica"])
        hits = GaugeMetricFamily("specserve_replica_prefix_cache_hit_rate", "The replica's prefix cache hit rate "
                                 "(prompt tokens found / looked up) since it started", labels=["replica"])
        restarts = CounterMetricFamily("specserve_replica_restarts", "Times the router saw the replica come back as "
                                       "a new instance", labels=["replica"])
        keys = GaugeMetricFamily("specserve_router_prefix_keys", "Prefix keys the router remembers for the replica",
                                 labels=["replica"])
        for i, r in enumerate(replicas):
            up.add_metric([r.name], 1.0 if r.up else 0.0)
            flight.add_metric([r.name], r.in_flight)
            restarts.add_metric([r.name], r.restarts)
            keys.add_metric([r.name], pool.router.keys_held(i))
            if r.snapshot is not None:
                stats = r.snapshot.stats
                running.add_metric([r.name], stats.num_running)
                waiting.add_metric([r.name], r.snapshot.num_waiting)
                kv.add_metric([r.name], stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
                hits.add_metric([r.name], stats.prefix_cache_hit_rate)
        yield from (up, flight, running, waiting, kv, hits, restarts, keys)
        decisions = CounterMetricFamily("specserve_router_requests", "Requests routed, by replica and reason "
                                        "(affinity, overloaded, least-loaded, round-robin)",
                                        labels=["replica", "reason"])
        for (i, reason), n in sorted(pool.decisions.items()):
            decisions.add_metric([replicas[i].name, reason], n)
        yield decisions
        yield CounterMetricFamily("specserve_router_prompt_blocks", "Routing blocks of the prompts routed",
                                  value=pool.prompt_blocks)
        yield CounterMetricFamily("specserve_router_matched_blocks", "Of those, blocks the chosen replica had been "
                                  "sent before (by the router's index)", value=pool.matched_blocks)


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address` (None: start a local one, which ends with this process) and
    start Serve there without its HTTP proxy (this process answers HTTP). True if the cluster is local."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(proxy_location="Disabled")
    return address is None


def disconnect(options: ReplicaOptions, local: bool) -> None:
    """After serving: a cluster of our own goes down with its replicas; on a shared cluster the
    replicas' applications are deleted."""
    if not local:
        delete_replicas(options)
    ray.shutdown()
