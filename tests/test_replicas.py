"""Scale-out: routing by prefix affinity bounded by load (pure), and `specserve serve --replicas 2`
on a local Ray cluster: the single server's API, streaming and errors through two engine replicas,
conversations kept on one replica, a replica's death ending its requests with 503 (never a hang)
and the replica restarted, a replica that cannot load its model failing the start with its error."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from serverproc import MODEL, REPO, Server
from specserve.engine.engine import EngineStats
from specserve.entrypoints.llm import LLM
from specserve.outputs import DraftCounters
from specserve.sampling_params import SamplingParams
from specserve.server.engine_loop import EngineSnapshot, merge_snapshots
from specserve.server.routing import Router, RoutingConfig, prefix_keys
from specserve.speculation.speculator import SpeculationStats

HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 20}  # shared by every conversation


def messages_text(messages: list[dict[str, str]]) -> str:
    """A conversation as text whose prefixes are the text of its earlier turns (as a chat template's
    token ids are: the router keys either)."""
    return "".join(json.dumps(m, sort_keys=True) + "\n" for m in messages)


def conversation(k: int, turns: int) -> list[dict[str, str]]:
    msgs = [SYSTEM]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"conversation {k}, question {t}: " + "tell me more. " * 12})
        msgs.append({"role": "assistant", "content": f"answer {t} of conversation {k} " * 10})
    return msgs[:-1]


# -- routing (no Ray) -------------------------------------------------------------------------------


def test_prefix_keys_name_whole_prefixes() -> None:
    """Key i stands for blocks 0..i: a prompt's keys start with the keys of each of its prefixes, and
    two prompts that differ in block 0 share no key even where later blocks agree."""
    config = RoutingConfig(block_bytes=8)
    text = "abcdefgh" * 6
    keys = prefix_keys(text, config)
    assert len(keys) == 6 and prefix_keys(text[:20], config) == keys[:2]
    other = prefix_keys("Xbcdefgh" + text[8:], config)
    assert not set(keys) & set(other)
    assert prefix_keys(list(range(10)), config) == prefix_keys(list(range(10)) + [7], config)  # 4 bytes/id: 5 blocks
    assert len(prefix_keys(list(range(10)), config)) == 5
    turn1 = prefix_keys(messages_text(conversation(0, 1)), RoutingConfig())
    turn2 = prefix_keys(messages_text(conversation(0, 2)), RoutingConfig())
    assert turn2[:len(turn1)] == turn1 and len(turn2) > len(turn1)


def test_affinity_keeps_conversations_on_their_replica() -> None:
    """Once every replica holds the system prompt all conversations share, first turns spread by
    load, and each conversation's later turns go to the replica its first turn went to (matching
    more than the shared part)."""
    router = Router(RoutingConfig(), 2)
    shared = router.keys(messages_text([SYSTEM]))
    router.routed(0, shared)
    router.routed(1, shared)
    home: dict[int, int] = {}
    for turn in range(1, 4):
        loads = [0, 0]
        for k in range(6):
            keys = router.keys(messages_text(conversation(k, turn)))
            d = router.choose(keys, loads, [True, True])
            assert d is not None
            if turn == 1:
                home[k] = d.replica
            else:
                assert d.replica == home[k] and d.reason == "affinity", (k, turn, d)
                assert d.matched > len(shared)
            router.routed(d.replica, keys)
            loads[d.replica] += 1  # each conversation keeps one request open
        if turn == 1:
            assert sorted(home.values()).count(0) == 3


def test_cold_shared_prefix_concentrates_only_up_to_the_load_bound() -> None:
    """Before any replica holds the shared system prompt, first turns follow the one that does
    (it saves their prefill) until it runs balance_abs requests above the other."""
    router = Router(RoutingConfig(balance_abs=2), 2)
    loads = [0, 0]
    for k in range(8):
        keys = router.keys(messages_text(conversation(k, 1)))
        d = router.choose(keys, loads, [True, True])
        router.routed(d.replica, keys)
        loads[d.replica] += 1
    assert abs(loads[0] - loads[1]) <= 3 and min(loads) >= 2


def test_affinity_gives_way_to_load() -> None:
    """The best match is skipped when it runs more than max(balance_abs, balance_rel x least) above
    the least loaded replica, and taken at exactly that margin."""
    router = Router(RoutingConfig(balance_abs=4, balance_rel=0.5), 2)
    keys = router.keys("x" * 2048)
    router.routed(1, keys)
    assert router.choose(keys, [0, 4], [True, True]).replica == 1  # 4 - 0 <= 4
    d = router.choose(keys, [0, 5], [True, True])
    assert (d.replica, d.reason) == (0, "overloaded")
    assert router.choose(keys, [20, 30], [True, True]).replica == 1  # 10 <= 0.5 x 20
    assert router.choose(keys, [20, 31], [True, True]).replica == 0
    assert router.choose(keys, [0, 0], [True, False]).replica == 0  # an unusable replica is never chosen
    assert router.choose(keys, [0, 0], [False, False]) is None
    router.forget(1)  # restarted: its caches are gone
    assert router.choose(keys, [0, 0], [True, True]).reason == "least-loaded"


def test_other_policies_and_config_errors() -> None:
    rr = Router(RoutingConfig(policy="round-robin"), 3)
    assert [rr.choose([], [0] * 3, [True, False, True]).replica for _ in range(4)] == [0, 2, 0, 2]
    ll = Router(RoutingConfig(policy="least-loaded"), 3)
    assert ll.choose(ll.keys("y" * 999), [3, 1, 2], [True] * 3).replica == 1
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="block_bytes"):
        RoutingConfig(block_bytes=0)
    with pytest.raises(ValueError, match="replicas"):
        Router(RoutingConfig(), 0)


def test_prefix_index_is_bounded() -> None:
    """The router remembers at most max_keys_per_replica keys per replica, dropping the least recent."""
    router = Router(RoutingConfig(block_bytes=4, max_keys_per_replica=8), 1)
    old, new = router.keys("a" * 32), router.keys("b" * 32)
    router.routed(0, old)
    router.routed(0, new)
    assert router.keys_held(0) == 8
    assert router.choose(new, [0], [True]).matched == 8 and router.choose(old, [0], [True]).matched == 0
    # a chain loses its deepest keys first: what is left of it still matches from the start
    router.routed(0, old[:4])
    assert router.choose(new, [0], [True]).matched == 4 and router.choose(old, [0], [True]).matched == 4


def test_merged_snapshot_sums_engines() -> None:
    a = EngineSnapshot(EngineStats(1, 2, 3, 10, 8, 4, 0), DraftCounters(5, 3, 2, [2, 1]), 1,
                       SpeculationStats(steps=2, grants=((0, 1), (2, 3)), drafted_with=(("ngram", 2),)))
    b = EngineSnapshot(EngineStats(2, 0, 1, 10, 2, 2, 1), DraftCounters(1, 1, 1, [1]), 0,
                       SpeculationStats(steps=1, grants=((2, 1),), drafted_with=(("ngram", 1), ("suffix", 1))))
    m = merge_snapshots([a, b])
    assert m.stats == EngineStats(3, 2, 4, 20, 10, 6, 1) and m.stats.prefix_cache_hit_rate == 0.6
    assert (m.drafts.proposed, m.drafts.accepted, m.drafts.accepted_per_position) == (6, 4, [3, 1])
    assert m.control.grants == ((0, 1), (2, 4)) and m.control.drafted_with == (("ngram", 3), ("suffix", 1))
    assert m.num_waiting == 3 and merge_snapshots([]).stats.kv_blocks_total == 0


def test_replicas_without_ray_names_the_extra(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from specserve.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("ray") else real(name, *a))
    assert main(["serve", "--model", str(tiny_llama), "--replicas", "2"]) == 2
    assert "pip install 'specserve[ray]'" in capsys.readouterr().err


# -- the pool over scripted replicas (Ray imported, no cluster) ----------------------------------------


needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="Ray Serve not installed (pip install -e '.[ray]')")


class Feed:
    """A replica's output stream as a Serve handle returns it: lists pushed by the test, or an error."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def push(self, item: object) -> None:
        self.queue.put_nowait(item)

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> object:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class ScriptedReplica:
    """A DeploymentHandle of an EngineReplica: add() answers `first`; outputs() is a Feed the test
    fills; abort() is recorded."""

    def __init__(self, first: object) -> None:
        self.first = first
        self.adds: list[str] = []
        self.aborted: list[str] = []
        self.feed = Feed()
        self.add = types.SimpleNamespace(remote=self._add)
        self.abort = types.SimpleNamespace(remote=lambda sub, groups: self.aborted.extend(groups))
        self.outputs = types.SimpleNamespace(remote=lambda sub: self.feed)

    def options(self, **_: object) -> ScriptedReplica:
        return self

    async def _add(self, subscriber: str, group: str, requests: list[object]) -> object:
        self.adds.append(group)
        return self.first


