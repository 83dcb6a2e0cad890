"""Request-rate sweeps: every rate against every server configuration.

A configuration is `NAME:SERVE_ARGS` (e.g. `suffix:--spec suffix`), started as a `specserve serve`
subprocess on a free port. By default each (configuration, rate) point gets a fresh server, so
every point starts with cold caches: the same prompts are sent at every rate, and a warm prefix
cache or suffix-drafter cache from the previous rate would otherwise make later rates look better
(`reuse_server` keeps one server per configuration, as a faster but biased option). Against a
server given by URL there is one configuration, named `server`.

With `rounds` above 1 the configurations are measured in turn rather than one after another: for
each round and rate every configuration's server is started fresh, all of them are up together
(idle but for the one measured), and they are measured in the order A B C, then C B A in the next
round. On a shared VM whose speed drifts by 10-15% over minutes (two `--spec none` servers measured
one after the other on a 2-core Xeon: 312 and 330 output tok/s, then 344 and 298), a configuration
measured later is judged on another machine; in turn, each configuration sees each stretch of the
run, and the medians over rounds say which is faster.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.datasets import Sample, TokenCounter
from specserve.bench.launcher import LaunchedServer, ServeCommand, check_serve_args
from specserve.bench.serve import LoadConfig, LoadGenerator, LoadRun

_NAME = re.compile(r"^[A-Za-z0-9_.+\-]+$")
EXTERNAL = "server"


def parse_rates(text: str) -> tuple[float, ...]:
    """`0.5,1,inf` -> (0.5, 1.0, inf); every rate > 0."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"request_rates: {part!r} is not a number (or inf)") from None
        if not rate > 0:
            raise ValueError(f"request_rates: every rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return tuple(rates)


@dataclass(frozen=True)
class ServerConfig:
    """A named server configuration: the `specserve serve` arguments it adds to the shared ones."""

    name: str
    serve_args: tuple[str, ...]

    @staticmethod
    def parse(text: str, shared_args: Sequence[str] = ()) -> ServerConfig:
        name, sep, args = text.partition(":")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"configs: {text!r} is not NAME:SERVE_ARGS (e.g. 'ngram:--spec ngram')")
        if not _NAME.match(name):
            raise ValueError(f"configs: name {name!r} may only use letters, digits and _ . + -")
        serve_args = (*shared_args, *shlex.split(args))
        check_serve_args(serve_args, f"configs[{name}]")
        return ServerConfig(name, serve_args)


@dataclass(frozen=True)
class SweepPlan:
    """What to run: the rates, and either server configurations to launch or one server's URL."""

    rates: tuple[float, ...]
    configs: tuple[ServerConfig, ...] = ()
    base_url: str | None = None
    reuse_server: bool = False
    startup_timeout_s: float = 600.0
    log_dir: Path | None = None
    rounds: int = 1  # above 1: the configurations measured in turn, each round on fresh servers

    def __post_init__(self) -> None:
        if not self.rates:
            raise ValueError("request_rates: give at least one rate")
        if self.rounds < 1:
            raise ValueError(f"rounds: must be >= 1, got {self.rounds}")
        if self.rounds > 1 and (self.base_url or self.reuse_server):
            raise ValueError("rounds: measures launched servers in turn, each round on fresh ones; "
                             "not with --base-url or --reuse-server")
        if bool(self.configs) == bool(self.base_url):
            raise ValueError("base_url: give exactly one of --base-url or server configurations to launch")
        names = [c.name for c in self.configs]
        if len(set(names)) != len(names):
            raise ValueError(f"configs: names must be unique, got {', '.join(names)}")

    @property
    def config_names(self) -> list[str]:
        return [c.name for c in self.configs] or [EXTERNAL]


@dataclass(frozen=True)
class SweepPoint:
    """One (configuration, rate) measurement."""

    config: str
    rate: float
    run: LoadRun
    server_command: str | None
    round: int = 0

    def row(self, load: LoadConfig, num_prompts: int) -> dict[str, object]:
        return {"config": self.config, "request_rate": self.rate, "round": self.round,
                "burstiness": load.arrivals.burstiness,
                "max_concurrency": load.max_concurrency, "num_prompts": num_prompts, **self.run.row(),
                "server_command": self.server_command, "requests": [r.record() for r in self.run.results]}


