"""Engine replicas on Ray Serve behind one endpoint (`specserve serve --replicas N`): the front end's side.

Each replica (specserve.server.replica: `EngineReplica`, an AsyncEngine over its own model, and
how N of them are deployed) is addressed by name. The HTTP front end is the single
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
import uuid
from typing import Any, Sequence

from ray.exceptions import RayTaskError, TaskCancelledError
from ray.serve.exceptions import RequestCancelledError
from prometheus_client.registry import Collector
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from specserve.outputs import RequestOutput
from specserve.server.engine_loop import (
    EngineRequest, EngineSnapshot, EngineUnavailable, ServerShuttingDown, abort_when_collected, merge_snapshots,
)
from specserve.server.metrics import PoolCollector
from specserve.server.replica import GroupEnd, Refusal, ReplicaState
from specserve.server.routing import Decision, Router

logger = logging.getLogger("specserve.server")

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
                 poll_interval: float = 0.5, admit_timeout: float = 30.0) -> None:
        if len(names) != len(handles) or len(handles) != router.num_replicas:
            raise ValueError("replicas: names, handles and router disagree on the number of replicas")
        self._replicas = [_Replica(n, h) for n, h in zip(names, handles)]
        self._router = router
        self._poll_interval = poll_interval
        self._admit_timeout = admit_timeout
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
        source = requests[0].prompt_token_ids if requests else None
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