def scripted_pool(*replicas: ScriptedReplica):  # type: ignore[no-untyped-def]
    from specserve.server.replicas import ReplicaPool

    return ReplicaPool([f"r{i}" for i in range(len(replicas))], list(replicas),  # type: ignore[arg-type]
                       Router(RoutingConfig(policy="round-robin"), len(replicas)))


def group_of(rid: str) -> list[types.SimpleNamespace]:
    return [types.SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2, 3], params=None)]


REQUEST = group_of("a")


@needs_ray
def test_pool_offers_a_request_to_the_next_replica_unless_it_is_invalid() -> None:
    """A full replica (429) or one going away passes the request on, and one going away is not routed
    to again; 429 is the answer only when every replica is full; a request the replica finds invalid
    is refused at once with its field, not offered to the others."""
    from specserve.errors import InvalidRequestError
    from specserve.server.engine_loop import QueueFullError
    from specserve.server.replica import ADMITTED, Refusal

    async def run() -> None:
        full, leaving, ok = Refusal("queue_full", "full"), Refusal("shutting_down", "bye"), ADMITTED
        pool = scripted_pool(ScriptedReplica(full), ScriptedReplica(full))
        with pytest.raises(QueueFullError):
            await pool.submit(REQUEST)
        assert [r.in_flight for r in pool.replicas()] == [0, 0]

        pool = scripted_pool(ScriptedReplica(leaving), ScriptedReplica(full))
        with pytest.raises(QueueFullError):
            await pool.submit(REQUEST)

        a, b = ScriptedReplica(leaving), ScriptedReplica(ok)
        pool = scripted_pool(a, b)
        stream = await pool.submit(REQUEST)
        assert [r.up for r in pool.replicas()] == [False, True] and [r.in_flight for r in pool.replicas()] == [0, 1]
        stream.close()
        await pool.submit(REQUEST)
        assert len(a.adds) == 1 and len(b.adds) == 2

        a, b = ScriptedReplica(Refusal("invalid", "too long", "prompt")), ScriptedReplica(ok)
        pool = scripted_pool(a, b)
        with pytest.raises(InvalidRequestError) as e:
            await pool.submit(REQUEST)
        assert e.value.field == "prompt" and not b.adds

    asyncio.run(run())