class Sweep:
    """Runs a plan: for each configuration, each rate, one load run of `samples`."""

    def __init__(self, plan: SweepPlan, load: LoadConfig, samples: Sequence[Sample],
                 count_tokens: TokenCounter | None = None,
                 on_point: Callable[[SweepPoint], None] | None = None) -> None:
        self.plan = plan
        self.load = load
        self.samples = list(samples)
        self._count = count_tokens
        self._on_point = on_point

    def run(self) -> list[SweepPoint]:
        if self.plan.log_dir is not None:
            return list(self._points(self.plan.log_dir))
        with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
            return list(self._points(Path(tmp)))

    def _points(self, log_dir: Path) -> Iterator[SweepPoint]:
        plan = self.plan
        if plan.base_url is not None:
            for rate in plan.rates:
                yield self._measure(EXTERNAL, rate, plan.base_url, None)
            return
        if plan.rounds > 1:
            yield from self._in_turn(log_dir)
            return
        for config in plan.configs:
            command = ServeCommand(config.serve_args)
            if plan.reuse_server:
                with LaunchedServer(command, log_dir / f"{config.name}.log", plan.startup_timeout_s) as server:
                    for rate in plan.rates:
                        yield self._measure(config.name, rate, server.base_url, server.shown_command)
                continue
            for rate in plan.rates:
                log = log_dir / f"{config.name}-rate{rate_label(rate)}.log"
                with LaunchedServer(command, log, plan.startup_timeout_s) as server:
                    yield self._measure(config.name, rate, server.base_url, server.shown_command)

    # A launched server collapses its weights into 2 MB pages on a thread of its own once it is up
    # (`--huge-pages auto`): measured before that, a configuration's first run would time 4 KB pages.
    # Wait for each server's log line saying it is through (`settled`), this long at most.
    SETTLE_S = 60.0

    def _in_turn(self, log_dir: Path) -> Iterator[SweepPoint]:
        """Every round and rate: all configurations' servers started fresh and up together, then
        measured in turn, the order reversed every other round."""
        plan = self.plan
        for r in range(plan.rounds):
            order = plan.configs if r % 2 == 0 else plan.configs[::-1]
            for rate in plan.rates:
                with ExitStack() as stack:
                    servers = {}
                    for config in plan.configs:
                        log = log_dir / f"{config.name}-rate{rate_label(rate)}-round{r}.log"
                        servers[config.name] = stack.enter_context(
                            LaunchedServer(ServeCommand(config.serve_args), log, plan.startup_timeout_s))
                    settled(list(servers.values()), self.SETTLE_S)
                    for config in order:
                        server = servers[config.name]
                        yield self._measure(config.name, rate, server.base_url, server.shown_command, r)

    def _measure(self, config: str, rate: float, base_url: str, command: str | None, round_: int = 0) -> SweepPoint:
        load = dataclasses.replace(
            self.load, base_url=base_url, arrivals=dataclasses.replace(self.load.arrivals, rate=rate),
            label=f"{config} @ {rate_label(rate)} req/s" + (f", round {round_ + 1}" if self.plan.rounds > 1 else ""))
        point = SweepPoint(config, rate, LoadGenerator(load, self._count).run(self.samples), command, round_)
        if self._on_point is not None:
            self._on_point(point)
        return point


COLLAPSING = "into huge pages in the background"  # a server's log line as its weights' collapse starts
COLLAPSED = "regions collapsed into huge pages"  # ... and as it is through (specserve.model.huge_pages)


def settled(servers: Sequence[LaunchedServer], timeout_s: float) -> None:
    """Wait until every server that started collapsing its weights into 2 MB pages (`--huge-pages
    auto` on a CPU whose kernel can) says it is through, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting and time.monotonic() < deadline:
        waiting = [s for s in waiting if COLLAPSING in (log := s.log_tail(1 << 20)) and COLLAPSED not in log]
        if waiting:
            time.sleep(0.5)


RATIO_FIELDS = ("output_throughput", "mean_tpot_ms", "p99_tpot_ms")  # judged against the first configuration


def median_rows(rows: Sequence[dict[str, object]], fields: Sequence[str]) -> list[dict[str, object]]:
    """Per (config, rate), in first-seen order: the median over rounds of each numeric field in
    `fields`, `rounds` (how many), and for each of RATIO_FIELDS `<field>_ratio`, the median over
    rounds of its value over the first configuration's in the same round and rate (the machine's
    drift between rounds divides out)."""
    def number(row: dict[str, object], name: str) -> float | None:
        value = row.get(name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    groups: dict[tuple[object, object], list[dict[str, object]]] = {}
    for row in rows:
        groups.setdefault((row["config"], row["request_rate"]), []).append(row)
    first = rows[0]["config"] if rows else None
    base = {(row["request_rate"], row.get("round")): row for row in rows if row["config"] == first}
    out = []
    for (config, rate), group in groups.items():
        merged: dict[str, object] = {"config": config, "request_rate": rate, "rounds": len(group)}
        for name in fields:
            values = [v for g in group if (v := number(g, name)) is not None]
            merged[name] = statistics.median(values) if values else None
        for name in RATIO_FIELDS:
            ratios = [v / b for g in group if (ref := base.get((rate, g.get("round")))) is not None
                      and (v := number(g, name)) is not None and (b := number(ref, name))]
            merged[f"{name}_ratio"] = statistics.median(ratios) if ratios else None
        out.append(merged)
    return out


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"

