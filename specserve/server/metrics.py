"""Prometheus metrics, one private registry per app (no global state).

Per-request series (counters, histograms) are updated by the handlers as requests finish; the
engine's gauges and speculation counters are read at scrape time from the snapshot the engine
thread publishes after every pass, so a scrape never touches the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.outputs import RequestOutput
from specserve.server.engine_loop import EngineSnapshot
from specserve.speculation.speculator import SpeculationStats

if TYPE_CHECKING:
    from specserve.server.replicas import ReplicaPool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_STATUSES = ("success", "error", "abort")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0)


def _kv_usage(snap: EngineSnapshot) -> float:
    total = snap.stats.kv_blocks_total
    return snap.stats.kv_blocks_used / total if total else 0.0


class RouterProtocolCollector(Collector):
    """The gauges an inference gateway's endpoint picker scrapes to route between model servers
    (the Gateway API Inference Extension's model-server protocol: queued requests, running requests,
    KV-cache utilization as a fraction, the KV block size for prefix-aware routing), under the names
    its reference picker reads by default (vLLM's), so llm-d or KServe route `specserve serve` pods
    without metric-name flags."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], block_size: int) -> None:
        self._snapshot = snapshot
        self._block_size = block_size

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled (specserve)",
                                value=snap.num_waiting)
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch (specserve)",
                                value=snap.stats.num_running)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1 (specserve)",
                                value=_kv_usage(snap))
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (specserve)",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(self._block_size), str(snap.stats.kv_blocks_total)], 1.0)
        yield info


# An engine's gauges, by name after "specserve_" (a replica's after "specserve_replica_"): help, value.
ENGINE_GAUGES: tuple[tuple[str, str, Callable[[EngineSnapshot], float]], ...] = (
    ("num_requests_running", "Requests running in the engine", lambda s: s.stats.num_running),
    ("num_requests_waiting", "Requests waiting: in the scheduler's queue or submitted to the engine thread",
     lambda s: s.num_waiting),
    ("kv_blocks_used", "KV cache blocks held by requests", lambda s: s.stats.kv_blocks_used),
    ("kv_blocks_total", "KV cache blocks", lambda s: s.stats.kv_blocks_total),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)", _kv_usage),
    ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up, since start",
     lambda s: s.stats.prefix_cache_hit_rate),
)


class EngineCollector(Collector):
    """Engine gauges and speculation totals from the latest published snapshot."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        stats, spec = snap.stats, snap.drafts
        for name, help_text, value in ENGINE_GAUGES:
            yield GaugeMetricFamily(f"specserve_{name}", help_text, value=value(snap))
        yield CounterMetricFamily("specserve_num_preemptions", "Requests preempted (to be recomputed)",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("specserve_spec_draft_tokens", "Draft tokens proposed", value=spec.proposed)
        yield CounterMetricFamily("specserve_spec_accepted_tokens", "Draft tokens accepted", value=spec.accepted)
        yield CounterMetricFamily("specserve_spec_verification_steps",
                                  "Decode steps that verified a draft", value=spec.steps)
        by_position = CounterMetricFamily("specserve_spec_accepted_tokens_by_position",
                                          "Draft tokens accepted at each depth (1 = first draft token)",
                                          labels=["position"])
        for depth, count in enumerate(spec.accepted_per_position, start=1):
            by_position.add_metric([str(depth)], count)
        yield by_position
        yield from _control_metrics(snap.control)


def _control_metrics(c: SpeculationStats) -> Iterator[Metric]:
    """What the speculation controller granted, how well it predicted acceptance and step time."""
    grants = dict(c.grants)
    edges = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
    yield HistogramMetricFamily(
        "specserve_spec_grant_tokens", "Draft tokens the controller gave a decoding request in a step (0 = plain)",
        buckets=[(str(le), sum(n for k, n in grants.items() if k <= le)) for le in edges]
        + [("+Inf", sum(grants.values()))],
        sum_value=sum(k * n for k, n in grants.items()),
    )
    yield CounterMetricFamily("specserve_spec_predicted_accepted_tokens",
                              "Accepted draft tokens the controller expected of the nodes it kept",
                              value=c.predicted_accepted)
    yield CounterMetricFamily("specserve_spec_controller_accepted_tokens",
                              "Accepted draft tokens of the nodes the controller kept (compare with predicted)",
                              value=c.accepted)
    yield CounterMetricFamily("specserve_spec_cost_predicted_seconds",
                              "Step time the cost model predicted, summed over the steps it predicted",
                              value=c.cost_predicted_seconds)
    yield CounterMetricFamily("specserve_spec_cost_measured_seconds",
                              "Measured time of the same steps (drafting excluded)", value=c.cost_actual_seconds)
    yield GaugeMetricFamily("specserve_spec_cost_model_relative_error",
                            "Sum of |predicted - measured| / sum of measured step time, since start",
                            value=c.cost_relative_error)
    by_drafter = CounterMetricFamily("specserve_spec_drafted_requests",
                                     "Request-steps verified with each drafter's tree", labels=["drafter"])
    for name, n in c.drafted_with:
        by_drafter.add_metric([name], n)
    yield by_drafter
    yield CounterMetricFamily("specserve_spec_guard_plain_steps",
                              "Decode steps the goodput guard kept plain (drafts delivered fewer tokens per second "
                              "at that batch shape, or a control step)", value=c.guard_plain_steps)
    yield CounterMetricFamily("specserve_spec_guard_probes",
                              "Steps the guard drafted on to measure whether drafts pay again", value=c.guard_probes)
    yield CounterMetricFamily("specserve_spec_guard_turned_off",
                              "Times a drafter was switched off at a batch shape by measurement",
                              value=c.guard_turned_off)


class PoolCollector(Collector):
    """Per-replica engine gauges (ENGINE_GAUGES, from each replica's latest snapshot) and the
    router's decisions, for the replicas' front end's /metrics."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        replicas = pool.replicas()
        up = GaugeMetricFamily("specserve_replica_up", "1 if the replica answers and its engine runs",
                               labels=["replica"])
        flight = GaugeMetricFamily("specserve_replica_requests_in_flight", "Engine requests the router has open on "
                                   "the replica", labels=["replica"])
        engine = [(GaugeMetricFamily(f"specserve_replica_{name}", f"{help_text}, by replica", labels=["replica"]), value)
                  for name, help_text, value in ENGINE_GAUGES]
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
                for family, value in engine:
                    family.add_metric([r.name], value(r.snapshot))
        yield from (up, flight, *(family for family, _ in engine), restarts, keys)
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


class ServerMetrics:
    """The app's registry and its per-request series."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], block_size: int,
                 collectors: Sequence[Collector] = ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specserve_requests", "Generation requests by outcome (success, error, abort)",
                                ["status"], registry=r)
        for status in REQUEST_STATUSES:
            self.requests.labels(status=status)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of engine requests (each choice counts its prompt)",
                                     registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Arrival to last token, per engine request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(snapshot))
        r.register(RouterProtocolCollector(snapshot, block_size))
        for collector in collectors:
            r.register(collector)

    def request_done(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def output_finished(self, out: RequestOutput) -> None:
        """Record a finished engine request (one choice)."""
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.finish_time is not None and m.first_token_time is not None and len(out.token_ids) > 1:
            self.tpot.observe((m.finish_time - m.first_token_time) / (len(out.token_ids) - 1))

    def output_aborted(self, out: RequestOutput) -> None:
        """Record the tokens of an engine request aborted before it finished (client gone)."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)
