"""`specserve bench serve`: its options, and the glue from them to a sweep and its report."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.bench.datasets import (
    DATASET_NAMES,
    Draw,
    SampleSpec,
    TokenCounter,
    describe,
    hf_token_counter,
    open_dataset,
)
from specserve.bench.report import BenchReport, Column, ReportPaths, add_report_args
from specserve.bench.serve import SLO, Arrivals, LoadConfig, format_summary
from specserve.bench.sweep import (
    ServerConfig,
    Sweep,
    SweepPlan,
    SweepPoint,
    median_rows,
    parse_rates,
    rate_label,
)

SERVE_COLUMNS = (
    Column("config", "config"),
    Column("request_rate", "rate (req/s)"),
    Column("completed", "done"),
    Column("failed", "failed"),
    Column("request_throughput", "req/s", ".3f"),
    Column("output_throughput", "out tok/s", ".1f"),
    Column("mean_ttft_ms", "TTFT mean", ".0f"),
    Column("p99_ttft_ms", "TTFT p99", ".0f"),
    Column("mean_tpot_ms", "TPOT mean", ".1f"),
    Column("p99_tpot_ms", "TPOT p99", ".1f"),
    Column("mean_itl_ms", "ITL mean", ".1f"),
    Column("mean_e2el_ms", "E2EL mean", ".0f"),
    Column("p99_e2el_ms", "E2EL p99", ".0f"),
    Column("spec_acceptance_rate", "accept", ".3f"),
    Column("spec_mean_accepted_length", "tok/step", ".2f"),
)
GOODPUT_COLUMN = Column("goodput", "goodput (req/s)", ".3f")

DEFINITIONS = """\
- Latencies in milliseconds, over successful requests. TTFT: request sent to first streamed text.
  TPOT: (end-to-end - TTFT) / (output tokens - 1), per request with more than one token.
  ITL: gap between consecutive streamed chunks (a chunk can carry several tokens when a
  speculation step accepts several). E2EL: request sent to end of stream.
- Output tokens: the server's `usage.completion_tokens`; throughputs divide by the run's
  duration (first request sent to last one finished).
- Goodput: requests per second that met every SLO.
- accept / tok/step: speculation from the server's /metrics, difference before/after the run:
  accepted / proposed draft tokens, and tokens per verification step (accepted + 1).
