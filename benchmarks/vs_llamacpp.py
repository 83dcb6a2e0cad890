"""specserve against llama.cpp's llama-server on the same CPU, end to end through each server's
OpenAI chat endpoint, interleaved request by request so that the machine's drift (CPU clocks,
noisy neighbours) weighs on every configuration alike.

    python benchmarks/vs_llamacpp.py --llama-bin /path/to/llama.cpp/build/bin \
        --llama "q4_1=-m {gguf}" --llama "q4_1+ngram-mod=-m {gguf} --spec-type ngram-mod" \
        --specserve "none=--spec none" --specserve "suffix=--spec suffix" --json out.json

Workload: the first Spec-Bench question of each of the 13 categories (first turn), greedy,
max_tokens 256 (ignore_eos, so every request decodes 256 tokens), one request at a time. The
client is a plain streaming HTTP reader (no JSON parsing per chunk), so it takes as little of
the 2 cores as possible. For each configuration: output tokens/s over all its requests, the
median of its per-request tokens/s, and its ratio to the first configuration per request
(median). `{gguf}` stands for the bundled model's GGUF file, or the one `--gguf` names (in either engine's arguments).

With `--workload structured`: the 24 JSON-schema chat requests of benchmarks/structured_outputs.py,
each with `response_format: json_schema` (both servers constrain it), greedy, max_tokens 256, not
streamed; tokens/s counts the tokens each answer actually has (answers differ in length between
engines), and each answer is checked against its schema.

With `--in-process`, each specserve configuration is also run in this process after the servers
stop (`LLM.chat` on the same prompts, same options, every engine built first and the prompts taken
by each in turn): the server's overhead per
token is the ratio of the two.

For each specserve server, each request's share of its speculation counters (its /metrics'
`specserve_spec_*`, read between requests: tokens drafted and accepted, steps the guard kept plain,
drafters switched off, requests drafted for by each drafter) is in the JSON beside its time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.bench.datasets import SampleSpec, open_dataset
from specserve.bench.launcher import free_port
from specserve.model.loader import find_bundled_gguf


@dataclass
class Config:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)
    spec: list[dict[str, float]] = field(default_factory=list)  # a specserve server's counters after each request

    def start(self, log_dir: Path) -> None:
        log = open(log_dir / f"{self.name}.log", "wb")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def chat(port: int, prompt: str, max_tokens: int) -> float:
    """Seconds for one streamed chat completion, read to its end."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:200]!r}")
    while resp.read(65536):
        pass
    seconds = time.perf_counter() - start
    conn.close()
    return seconds


def spec_counters(port: int) -> dict[str, float]:
    """A specserve server's speculation counters (`specserve_spec_*` in its /metrics, histograms
    aside), read between requests: what drafting did, request by request, in a served run."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("specserve_spec_") and family.type != "histogram":
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                name = sample.name.removeprefix("specserve_spec_") + (f"{{{labels}}}" if labels else "")
                out[name] = sample.value
    return out


def _completion(port: int, prompt: str, max_tokens: int, **extra: object) -> tuple[float, dict]:
    """Seconds and the parsed answer of one greedy, non-streamed chat completion."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, **extra})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    seconds = time.perf_counter() - start
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {data[:300]!r}")
    return seconds, json.loads(data)


def answered_chat(port: int, prompt: str, max_tokens: int) -> tuple[float, int]:
    """Seconds and completion tokens of one greedy chat completion, answered to its end."""
    seconds, answer = _completion(port, prompt, max_tokens)
    return seconds, int(answer["usage"]["completion_tokens"])


