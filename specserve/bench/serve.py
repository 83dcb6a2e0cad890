"""Load generator for any OpenAI-compatible server: streamed `/v1/completions` requests on a
Poisson or gamma arrival schedule, and the latency/throughput figures computed from them.

Per request: TTFT (send to first streamed text), ITL (gaps between streamed text chunks: with
speculation one chunk may carry several tokens), TPOT ((end-to-end - TTFT) / (output tokens - 1),
over requests with more than one token) and end-to-end latency. Output tokens are the server's
`usage.completion_tokens` (asked for with `stream_options.include_usage`), else the generated
text's token count, else the number of chunks. Speculation counters come from `/metrics`
(specserve's `specserve_spec_*` or vLLM's `vllm:spec_decode_*`), scraped before and after the run;
a server without them just reports none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.bench.datasets import Sample, TokenCounter
from specserve.bench.report import progress

if TYPE_CHECKING:  # imported where used: `specserve serve` builds the bench parsers too
    import httpx

SLO_METRICS = ("ttft", "tpot", "e2el")


class ServerUnusable(RuntimeError):
    """The server did not answer a warm-up request properly; the message says what it answered."""


# --------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Arrivals:
    """When requests are sent: gaps drawn from a gamma distribution with shape `burstiness` and
    mean 1 / `rate` (burstiness 1 is a Poisson process; lower is burstier); rate inf sends every
    request at once."""

    rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0):
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness: must be a finite number > 0, got {self.burstiness}")

    def gaps(self, n: int) -> list[float]:
        """`n` seeded gaps between consecutive requests, in seconds."""
        if math.isinf(self.rate):
            return [0.0] * n
        rng = random.Random(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        return [rng.gammavariate(self.burstiness, scale) for _ in range(n)]

    def offsets(self, n: int) -> list[float]:
        """Send time of each of `n` requests after the start; the first goes at 0."""
        out, t = [], 0.0
        for gap in self.gaps(n):
            out.append(t)
            t += gap
        return out


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; a request is good when it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @staticmethod
    def parse(text: str | None) -> SLO:
        """`ttft:500,tpot:50` (any of ttft, tpot, e2el; milliseconds)."""
        if not text:
            return SLO()
        values: dict[str, float] = {}
        for part in text.split(","):
            name, sep, ms = part.strip().partition(":")
            if not sep:
                raise ValueError(f"slo: {part!r} is not METRIC:MS (e.g. ttft:500,tpot:50)")
            if name not in SLO_METRICS:
                raise ValueError(f"slo: unknown metric {name!r}; use {', '.join(SLO_METRICS)}")
            try:
                value = float(ms)
            except ValueError:
                raise ValueError(f"slo: {name} must be a number of milliseconds, got {ms!r}") from None
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"slo: {name} must be > 0 ms, got {ms!r}")
            values[f"{name}_ms"] = value
        return SLO(**values)

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2el_ms, r.e2el_s))
        return all(limit is None or value * 1e3 <= limit for limit, value in checks)

    def describe(self) -> str:
        parts = [f"{n} <= {getattr(self, f'{n}_ms'):g} ms" for n in SLO_METRICS if getattr(self, f"{n}_ms") is not None]
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class RequestOptions:
    """The body fields every request carries besides the prompt and max_tokens."""

    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    chat: bool = False  # /v1/chat/completions with the prompt as one user message

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, sample: Sample) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": sample.output_len, "temperature": self.temperature, "stream": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": sample.prompt}]
        else:
            body["prompt"] = sample.prompt
        if self.model is not None:
            body["model"] = self.model
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass(frozen=True)
class LoadConfig:
    """One load run against `base_url`."""

    base_url: str
    model: str | None = None  # the `model` field; None asks /v1/models (and leaves it out if that fails)
    arrivals: Arrivals = Arrivals()
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    scrape_metrics: bool = True
    warmup: bool = True
    slo: SLO = SLO()
    show_progress: bool = True
    label: str = "requests"
    api_key: str | None = None
    chat: bool = False  # send chat completions (the prompt as one user message)  # sent as "Authorization: Bearer KEY" (also for /metrics)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: must start with http:// or https://, got {self.base_url!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"timeout: must be > 0 s, got {self.request_timeout_s}")


# --------------------------------------------------------------------------------------------- one request


@dataclass(frozen=True)
class RequestResult:
    """What one streamed request measured (seconds)."""

    ok: bool
    output_tokens: int = 0
    prompt_len: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    error: str = ""
    sent_s: float = 0.0  # when it was sent, seconds after the run's start
    accepted_drafts: int | None = None  # usage's accepted/rejected prediction tokens, where the server gives them
    rejected_drafts: int | None = None

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def record(self) -> dict[str, Any]:
        """The request's own figures for a JSON report (milliseconds): to find which requests make
        a percentile, and what speculation did for them."""
        out: dict[str, Any] = {"sent_s": round(self.sent_s, 3), "ok": self.ok, "prompt_tokens": self.prompt_len,
                               "output_tokens": self.output_tokens, "ttft_ms": round(self.ttft_s * 1e3, 1),
                               "tpot_ms": round(self.tpot_s * 1e3, 2), "e2el_ms": round(self.e2el_s * 1e3, 1)}
        if self.accepted_drafts is not None:
            out.update(accepted_drafts=self.accepted_drafts, rejected_drafts=self.rejected_drafts)
        if self.error:
            out["error"] = self.error
        return out


class StreamingCompletion:
    """Sends one streamed POST /v1/completions and times its chunks."""

    def __init__(self, client: httpx.AsyncClient, options: RequestOptions,
                 count_tokens: TokenCounter | None = None) -> None:
        self._client = client
        self._options = options
        self._count = count_tokens

    async def __call__(self, sample: Sample) -> RequestResult:
        prompt_len = sample.prompt_len or 0
        text: list[str] = []
        chunk_times: list[float] = []
        usage: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            async with self._client.stream("POST", self._options.path, json=self._options.body(sample)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    return RequestResult(False, prompt_len=prompt_len, error=f"HTTP {resp.status_code}: {body[:200]}")
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        err = event["error"]
                        message = err.get("message", err) if isinstance(err, dict) else err
                        return RequestResult(False, prompt_len=prompt_len, error=f"stream error: {message}")
                    now = time.perf_counter()
                    choices = event.get("choices") or []
                    piece = None
                    if choices:
                        delta = choices[0].get("delta")
                        piece = (delta or {}).get("content") if isinstance(delta, dict) else choices[0].get("text")
                    if piece:
                        chunk_times.append(now)
                        text.append(piece)
                    if event.get("usage"):
                        usage = event["usage"]
        except Exception as e:  # noqa: BLE001 - a request that fails in any way counts as failed, never ends the run
            return RequestResult(False, prompt_len=prompt_len, error=f"{type(e).__name__}: {e}")
        end = time.perf_counter()
        if not chunk_times:
            return RequestResult(False, prompt_len=prompt_len, error="no text streamed")
        generated = "".join(text)
        if usage.get("completion_tokens"):
            tokens = int(usage["completion_tokens"])
        elif self._count is not None:
            tokens = self._count(generated)
        else:
            tokens = len(chunk_times)
        itl = tuple(b - a for a, b in itertools.pairwise(chunk_times))
        details = usage.get("completion_tokens_details") or {}
        accepted, rejected = details.get("accepted_prediction_tokens"), details.get("rejected_prediction_tokens")
        return RequestResult(True, tokens, int(usage.get("prompt_tokens") or prompt_len), chunk_times[0] - start,
                             end - start, itl, accepted_drafts=None if accepted is None else int(accepted),
                             rejected_drafts=None if rejected is None else int(rejected))


# --------------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Distribution:
    """Mean, median, p90 and p99 of a latency, in milliseconds (None without samples)."""

    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None

    @staticmethod
    def of_seconds(values: Sequence[float]) -> Distribution:
        if not values:
            return Distribution()
        ms = sorted(v * 1e3 for v in values)
        return Distribution(statistics.fmean(ms), statistics.median(ms), percentile(ms, 90), percentile(ms, 99))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile: no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class LoadMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    good_requests: int | None = None  # None without an SLO
    goodput: float | None = None  # good requests / s
    errors: tuple[tuple[str, int], ...] = ()  # the most common failure messages

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "completed": self.completed, "failed": self.failed, "duration_s": round(self.duration_s, 3),
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "request_throughput": round(self.request_throughput, 4),
            "output_throughput": round(self.output_throughput, 2),
            "total_token_throughput": round(self.total_token_throughput, 2),
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist: Distribution = getattr(self, name)
            for stat in ("mean", "median", "p90", "p99"):
                value = getattr(dist, stat)
                out[f"{stat}_{name}_ms"] = None if value is None else round(value, 3)
        out["good_requests"] = self.good_requests
        out["goodput"] = None if self.goodput is None else round(self.goodput, 4)
        return out


def compute_metrics(results: Sequence[RequestResult], duration_s: float, slo: SLO = SLO()) -> LoadMetrics:
    """The run's figures from its requests; only successful requests count toward latencies."""
    ok = [r for r in results if r.ok]
    dur = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = None if slo.empty else sum(1 for r in ok if slo.met_by(r))
    errors = Counter(r.error for r in results if not r.ok).most_common(5)
    return LoadMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(ok) / dur, output_throughput=output_tokens / dur,
        total_token_throughput=(input_tokens + output_tokens) / dur,
        ttft=Distribution.of_seconds([r.ttft_s for r in ok]),
        tpot=Distribution.of_seconds([r.tpot_s for r in ok if r.output_tokens > 1]),
        itl=Distribution.of_seconds([g for r in ok for g in r.itl_s]),
        e2el=Distribution.of_seconds([r.e2el_s for r in ok]),
        good_requests=good, goodput=None if good is None else good / dur,
        errors=tuple(errors),
    )


