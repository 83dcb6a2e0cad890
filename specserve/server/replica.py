"""One engine replica on Ray Serve, and the deployment of N of them (`specserve serve --replicas N`).

Each replica is a Ray Serve application of one deployment with one replica (`EngineReplica`: an
AsyncEngine over its own model), so Serve places it, health-checks it and restarts it when it
dies, and the front end can address every replica by name (specserve.server.replicas holds the
front end's pool). The front end and a replica exchange data only: requests as token ids and
sampling parameters (`add`: EngineRequests; the front end tokenized them), aborts by request id,
outputs (`outputs`: multiplexed, per engine pass one message with the RequestOutputs of every group
the pool has open on it), state snapshots (`state`) and, once, what the model is (`describe`).

Errors cross the process boundary as `Refusal` values, not pickled exceptions (an exception whose
constructor takes other arguments than its message does not survive Ray's serialization).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.entrypoints.engine_args import EngineArgs
from specserve.entrypoints.llm import LLM
from specserve.errors import InvalidRequestError
from specserve.outputs import RequestOutput
from specserve.server.app import ServedModel
from specserve.server.engine_loop import (
    AsyncEngine, EngineError, EngineRequest, EngineSnapshot, EngineUnavailable, GenerationFailed, QueueFullError,
    RequestStream, ServerShuttingDown, build_on_passing_thread,
)

logger = logging.getLogger("specserve.server")

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
            # a replica that cannot load its model (a bad path, too little memory) fails the same way
            # again: Serve's default retries (three a replica, each a new process importing torch) only
            # delay the error the user waits for
            max_constructor_retry_count=1,
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
