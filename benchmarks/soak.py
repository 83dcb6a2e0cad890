"""Memory under steady load: `specserve serve` driven by rounds of `specserve bench serve` (ShareGPT,
32 streams) for a fixed time, the server's resident memory sampled every few seconds.

    python benchmarks/soak.py --minutes 30 --json benchmarks/soak_cpu.json [-- SERVE ARGS]

Reports the resident size (VmRSS) after the first round (warm), at the end, its largest value,
and the peak (VmHWM): growth is the end minus the warm figure. Each round uses other prompts
(--seed = the round number), so prefix caching and the suffix tree keep seeing new text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specserve.bench.launcher import LaunchedServer, ServeCommand


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompts-per-round", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("serve_args", nargs="*", help="after --: extra arguments for specserve serve")
    a = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    with LaunchedServer(ServeCommand(("--log-level", "warning", *a.serve_args)), log) as server:
        pid = server.pid
        assert pid is not None
        loaded = status_kb(pid, "VmRSS")
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(5.0):
                samples.append(status_kb(pid, "VmRSS"))

        threading.Thread(target=sample, daemon=True).start()
        deadline = time.monotonic() + a.minutes * 60
        rounds: list[dict[str, float]] = []
        try:
            while time.monotonic() < deadline:
                t = time.monotonic()
                subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "serve", "--base-url", server.base_url,
                                "--dataset", "sharegpt", "--num-prompts", str(a.prompts_per_round),
                                "--max-concurrency", str(a.streams), "--seed", str(len(rounds)), "--no-progress"],
                               check=True, capture_output=True)
                rounds.append({"seconds": round(time.monotonic() - t, 1), "rss_mb": status_kb(pid, "VmRSS") / 1024})
                print(f"round {len(rounds)}: {rounds[-1]}", flush=True)
        finally:
            stop.set()
        result = {
            "minutes": a.minutes, "streams": a.streams, "serve_args": a.serve_args, "rounds": len(rounds),
            "rss_loaded_mb": round(loaded / 1024, 1),
            "rss_warm_mb": round(rounds[0]["rss_mb"], 1),
            "rss_end_mb": round(rounds[-1]["rss_mb"], 1),
            "rss_max_mb": round(max(samples, default=loaded) / 1024, 1),
            "peak_vmhwm_mb": round(status_kb(pid, "VmHWM") / 1024, 1),
            "per_round": rounds,
        }
    result["growth_after_warm_mb"] = round(result["rss_end_mb"] - result["rss_warm_mb"], 1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