_SPEC_COUNTER_NAMES = {
    "draft_tokens": ("specserve_spec_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "accepted_tokens": ("specserve_spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
    "steps": ("specserve_spec_verification_steps", "vllm:spec_decode_num_drafts"),
}


@dataclass(frozen=True)
class DraftCounters:
    """Speculation totals from a /metrics page (or the difference of two)."""

    draft_tokens: float
    accepted_tokens: float
    steps: float

    @staticmethod
    def from_prometheus(text: str) -> DraftCounters | None:
        """specserve's or vLLM's counters (summed over labels); None when the page has neither."""
        from prometheus_client.parser import text_string_to_metric_families

        totals: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                base = family.name.removesuffix("_total")
                for key, names in _SPEC_COUNTER_NAMES.items():
                    if base in names:
                        totals[key] = totals.get(key, 0.0) + sum(
                            s.value for s in family.samples if s.name.endswith("_total") or s.name == family.name)
        except ValueError:
            return None
        if set(totals) != set(_SPEC_COUNTER_NAMES):
            return None
        return DraftCounters(**totals)

    def __sub__(self, other: DraftCounters) -> DraftCounters:
        return DraftCounters(self.draft_tokens - other.draft_tokens, self.accepted_tokens - other.accepted_tokens,
                            self.steps - other.steps)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verification step (accepted drafts plus the bonus token)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps > 0 else None

    def row(self) -> dict[str, Any]:
        rate, mal = self.acceptance_rate, self.mean_accepted_length
        return {"spec_draft_tokens": int(self.draft_tokens), "spec_accepted_tokens": int(self.accepted_tokens),
                "spec_steps": int(self.steps),
                "spec_acceptance_rate": None if rate is None else round(rate, 4),
                "spec_mean_accepted_length": None if mal is None else round(mal, 3)}


EMPTY_SPEC_ROW = {"spec_draft_tokens": None, "spec_accepted_tokens": None, "spec_steps": None,
                  "spec_acceptance_rate": None, "spec_mean_accepted_length": None}


async def scrape_spec_counters(client: httpx.AsyncClient) -> DraftCounters | None:
    import httpx

    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return DraftCounters.from_prometheus(resp.text)


async def discover_model(client: httpx.AsyncClient) -> str | None:
    """The first model /v1/models lists, or None."""
    import httpx

    try:
        resp = await client.get("/v1/models")
        if resp.status_code == 200:
            data = resp.json().get("data") or []
            if data and isinstance(data[0], dict) and data[0].get("id"):
                return str(data[0]["id"])
    except (httpx.HTTPError, ValueError):
        pass
    return None


# --------------------------------------------------------------------------------------------- a run


@dataclass(frozen=True)
class LoadRun:
    """A finished load run: per-request results (in sample order), the figures, the speculation
    counters' difference, and the model name used."""

    results: tuple[RequestResult, ...]
    metrics: LoadMetrics
    spec: DraftCounters | None
    model: str | None
    send_offsets: tuple[float, ...] = field(default=())

    def row(self) -> dict[str, Any]:
        return {**self.metrics.row(), **(self.spec.row() if self.spec is not None else EMPTY_SPEC_ROW)}


class LoadGenerator:
    """Sends the samples on the arrival schedule (at most `max_concurrency` in flight) and
    measures them."""

    def __init__(self, config: LoadConfig, count_tokens: TokenCounter | None = None) -> None:
        self.config = config
        self._count = count_tokens

    def run(self, samples: Sequence[Sample]) -> LoadRun:
        return asyncio.run(self.run_async(samples))

    async def run_async(self, samples: Sequence[Sample]) -> LoadRun:
        import httpx

        cfg = self.config
        n = max(1, len(samples))
        limits = httpx.Limits(max_connections=cfg.max_concurrency or n, max_keepalive_connections=cfg.max_concurrency or n)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits, headers=headers) as client:
            model = cfg.model or await discover_model(client)
            send = StreamingCompletion(client, RequestOptions(model, cfg.temperature, cfg.ignore_eos, chat=cfg.chat),
                                       self._count)
            if cfg.warmup:
                check = await send(Sample("Hello", 4))
                if not check.ok:
                    raise ServerUnusable(f"base_url: the warm-up request to {cfg.base_url} failed: {check.error}")
            before = await scrape_spec_counters(client) if cfg.scrape_metrics else None
            offsets = cfg.arrivals.offsets(len(samples))
            results, duration = await self._send_all(send, samples, offsets)
            after = await scrape_spec_counters(client) if cfg.scrape_metrics else None
        spec = after - before if after is not None and before is not None else None
        return LoadRun(tuple(results), compute_metrics(results, duration, cfg.slo), spec, model, tuple(offsets))

    async def _send_all(self, send: StreamingCompletion, samples: Sequence[Sample],
                        offsets: Sequence[float]) -> tuple[list[RequestResult], float]:
        cfg = self.config
        limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = progress(len(samples), cfg.label, unit="req", disable=not cfg.show_progress)
        start = time.perf_counter()

        async def timed(sample: Sample) -> RequestResult:
            sent = time.perf_counter() - start
            return dataclasses.replace(await send(sample), sent_s=sent)

        async def one(sample: Sample, at: float) -> RequestResult:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                result = await timed(sample)
            else:
                async with limit:
                    result = await timed(sample)
            bar.update(1)
            return result

        try:
            results = await asyncio.gather(*(one(s, t) for s, t in zip(samples, offsets)))
        finally:
            bar.close()
        return list(results), time.perf_counter() - start


