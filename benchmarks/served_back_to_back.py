"""What a server's first requests get while its weights are collapsed into 2 MB pages
(`--huge-pages auto`, specserve.model.huge_pages.PageCollapse): each config's `specserve serve` is
started fresh and, as soon as it is healthy, sent --requests completions of --tokens greedy tokens
back to back (the next sent when the last returns). Records each request's tokens per second, the
server's log line of the collapse, and the huge pages it holds at the end.

    python benchmarks/served_back_to_back.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf \\
        --config "auto=--spec none" --config "off=--spec none --huge-pages off" \\
        --json benchmarks/served_back_to_back_1p5b_xeon_s36_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
import urllib.request
from pathlib import Path

from specserve.bench.launcher import LaunchedServer, ServeCommand
from specserve.bench.sweep import COLLAPSED


def ask(port: int, model: str, tokens: int) -> float:
    body = json.dumps({"model": model, "prompt": "Write a long story about a dragon.", "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    urllib.request.urlopen(req, timeout=600).read()
    return tokens / (time.perf_counter() - start)


def run(name: str, args: str, a: argparse.Namespace) -> dict[str, object]:
    command = ServeCommand(("--model", a.model, "--threads", str(a.threads), *shlex.split(args)))
    with LaunchedServer(command, Path(tempfile.mkstemp(suffix=".log")[1])) as server:
        rates = [round(ask(server.port, a.model, a.tokens), 1) for _ in range(a.requests)]
        huge = [line.split()[1] for line in open(f"/proc/{server.pid}/smaps_rollup") if line.startswith("AnonHuge")]
    collapse = [line.strip() for line in server.log_tail(1 << 20).splitlines() if COLLAPSED in line]
    row = {"config": name, "args": args, "tok_s": rates, "anon_huge_kb": int(huge[0]) if huge else None,
           "collapse_log": collapse[-1] if collapse else None}
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", action="append", required=True, help="NAME=SERVE-ARGS, repeatable")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [run(*c.split("=", 1), a) for c in a.config]
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "args": vars(a) | {"json": str(a.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