@needs_ray
def test_pool_demultiplexes_one_replica_stream_into_groups() -> None:
    """Outputs of several groups arrive mixed in the replica's messages; each stream gets its own,
    in order, and ends at its group's end (with the replica's error, if the group failed)."""
    from specserve.server.engine_loop import GenerationFailed
    from specserve.server.replica import ADMITTED, GroupEnd, Refusal

    async def run() -> None:
        replica = ScriptedReplica(ADMITTED)
        pool = scripted_pool(replica)
        x, y = await pool.submit(group_of("x")), await pool.submit(group_of("y"))
        kx, ky = replica.adds
        out = [types.SimpleNamespace(request_id=rid, step=k) for k in range(2) for rid in "xy"]
        replica.feed.push([out[0], out[1], out[2]])
        replica.feed.push([out[3], GroupEnd(ky, Refusal("failed", "boom")), GroupEnd(kx)])
        assert [o.step async for o in x] == [0, 1]
        assert (await y.__anext__()).step == 0 and (await y.__anext__()).step == 1
        with pytest.raises(GenerationFailed, match="boom"):
            await y.__anext__()
        assert pool.replicas()[0].in_flight == 0 and not replica.aborted

    asyncio.run(run())


@needs_ray
def test_pool_client_gone_is_not_a_replica_failure() -> None:
    """A reader cancelled while it waits, its stream closed right after (the order a non-streaming
    handler uses when its client hangs up), aborts the group in the replica and releases its load,
    and the replica stays up; a stream dropped before anyone read it does the same when collected."""
    from specserve.server.replica import ADMITTED

    async def run() -> None:
        replica = ScriptedReplica(ADMITTED)
        pool = scripted_pool(replica)
        stream = await pool.submit(REQUEST)
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        reader.cancel()
        stream.close()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert replica.aborted == replica.adds[:1]
        assert pool.replicas()[0].up and pool.replicas()[0].in_flight == 0

        stream = await pool.submit(REQUEST)
        assert pool.replicas()[0].in_flight == 1
        del stream
        gc.collect()
        await asyncio.sleep(0.01)
        assert replica.aborted == replica.adds and pool.replicas()[0].in_flight == 0 and pool.replicas()[0].up

    asyncio.run(run())


