"""What the Ray Serve hop costs a request: the bundled model served in-process, then as one replica
behind `--replicas 1` (same threads), then both again. Batch 1: one greedy streamed request
at a time (128 tokens, 5 measured after 1 warm-up), medians of TTFT and of the time per streamed
token. Batch B (`--batch`): B such requests at once, three rounds; output tokens per second.

    python benchmarks/replica_overhead.py --json benchmarks/replica_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serverproc import MODEL, Server  # noqa: E402


def measure(name: str, extra: list[str], args: argparse.Namespace) -> dict[str, float]:
    server = Server(Path(args.model), Path(f"/tmp/replica-overhead-{name}.log"), "--threads", str(args.threads),
                    "--log-level", "warning", *extra)
    try:
        server.wait_ready(600)
        per_token, ttft = [], []
        for i in range(args.requests + 1):
            body = {"model": MODEL, "prompt": f"Write a story about a robot number {i}.", "max_tokens": 128,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            start, times = time.perf_counter(), []
            with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            if i:  # the first is a warm-up
                ttft.append(times[0] - start)
                per_token.append((times[-1] - times[0]) / (len(times) - 1))
        rates = [asyncio.run(_round(server.base, args.batch)) for _ in range(3)]
    finally:
        server.stop()
    return {"ttft_ms_median": round(1000 * statistics.median(ttft), 1),
            "per_token_ms_median": round(1000 * statistics.median(per_token), 2),
            f"batch{args.batch}_tok_s_median": round(statistics.median(rates), 1)}


async def _round(base: str, batch: int) -> float:
    """B streamed greedy requests at once: output tokens per second."""
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Tell a tale about a cat called number {i}.", "max_tokens": 128,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, i) for i in range(batch)))
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    runs = [("in-process", []), ("ray-1-replica", ["--replicas", "1", "--replica-cpus", str(args.threads)]),
            ("in-process-again", []), ("ray-1-replica-again", ["--replicas", "1", "--replica-cpus", str(args.threads)])]
    out = {"command": " ".join(sys.argv), "results": {}}
    for name, extra in runs:
        out["results"][name] = measure(name, extra, args)
        print(name, out["results"][name], flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