def format_summary(run: LoadRun, title: str) -> str:
    """The run's figures as a block of `name: value` lines."""
    m = run.metrics
    lines = [f"{' ' + title + ' ':=^60}",
             f"{'Successful requests:':<40}{m.completed:>20}",
             f"{'Failed requests:':<40}{m.failed:>20}",
             f"{'Duration (s):':<40}{m.duration_s:>20.2f}",
             f"{'Total input tokens:':<40}{m.total_input_tokens:>20}",
             f"{'Total generated tokens:':<40}{m.total_output_tokens:>20}",
             f"{'Request throughput (req/s):':<40}{m.request_throughput:>20.3f}",
             f"{'Output token throughput (tok/s):':<40}{m.output_throughput:>20.2f}",
             f"{'Total token throughput (tok/s):':<40}{m.total_token_throughput:>20.2f}"]
    if m.goodput is not None:
        lines.append(f"{'Good requests / goodput (req/s):':<40}{f'{m.good_requests} / {m.goodput:.3f}':>20}")
    for name, label in (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
                        ("itl", "Inter-token latency (per chunk)"), ("e2el", "End-to-end latency")):
        d: Distribution = getattr(m, name)
        lines.append(f"{' ' + label + ' ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            value = getattr(d, stat)
            shown = "-" if value is None else f"{value:.2f}"
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}{shown:>20}")
    if run.spec is not None:
        rate, mal = run.spec.acceptance_rate, run.spec.mean_accepted_length
        lines.append(f"{' Speculative decoding (/metrics) ':-^60}")
        lines.append(f"{'Draft / accepted tokens:':<40}{f'{run.spec.draft_tokens:.0f} / {run.spec.accepted_tokens:.0f}':>20}")
        lines.append(f"{'Acceptance rate:':<40}{'-' if rate is None else f'{rate:.3f}':>20}")
        lines.append(f"{'Mean accepted length (tok/step):':<40}{'-' if mal is None else f'{mal:.3f}':>20}")
    for error, count in m.errors:
        lines.append(f"failed x{count}: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