@needs_ray
def test_pool_replica_death_is_503_and_routes_around_it() -> None:
    """A replica whose actor dies mid-stream ends its streams with EngineUnavailable naming it and is
    not routed to until a health poll finds it again; the requests' load is released."""
    from ray.exceptions import ActorDiedError

    from specserve.server.engine_loop import EngineUnavailable
    from specserve.server.replica import ADMITTED

    async def run() -> None:
        dying, other = ScriptedReplica(ADMITTED), ScriptedReplica(ADMITTED)
        pool = scripted_pool(dying, other)
        stream = await pool.submit(REQUEST)
        dying.feed.push(ActorDiedError())
        with pytest.raises(EngineUnavailable, match="r0"):
            await stream.__anext__()
        assert [r.up for r in pool.replicas()] == [False, True] and [r.in_flight for r in pool.replicas()] == [0, 0]
        await pool.submit(REQUEST)
        await pool.submit(REQUEST)
        assert len(dying.adds) == 1 and len(other.adds) == 2

    asyncio.run(run())


@needs_ray
def test_replica_streams_every_group_to_its_subscriber_and_aborts_them_when_it_leaves(tiny_llama: Path) -> None:
    """The replica's side, in this process: two groups' outputs come mixed in one output stream, each
    request's last output finished and its group's end after it, greedy text equal to the engine's;
    when the subscription ends (its front end went away) the groups still running are aborted."""
    from specserve.entrypoints.engine_args import EngineArgs
    from specserve.server.engine_loop import EngineRequest
    from specserve.server.replica import ADMITTED, EngineReplica, GroupEnd

    replica = EngineReplica(EngineArgs(model=str(tiny_llama), max_model_len=1024), max_waiting=8)
    aborted: list[str] = []
    inner = replica._llm.engine
    abort = inner.abort_request
    inner.abort_request = lambda rid: (aborted.append(rid), abort(rid))[1]  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_llama), max_model_len=1024).generate(["one", "two"], greedy, use_tqdm=False)
    ids = {text: inner.tokenize(text) for text in ("one", "two", "three")}  # the front end sends token ids

    async def run() -> None:
        feed = replica.outputs("front")
        first = asyncio.ensure_future(feed.__anext__())
        assert await replica.add("front", "g1", [EngineRequest("r1", ids["one"], greedy)]) == ADMITTED
        assert await replica.add("front", "g2", [EngineRequest("r2", ids["two"], greedy)]) == ADMITTED
        items = await first  # both groups may have ended by the time the subscriber first reads
        ended = [i.group for i in items if isinstance(i, GroupEnd)]
        while len(ended) < 2:
            items += await feed.__anext__()
            ended = [i.group for i in items if isinstance(i, GroupEnd)]
        last = {i.request_id: i for i in items if not isinstance(i, GroupEnd)}
        assert [last["r1"].text, last["r2"].text] == [w.text for w in want]
        assert sorted(ended) == ["g1", "g2"] and all(i.refusal is None for i in items if isinstance(i, GroupEnd))
        long = SamplingParams(max_tokens=900, ignore_eos=True)
        assert await replica.add("front", "g3", [EngineRequest("r3", ids["three"], long)]) == ADMITTED
        assert any(i.request_id == "r3" for i in await feed.__anext__())  # running
        await feed.aclose()  # the subscriber is gone
        deadline = time.monotonic() + 1
        while aborted != ["r3"]:  # aborted, not run to its length (seconds)
            assert time.monotonic() < deadline, "the group of a departed subscriber kept running"
            await asyncio.sleep(0.02)

    try:
        asyncio.run(run())
    finally:
        replica._engine.stop()