def structured_chat(port: int, prompt: str, schema: dict, max_tokens: int) -> tuple[float, int, str]:
    """Seconds, completion tokens and text of one chat completion held to `schema`."""
    seconds, answer = _completion(port, prompt, max_tokens, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    return seconds, int(answer["usage"]["completion_tokens"]), answer["choices"][0]["message"]["content"]


def in_process_seconds(configs: dict[str, str], prompts: list[str], max_tokens: int,
                       threads: int) -> dict[str, list[float]]:
    """Seconds per prompt through LLM.chat with the options each server was given: every engine
    built first, then each prompt on each in turn (as the servers were driven), so that a minute
    of slower memory falls on all of them alike."""
    from specserve import LLM, SamplingParams
    from specserve.entrypoints.engine_args import EngineArgs

    llms = {}
    for name, args in configs.items():
        parser = argparse.ArgumentParser()
        EngineArgs.add_cli_args(parser)
        options, _ = parser.parse_known_args([*shlex.split(args), "--threads", str(threads)])
        llms[name] = LLM.from_engine_args(EngineArgs.from_cli(options))
        llms[name].chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    for prompt in prompts:
        for name, llm in llms.items():
            start = time.perf_counter()
            llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def valid_json(case: dict, text: str) -> bool:
    from structured_outputs import valid

    return valid(case, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, default=None, help="directory holding llama-server (with --llama)")
    ap.add_argument("--llama", action="append", default=[], metavar="NAME=ARGS", help="a llama-server configuration")
    ap.add_argument("--specserve", action="append", default=[], metavar="NAME=ARGS",
                    help="a `specserve serve` configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the 13 prompts")
    ap.add_argument("--workload", choices=["spec-bench", "structured", "code-edit"], default="spec-bench",
                    help="code-edit: the code-editing prompts (one per edit kind), each answered to its end "
                         "(no ignore_eos), tokens counted from usage")
    ap.add_argument("--in-process", action="store_true",
                    help="also time each specserve configuration through LLM.chat (the server's overhead)")
    ap.add_argument("--gguf", default=None, help="the GGUF file {gguf} stands for (default: the bundled model's)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None,
                    help="a PNG of tokens/s by category (the prompts' categories; several rounds pooled)")
    ap.add_argument("--log-dir", type=Path, default=Path("bench_results/vs_llamacpp_logs"))
    ap.add_argument("--from-json", type=Path, default=None,
                    help="run nothing: plot (--plot) an earlier run's JSON")
    a = ap.parse_args()
    if a.from_json is not None:
        earlier = json.loads(a.from_json.read_text())
        if a.plot is not None:
            plot_by_category(a.plot, earlier["rows"], f"{earlier['workload']}, batch 1, {earlier['max_tokens']} tokens, "
                             f"{earlier['threads']} threads")
        return
    if a.llama and a.llama_bin is None:
        ap.error("--llama needs --llama-bin, the directory holding llama-server")
    gguf = str(Path(a.gguf).expanduser()) if a.gguf else str(find_bundled_gguf("smollm2-135m"))
    configs: list[Config] = []
    for spec in a.llama:
        name, _, args = spec.partition("=")
        port = free_port()
        argv = [str(a.llama_bin / "llama-server"), *shlex.split(args.replace("{gguf}", gguf)), "-t", str(a.threads),
                "-c", "4096", "-np", "1", "--port", str(port)]
        configs.append(Config(f"llama.cpp {name}", argv, port))
    in_process: dict[str, str] = {}
    for spec in a.specserve:
        name, _, args = spec.partition("=")
        args = args.replace("{gguf}", gguf)
        in_process[f"specserve {name}"] = args
        port = free_port()
        argv = [sys.executable, "-m", "specserve.cli", "serve", *shlex.split(args), "--threads", str(a.threads),
                "--port", str(port), "--log-level", "warning"]
        configs.append(Config(f"specserve {name}", argv, port))
    if not configs:
        ap.error("give at least one --llama or --specserve configuration")
    workload = "code-edit" if a.workload == "code-edit" else "spec-bench"
    samples = open_dataset(workload, None).sample(SampleSpec(seed=None, per_category=1, output_len=a.max_tokens)).samples
    structured = []
    if a.workload == "structured":
        from structured_outputs import cases  # this directory's benchmark

        structured = [c for c in cases() if c["kind"] == "json"]
    a.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for c in configs:  # one at a time: loading competes for the cores
            c.start(a.log_dir)
            c.wait_ready()
        for c in configs:
            chat(c.port, "Hello", 8)  # warm-up
            if c.name.startswith("specserve"):
                c.spec.append(spec_counters(c.port))  # the counters' start
        for i, case in enumerate(structured):
            for c in configs:
                seconds, tokens, text = structured_chat(c.port, case["prompt"], case["schema"], a.max_tokens)
                c.seconds.append(seconds)
                c.tokens.append(tokens)
                c.valid.append(valid_json(case, text))
            print(f"request {i + 1}/{len(structured)} done", file=sys.stderr, flush=True)
        for r in range(a.rounds if not structured else 0):
            for i, s in enumerate(samples):
                for c in configs:
                    if a.workload == "code-edit":
                        seconds, tokens = answered_chat(c.port, s.prompt, a.max_tokens)
                        c.seconds.append(seconds)
                        c.tokens.append(tokens)
                    else:
                        c.seconds.append(chat(c.port, s.prompt, a.max_tokens))
                    if c.name.startswith("specserve"):
                        c.spec.append(spec_counters(c.port))
                print(f"round {r + 1} prompt {i + 1}/{len(samples)} done", file=sys.stderr, flush=True)
    finally:
        for c in configs:
            c.stop()
    if a.in_process and not structured:
        timed = in_process_seconds(in_process, [s.prompt for s in samples] * a.rounds, a.max_tokens, a.threads)
        for name, seconds in timed.items():
            configs.append(Config(f"{name} (LLM.chat)", [], 0, seconds=seconds))
    base = configs[0]
    rows = []
    for c in configs:
        tokens = c.tokens or [a.max_tokens] * len(c.seconds)
        base_tokens = base.tokens or [a.max_tokens] * len(base.seconds)
        rates = [n / t for n, t in zip(tokens, c.seconds)]
        ratios = [(n / t) / (bn / bt) for n, t, bn, bt in zip(tokens, c.seconds, base_tokens, base.seconds)]
        row = {"config": c.name, "command": shlex.join(c.argv) or "in process", "requests": len(c.seconds),
               "tokens_per_s": round(sum(tokens) / sum(c.seconds), 2),
               "median_request_tokens_per_s": round(statistics.median(rates), 2),
               f"median_ratio_vs_{base.name}": round(statistics.median(ratios), 3)}
        if c.valid:
            row["valid"] = sum(c.valid)
            row["tokens"] = sum(tokens)
        if not structured:
            cats = [s.category or s.prompt[:24] for s in samples] * a.rounds
            row["per_request"] = [{"category": cat, "tokens": n, "seconds": round(t, 4)}
                                  for cat, n, t in zip(cats, tokens, c.seconds)]
            for req, before, now in zip(row["per_request"], c.spec, c.spec[1:]):  # each request's share of the counters
                req["spec"] = {k: round(v - before.get(k, 0.0), 4) for k, v in now.items()
                               if "relative_error" not in k and v != before.get(k, 0.0)}
        rows.append(row)
    width = max(len(r["config"]) for r in rows)
    print(f"{'config':<{width}}  tok/s   median req tok/s   ratio vs {base.name}")
    for r in rows:
        print(f"{r['config']:<{width}}  {r['tokens_per_s']:6.1f}   {r['median_request_tokens_per_s']:15.1f}   "
              f"{r[f'median_ratio_vs_{base.name}']:.3f}"
              + (f"   valid {r['valid']}/{r['requests']}, {r['tokens']} tokens" if "valid" in r else ""))
    if a.plot is not None and not structured:
        plot_by_category(a.plot, rows, f"{a.workload}, batch 1, {a.max_tokens} tokens, {a.threads} threads")
    if a.json is not None:
        a.json.write_text(json.dumps({"rows": rows, "max_tokens": a.max_tokens, "threads": a.threads,
                                      "workload": a.workload, "prompts": len(structured or samples),
                                      "rounds": a.rounds}, indent=2))


def plot_by_category(path: Path, rows: list[dict], title: str) -> None:
    """Each configuration's tokens/s per category (its requests of that category pooled), the
    categories in the prompts' order, then all requests."""
    from specserve.bench.plots import plot_grouped_bars

    cats = list(dict.fromkeys(r["category"] for r in rows[0]["per_request"]))
    series = {}
    for row in rows:
        rates = []
        for cat in cats:
            mine = [q for q in row["per_request"] if q["category"] == cat]
            rates.append(sum(q["tokens"] for q in mine) / sum(q["seconds"] for q in mine))
        series[row["config"]] = rates + [row["tokens_per_s"]]
    plot_grouped_bars(path, cats + ["all"], series, "output tokens/s", title)


if __name__ == "__main__":
    main()
