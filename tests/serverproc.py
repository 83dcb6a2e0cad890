"""A `specserve serve` subprocess for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"  # --served-model-name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `specserve serve` subprocess; its log goes to a file, shown when something fails."""

    def __init__(self, model: Path, log: Path, *extra: str, api_key: str = "x",
                 preexec_fn: Callable[[], Any] | None = None) -> None:
        self.port = _free_port()
        self.log_path = log
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--served-model-name", MODEL, "--threads", "1", *extra]
        self._log = open(log, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SPECSERVE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=preexec_fn)
        self.http = httpx.Client(base_url=self.base, timeout=60, headers={"Authorization": f"Bearer {api_key}"})
        self.openai = OpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0, timeout=60)

    def log(self) -> str:
        """The end of the log (for failure messages)."""
        return self.full_log()[-4000:]

    def full_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed like `name{label="v"}`."""
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        self.http.close()
        self.openai.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
