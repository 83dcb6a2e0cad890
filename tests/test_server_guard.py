"""The connection guard's and the access policy's rules, on fake connections with a fake clock."""

from __future__ import annotations

import logging

import pytest

from specserve.server.guard import ConnectionGuard, ConnectionLimits, EventLog
from specserve.server.middleware import AccessPolicy, default_allowed_hosts, is_loopback


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_guard(max_connections: int = 3, header_timeout: float = 5.0) -> tuple[ConnectionGuard, Clock]:
    clock = Clock()
    return ConnectionGuard(ConnectionLimits(max_connections, header_timeout, log_interval=10.0), clock), clock


def test_a_connection_without_a_request_head_is_closed_after_the_timeout() -> None:
    guard, clock = make_guard()
    silent, partial, served = FakeTransport(), FakeTransport(), FakeTransport()
    guard.opened(("a", 1), silent)
    guard.opened(("a", 2), partial)
    guard.opened(("a", 3), served)
    guard.received(("a", 2))
    guard.request_started(("a", 3))
    clock.now += 4.9
    guard.sweep()
    assert not (silent.closed or partial.closed or served.closed)
    clock.now += 0.2
    guard.sweep()
    assert silent.closed and silent.written == b""  # nothing sent: just closed
    assert partial.closed and partial.written.startswith(b"HTTP/1.1 408")  # half a head: told why
    assert not served.closed  # a request being served never times out here, however long it streams


def test_the_timeout_restarts_when_a_response_ends() -> None:
    guard, clock = make_guard()
    t = FakeTransport()
    guard.opened(("a", 1), t)
    guard.request_started(("a", 1))
    clock.now += 60
    guard.request_finished(("a", 1))  # keep-alive: waiting for the next request from now on
    clock.now += 4
    guard.sweep()
    assert not t.closed
    clock.now += 2
    guard.sweep()
    assert t.closed


def test_a_parsed_request_is_not_idle_even_before_the_app_runs() -> None:
    guard, clock = make_guard()
    t = FakeTransport()
    guard.opened(("a", 1), t, serving=lambda: True)
    clock.now += 10
    guard.sweep()
    assert not t.closed


def test_at_the_cap_the_longest_idle_connection_makes_room_else_the_new_one_is_refused() -> None:
    guard, clock = make_guard(max_connections=2)
    old, busy = FakeTransport(), FakeTransport()
    guard.opened(("a", 1), old)
    clock.now += 1
    guard.opened(("a", 2), busy)
    guard.request_started(("a", 2))
    newcomer = FakeTransport()
    assert guard.opened(("a", 3), newcomer)
    assert old.closed and not busy.closed and not newcomer.closed
    guard.request_started(("a", 3))
    refused = FakeTransport()
    assert not guard.opened(("a", 4), refused)  # everyone is being served
    assert refused.closed and refused.written.startswith(b"HTTP/1.1 503")
    assert b"too_many_connections" in refused.written


def test_closed_connections_leave_the_books() -> None:
    guard, _ = make_guard(max_connections=1)
    t = FakeTransport()
    guard.opened(("a", 1), t)
    guard.closed(("a", 1), FakeTransport())  # another connection's close, same address: ignored
    guard.request_started(("a", 1))
    assert not guard.opened(("a", 2), FakeTransport())
    guard.closed(("a", 1), t)
    assert guard.opened(("a", 2), FakeTransport())


def test_events_are_logged_together_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = EventLog(10.0, clock)
    with caplog.at_level(logging.WARNING, logger="specserve.server"):
        for _ in range(500):
            log.add("timed out")
        log.add("refused", 3)
        assert log.flush() is None  # the interval has not passed
        clock.now += 10
        assert log.flush() == "timed out: 500; refused: 3"
        assert log.flush(force=True) is None  # nothing new
    assert len(caplog.records) == 1


def test_host_names_and_keys() -> None:
    local = AccessPolicy(allowed_hosts=default_allowed_hosts("127.0.0.1"))
    for host in ("localhost", "localhost:8000", "127.0.0.1:1", "[::1]:8000", "LOCALHOST", None):
        assert local.host_allowed(host), host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:80"):
        assert not local.host_allowed(host), host
    assert AccessPolicy(allowed_hosts=default_allowed_hosts("0.0.0.0")).host_allowed("anything:1")
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    keyed = AccessPolicy(api_key="k1")
    assert keyed.key_matches("Bearer k1") and keyed.key_matches("bearer k1")
    assert not keyed.key_matches("Bearer k2") and not keyed.key_matches("k1") and not keyed.key_matches(None)
    assert keyed.needs_key("/v1/models") and keyed.needs_key("/metrics") and not keyed.needs_key("/health")
    assert not AccessPolicy(api_key="k1", metrics_public=True).needs_key("/metrics")
    with pytest.raises(ValueError, match="api_key"):
        AccessPolicy(api_key=" ")
