"""Time to healthy and resident memory of a server, started fresh: llama.cpp's llama-server or
`specserve serve`, alternately, several times. While N concurrent chat streams of T tokens run,
the server's RSS is sampled every 0.2 s (VmRSS, and its anonymous, file-backed and shared parts:
a GGUF's mapped weights are file-backed, specserve's KV cache is a shared anonymous mapping).

    python benchmarks/start_and_memory.py --llama-bin ~/llama-build/bin \\
        --gguf ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf --streams 1 --tokens 64 \\
        --llama "-c 4096" --specserve "" --rounds 3 --json benchmarks/start_memory_1p5b_cpu.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def memory(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) / 1024  # MB
    return out


def run(argv: list[str], port: int, streams: int, tokens: int) -> dict:
    start = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.time() - start
        idle = memory(proc.pid)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]

        def request(i: int) -> None:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
            body = json.dumps({"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                               "messages": [{"role": "user", "content": f"Tell me a long story about the number {i}."}]})
            c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = c.getresponse()
            assert r.status == 200, r.read()[:300]
            r.read()

        threads = [threading.Thread(target=request, args=(i,)) for i in range(streams)]
        t0 = time.time()
        for t in threads:
            t.start()
        peak = memory(proc.pid)
        while any(t.is_alive() for t in threads):
            now = memory(proc.pid)
            if now["VmRSS"] > peak["VmRSS"]:
                peak = now
            time.sleep(0.2)
        seconds = time.time() - t0
        return {"ready_s": ready, "idle_mb": idle, "peak_mb": peak, "hwm_mb": memory(proc.pid)["VmHWM"],
                "out_tok_s": streams * tokens / seconds}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", type=Path, help="directory holding llama-server")
    p.add_argument("--gguf", help="the GGUF file both servers load (default: the bundled model's)")
    p.add_argument("--llama", default=None, help="llama-server arguments besides -m, -t and --port")
    p.add_argument("--specserve", default=None, help="`specserve serve` arguments besides --model, --threads, --port")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.gguf is None:
        from specserve.model.loader import find_bundled_gguf

        a.gguf = str(find_bundled_gguf("smollm2-135m"))
    engines = {}
    if a.llama is not None:
        engines["llama-server"] = lambda port: [str(a.llama_bin / "llama-server"), "-m", a.gguf, "-t", str(a.threads),
                                                "--port", str(port), *shlex.split(a.llama)]
    if a.specserve is not None:
        engines["specserve"] = lambda port: [sys.executable, "-m", "specserve.cli", "serve", "--model", a.gguf,
                                             "--threads", str(a.threads), "--port", str(port), "--log-level", "warning",
                                             *shlex.split(a.specserve)]
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(a.rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            port = free_port()
            results[name].append(run(engines[name](port), port, a.streams, a.tokens))
            print(name, json.dumps(results[name][-1]), flush=True)
    summary = {}
    for name, runs in results.items():
        summary[name] = {"ready_s_median": statistics.median(x["ready_s"] for x in runs),
                         "peak_rss_mb_median": statistics.median(x["hwm_mb"] for x in runs),
                         "out_tok_s_median": statistics.median(x["out_tok_s"] for x in runs)}
        print(f"{name:>13}: ready {summary[name]['ready_s_median']:.1f} s, peak RSS "
              f"{summary[name]['peak_rss_mb_median']:.0f} MB, {summary[name]['out_tok_s_median']:.1f} tok/s")
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "gguf": a.gguf, "streams": a.streams,
                                      "tokens": a.tokens, "runs": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