"""


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=None, help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    s.add_argument("--launch", default=None, metavar="'SERVE ARGS'",
                   help="start `specserve serve SERVE ARGS` on a free port instead (with --configs: the "
                        "arguments every configuration shares)")
    s.add_argument("--configs", nargs="+", default=None, metavar="NAME:SERVE_ARGS",
                   help="server configurations to launch in turn, e.g. 'none:--spec none' 'suffix:--spec suffix'")
    s.add_argument("--reuse-server", action="store_true",
                   help="one server per configuration for all rates (default: a fresh server per rate, so "
                        "caches warmed by the previous rate's identical prompts do not flatter later rates)")
    s.add_argument("--rounds", type=int, default=1,
                   help="measure the configurations in turn, this many rounds (A B C, then C B A), each round and "
                        "rate on fresh servers all up together; the table shows each configuration's medians "
                        "(default 1: one configuration after another)")
    s.add_argument("--model-name", default=None, help="the request's `model` field (default: the first of /v1/models)")
    s.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a launched server gets to be healthy")
    s.add_argument("--server-log-dir", default=None, help="keep launched servers' logs here (default: a temp dir)")
    s.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics for speculation counters")
    s.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY") or None,
                   help="Bearer token for the server (default: $SPECSERVE_API_KEY)")

    d = p.add_argument_group("workload")
    d.add_argument("--dataset", default="spec-bench",
                   help=f"{', '.join(DATASET_NAMES)}, or a Spec-Bench style jsonl path (default: spec-bench)")
    d.add_argument("--dataset-path", default=None, help="the named dataset's file, where not its default one")
    d.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer measures lengths (default: the launched --model, else the bundled model)")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--per-category", type=int, default=None,
                   help="the first N prompts of every category, in file order (Spec-Bench: 13 categories)")
    d.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="send /v1/completions with the raw prompt, or /v1/chat/completions with it as the user's "
                        "message (the server applies its chat template)")
    d.add_argument("--output-len", type=int, default=None,
                   help="max_tokens for every request (default: the dataset's reference lengths; Spec-Bench: 256)")
    d.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: inf = all at once)")
    d.add_argument("--request-rates", default=None, metavar="R1,R2,...", help="sweep these rates (overrides --request-rate)")
    d.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    d.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    d.add_argument("--seed", type=int, default=0, help="seeds the dataset sample and the arrival times")
    d.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS", help="goodput objectives (ttft, tpot, e2el)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it; outputs may then end early)")
    d.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_report_args(p, plot=True)


def _plan(a: argparse.Namespace, rates: tuple[float, ...]) -> tuple[SweepPlan, argparse.Namespace | None]:
    """The sweep plan, and the parsed serve arguments of the first configuration (for its model)."""
    from specserve.bench.launcher import check_serve_args

    if a.base_url and (a.launch is not None or a.configs):
        raise ValueError("base_url: give either --base-url or --launch/--configs, not both")
    log_dir = Path(a.server_log_dir) if a.server_log_dir else None
    shared = shlex.split(a.launch) if a.launch else []
    if a.configs:
        configs = tuple(ServerConfig.parse(c, shared) for c in a.configs)
    elif a.launch is not None:
        parsed = check_serve_args(shared, "launch")
        configs = (ServerConfig(str(parsed.spec), tuple(shared)),)
    elif a.base_url:
        if a.rounds != 1:
            raise ValueError("rounds: measures launched servers in turn; not with --base-url")
        return SweepPlan(rates, base_url=a.base_url), None
    else:
        raise ValueError("base_url: give --base-url URL, --launch 'SERVE ARGS' or --configs NAME:ARGS ...")
    plan = SweepPlan(rates, configs, reuse_server=a.reuse_server, startup_timeout_s=a.startup_timeout, log_dir=log_dir,
                     rounds=a.rounds)
    return plan, check_serve_args(configs[0].serve_args, f"configs[{configs[0].name}]")


def _server_threads(plan: SweepPlan) -> int | str | None:
    """The launched servers' --threads (None: torch's default; 'mixed' when configurations differ;
    None for an external server, whose threads are unknown)."""
    from specserve.bench.launcher import check_serve_args

    values = {check_serve_args(c.serve_args, f"configs[{c.name}]").threads for c in plan.configs}
    if len(values) > 1:
        return "mixed"
    return next(iter(values), None)


def _token_counter(a: argparse.Namespace, first_serve: argparse.Namespace | None) -> TokenCounter:
    from specserve.model.loader import DEFAULT_MODEL, ModelNotFoundError, model_dir_for
    from specserve.tokenizer import load_tokenizer

    name = a.tokenizer or (first_serve.model if first_serve is not None else DEFAULT_MODEL)
    try:
        return hf_token_counter(load_tokenizer(model_dir_for(name)))
    except (ModelNotFoundError, OSError) as e:
        raise ValueError(f"tokenizer: cannot load the tokenizer of {name!r} ({e}); pass --tokenizer") from None


def _workload_section(a: argparse.Namespace, draw: Draw, load: LoadConfig, dataset_name: str) -> str:
    prompt_lens = [s.prompt_len for s in draw.samples if s.prompt_len is not None]
    output_lens = [s.output_len for s in draw.samples]
    lines = [f"- dataset: {dataset_name} ({describe(draw)}, seed {a.seed})"]
    if prompt_lens:
        lines.append(f"- prompt tokens: mean {statistics.fmean(prompt_lens):.0f}, max {max(prompt_lens)}; "
                     f"output tokens asked: mean {statistics.fmean(output_lens):.0f}, max {max(output_lens)}, "
                     f"total {sum(output_lens)}")
    lines.append(f"- arrivals: {'Poisson' if load.arrivals.burstiness == 1 else f'gamma, burstiness {load.arrivals.burstiness:g}'}"
                 f", max concurrency {load.max_concurrency or 'unlimited'}")
    lines.append(f"- requests: streamed POST /v1/{'chat/' if load.chat else ''}completions, temperature {load.temperature:g}, "
                 f"ignore_eos {'on' if load.ignore_eos else 'off'}; SLO: {load.slo.describe()}")
    return "\n".join(lines)


def _servers_section(plan: SweepPlan, points: Sequence[SweepPoint]) -> str:
    if plan.base_url is not None:
        return f"External server at {plan.base_url}."
    how = ("one server per configuration, for all its rates" if plan.reuse_server
           else "a fresh server for every rate, so every point starts with cold caches")
    lines = [f"Each configuration was launched as below, on a free loopback port: {how}.", "", "```bash"]
    lines += list(dict.fromkeys(p.server_command for p in points if p.server_command))
    lines.append("```")
    return "\n".join(lines)


def _failures_section(points: Sequence[SweepPoint]) -> str:
    lines = []
    for p in points:
        for error, count in p.run.metrics.errors:
            lines.append(f"- {p.config} @ {rate_label(p.rate)} req/s: {count} x {error}")
    return "\n".join(lines)


def run_serve_bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    paths = ReportPaths.from_args(a)
    slo = SLO.parse(a.slo)
    rates = parse_rates(a.request_rates) if a.request_rates else (a.request_rate,)
    arrivals = Arrivals(rates[0], a.burstiness, a.seed)  # validates the shared settings early
    if a.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {a.num_prompts}")
    plan, first_serve = _plan(a, rates)
    count_tokens = _token_counter(a, first_serve)
    dataset = open_dataset(a.dataset, Path(a.dataset_path) if a.dataset_path else None)
    if a.per_category is not None:
        draw = dataset.sample(SampleSpec(seed=None, output_len=a.output_len, per_category=a.per_category), count_tokens)
    else:
        draw = dataset.sample(SampleSpec(num=a.num_prompts, seed=a.seed, output_len=a.output_len), count_tokens)
    if a.per_category is None and len(draw.samples) < a.num_prompts:
        raise ValueError(f"num_prompts: {dataset.name} has only {len(draw.samples)} usable samples, "
                         f"{a.num_prompts} asked")
    print(f"# {dataset.name}: {describe(draw)}", flush=True)
    load = LoadConfig(base_url=a.base_url or "http://127.0.0.1", model=a.model_name, arrivals=arrivals,
                      max_concurrency=a.max_concurrency, temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                      request_timeout_s=a.timeout, scrape_metrics=not a.no_metrics, slo=slo,
                      show_progress=not a.no_progress, api_key=a.api_key, chat=a.endpoint == "chat")

    def show(point: SweepPoint) -> None:
        print(format_summary(point.run, f"{point.config} @ {rate_label(point.rate)} req/s"), flush=True)

    points = Sweep(plan, load, draw.samples, count_tokens, on_point=show).run()
    rows = [p.row(load, len(draw.samples)) for p in points]
    columns = SERVE_COLUMNS + ((GOODPUT_COLUMN,) if not slo.empty else ())
    shown = None
    if plan.rounds > 1:  # the table: each configuration's medians over the rounds (the JSON keeps every round),
        # and the medians of its ratios to the first configuration's figures in the same round
        shown = tuple(median_rows(rows, [c.key for c in columns if c.key not in ("config", "request_rate")]))
        first = plan.config_names[0]
        columns = columns[:2] + (Column("rounds", "rounds"),) + columns[2:] + (
            Column("output_throughput_ratio", f"tok/s / {first}", ".3f"),
            Column("mean_tpot_ms_ratio", f"TPOT mean / {first}", ".3f"),
            Column("p99_tpot_ms_ratio", f"TPOT p99 / {first}", ".3f"))
    title = (f"specserve bench serve: {dataset.name}, {len(draw.samples)} prompts per rate, "
             f"{', '.join(plan.config_names)}")
    report = BenchReport(title, tuple(rows), columns, fields={
        "bench": "serve", "dataset": dataset.name, "num_prompts": len(draw.samples), "seed": a.seed,
        "request_rates": list(rates), "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
        "output_len": a.output_len, "temperature": a.temperature, "ignore_eos": not a.no_ignore_eos,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms},
        "base_url": a.base_url, "reuse_server": a.reuse_server, "rounds": plan.rounds,
        "threads": _server_threads(plan),
        "configs": [{"name": c.name, "serve_args": list(c.serve_args)} for c in plan.configs],
        "dataset_draw": {"examined": draw.examined, "kept": len(draw.samples), "dropped": dict(draw.dropped)},
    }, shown_rows=shown)
    print()
    print(report.table())
    if paths.json is not None:
        report.write_json(paths.json)
    if paths.plot is not None:
        from specserve.bench.plots import plot_rate_sweep

        plot_rate_sweep(paths.plot, list(shown or rows), title)
    if paths.report is not None:
        sections = [("Workload", _workload_section(a, draw, load, dataset.name)),
                    ("Servers", _servers_section(plan, points)), ("Definitions", DEFINITIONS)]
        failures = _failures_section(points)
        if failures:
            sections.insert(2, ("Failures", failures))
        report.write_markdown(paths.report, sections, paths.plot)
    return rows