# -- two replicas on a local Ray cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("replica-logs")
    server = Server(tiny_llama, logs / "replicas.log", "--replicas", "2", "--replica-cpus", "0.5",
                    "--max-model-len", "1024", "--ray-app-name", f"specserve-test-{os.getpid()}")
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        server.stop()


def replica_of_flight(server: Server) -> str | None:
    m = server.metrics()
    busy = [k for k, v in m.items() if k.startswith("specserve_replica_requests_in_flight") and v > 0]
    return busy[0].split('replica="')[1].rstrip('"}') if busy else None


@needs_ray
def test_same_api_and_outputs_through_replicas(cluster: Server, tiny_llama: Path) -> None:
    """Completions, chat and streaming answer as the single server does, greedy outputs equal to the
    engine's own, and bad input gets the same 400 naming its field (raised inside a replica)."""
    llm = LLM(str(tiny_llama), max_model_len=1024)
    prompts = [f"prompt number {i} " * 3 for i in range(4)]
    for p in prompts:
        want = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0].text
        got = cluster.openai.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        stream = cluster.openai.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    chat = cluster.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, n=2, temperature=0.8, seed=1)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 10
    too_long = cluster.http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000, "max_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text
    assert cluster.http.post("/v1/tokenize", json={"prompt": "abc"}).json()["count"] == 3
    assert cluster.http.get("/v1/models").json()["data"][0]["id"] == MODEL
    m = cluster.metrics()
    assert sorted(v for k, v in m.items() if k.startswith("specserve_replica_up")) == [1, 1]
    assert "specserve_router_prompt_blocks_total" in m
    # The engine gauges are the replicas' snapshots as last polled (every 0.5 s): under load the
    # poll before the last request may still be the newest, so wait for one after it.
    deadline = time.monotonic() + 30
    while m["vllm:num_requests_waiting"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        m = cluster.metrics()
    assert m["vllm:num_requests_waiting"] == 0


def _routed_to(server: Server, send: Callable[[], object]) -> str:
    """The replica the router sent `send()`'s request to (from the router's counters)."""
    def counts() -> dict[str, float]:
        return {k: v for k, v in server.metrics().items() if k.startswith("specserve_router_requests_total")}

    before = counts()
    send()
    moved = [k for k, v in counts().items() if v > before.get(k, 0)]
    assert len(moved) == 1, moved
    return moved[0].split('replica="')[1].split('"')[0]


@needs_ray
def test_conversation_turns_stay_on_one_replica(cluster: Server) -> None:
    """A conversation's second turn goes where its first went (its prompt's prefix is cached there)."""
    def chat(k: int, turns: int) -> Callable[[], object]:
        msgs = [{"role": "system", "content": "Be brief. " * 15}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"conversation {k} question {t} " * 9})
            msgs.append({"role": "assistant", "content": f"answer {t} " * 10})
        return lambda: cluster.openai.chat.completions.create(model=MODEL, messages=msgs[:-1], max_tokens=2)

    homes = {k: _routed_to(cluster, chat(k, 1)) for k in range(3)}
    time.sleep(1.5)  # replica snapshots arrive with the router's health poll (every 0.5 s)
    hits_before = cluster.metrics()["specserve_prefix_cache_hit_rate"]
    for k in range(3):
        assert _routed_to(cluster, chat(k, 2)) == homes[k]
    deadline = time.monotonic() + 10  # until the next health poll brings the replicas' counters
    while cluster.metrics()["specserve_prefix_cache_hit_rate"] <= hits_before:
        assert time.monotonic() < deadline, "the second turns found no cached prefix"
        time.sleep(0.2)


