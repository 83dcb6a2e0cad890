"""The server's cost per token, interleaved: the same chat requests through `specserve serve` and
through `LLM.chat` in this process, alternating request by request so the machine's drift weighs on
both alike (the server idles while this process decodes, and the other way round).

    python benchmarks/server_vs_inprocess.py [--stream|--no-stream] [-- SERVE/ENGINE ARGS]

4 prompts x 3 rounds, greedy, 256 tokens (ignore_eos), one request at a time. Prints the median
tok/s of each and the median per-request ratio server / in-process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from specserve import LLM, SamplingParams
from specserve.bench.launcher import LaunchedServer, ServeCommand
from specserve.entrypoints.engine_args import EngineArgs

PROMPTS = ("Write a long story about a dragon and a knight.", "Explain how a car engine works.",
           "List ten facts about the moon.", "Translate to French: the weather is nice today and we will go out.")
TOKENS = 256


def served_seconds(base_url: str, prompt: str, stream: bool) -> float:
    url = urlparse(base_url)
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": stream})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    while resp.read(65536):  # no per-chunk parsing: the client takes as little CPU as it can
        pass
    conn.close()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("args", nargs="*", help="after --: engine options, as `specserve serve` takes them")
    a = ap.parse_args()
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = LLM.from_engine_args(EngineArgs.from_cli(parser.parse_args(a.args)))
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)

    def local_seconds(prompt: str) -> float:
        start = time.perf_counter()
        llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    log = Path(tempfile.mkdtemp(prefix="overhead-")) / "server.log"
    with LaunchedServer(ServeCommand(("--log-level", "warning", *a.args)), log) as server:
        served_seconds(server.base_url, "hi", a.stream)  # warm-up, both sides
        local_seconds("hi")
        local, served = [], []
        for _ in range(a.rounds):
            for prompt in PROMPTS:
                local.append(TOKENS / local_seconds(prompt))
                served.append(TOKENS / served_seconds(server.base_url, prompt, a.stream))
    ratio = statistics.median(s / p for s, p in zip(served, local))
    print(f"in process {statistics.median(local):.1f} tok/s, served ({'streamed' if a.stream else 'not streamed'}) "
          f"{statistics.median(served):.1f} tok/s, median ratio served / in process {ratio:.3f}")


if __name__ == "__main__":
    main()