def _wait_idle_and_up(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Poll until no replica runs a request or holds a KV block; assert both replicas stayed up."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        assert sorted(v for k, v in m.items() if k.startswith("specserve_replica_up")) == [1, 1], server.log()
        if m["specserve_kv_blocks_used"] == 0 and m["specserve_num_requests_running"] == 0 and \
                replica_of_flight(server) is None:
            return m
        assert time.monotonic() < deadline, f"still busy: {m}\n{server.log()}"
        time.sleep(0.1)


@needs_ray
def test_client_gone_frees_replica_blocks(cluster: Server) -> None:
    """A stream the client drops, or a JSON answer it stops waiting for, is aborted in its replica:
    it stops running at once, no KV block stays held, and the replica is not taken for dead."""
    aborted = cluster.metrics().get('specserve_requests_total{status="abort"}', 0)
    with httpx.stream("POST", f"{cluster.base}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "drop me", "max_tokens": 900, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()  # held: a dropped line iterator would close the connection here
        for line in lines:
            if line.startswith("data: {"):
                break
        assert replica_of_flight(cluster) is not None
    _wait_idle_and_up(cluster)
    # a client that stops waiting for a JSON answer: it hangs up once its request runs in a replica
    # (hanging up on a clock instead counts no abort when a loaded machine has not started it yet)
    body = json.dumps({"model": MODEL, "prompt": "wait for me", "max_tokens": 900, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", cluster.port)) as impatient:
        impatient.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          + f"Authorization: {cluster.http.headers['Authorization']}\r\n".encode()
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while replica_of_flight(cluster) is None:
            assert time.monotonic() < deadline, cluster.log()
            time.sleep(0.05)
    deadline = time.monotonic() + 30  # the abort is counted once its cancellation has run
    while cluster.metrics()['specserve_requests_total{status="abort"}'] < aborted + 2:
        assert time.monotonic() < deadline, cluster.log()
        time.sleep(0.05)
    m = _wait_idle_and_up(cluster)
    assert m['specserve_requests_total{status="abort"}'] == aborted + 2
    assert "unavailable" not in cluster.log()


def _replica_pid(name: str) -> int:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if f"ServeReplica:{name}:" in line:
            return int(line.split()[0])
    raise AssertionError(f"no process for replica {name}:\n{out}")


@needs_ray
def test_replica_death_ends_its_requests_with_503_and_it_comes_back(cluster: Server) -> None:
    """Killing the replica in the middle of a stream ends that stream with an engine_unavailable
    error at once; new requests go to the other replica meanwhile; Serve restarts the dead one."""
    with httpx.stream("POST", f"{cluster.base}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "a long one", "max_tokens": 1000, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        victim = replica_of_flight(cluster)
        assert victim is not None
        os.kill(_replica_pid(victim), signal.SIGKILL)
        killed = time.monotonic()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert time.monotonic() - killed < 10
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == "engine_unavailable" and victim in errors[0]["message"], events[-2:]
    ok = cluster.openai.completions.create(model=MODEL, prompt="still serving", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert ok.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 240  # a new process importing torch: slow on a loaded machine
    while time.monotonic() < deadline:
        m = cluster.metrics()
        if m[f'specserve_replica_up{{replica="{victim}"}}'] == 1:
            break
        time.sleep(0.5)
    assert m[f'specserve_replica_up{{replica="{victim}"}}'] == 1, cluster.log()
    assert m[f'specserve_replica_restarts_total{{replica="{victim}"}}'] == 1


@needs_ray
def test_replica_that_cannot_load_fails_the_start_with_its_error(tmp_path: Path) -> None:
    """A model the replicas cannot load ends `serve --replicas` with that error, not a timeout."""
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--model", str(missing), "--replicas", "2",
                           "--replica-cpus", "0.5", "--port", "0", "--ray-app-name", f"specserve-bad-{os.getpid()}"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "failed to start" in proc.stderr and str(missing) in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 200
