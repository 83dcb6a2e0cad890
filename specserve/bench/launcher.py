"""Start a `specserve serve` subprocess on a free loopback port for a benchmark, wait for /health,
and stop it afterwards."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message holds the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_serve_args(args: Sequence[str], field: str) -> argparse.Namespace:
    """Parse `args` as `specserve serve` would, so that a typo fails before anything starts."""
    from specserve.server.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="specserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    try:
        parsed = parser.parse_args(["serve", *args])
    except SystemExit:
        raise ValueError(f"{field}: not valid `specserve serve` arguments: {shlex.join(args)!r}") from None
    return parsed


@dataclass(frozen=True)
class ServeCommand:
    """`python -m specserve.cli serve ARGS --host HOST --port PORT`; host and port are appended
    last, so they win over any in ARGS."""

    serve_args: tuple[str, ...]
    host: str = "127.0.0.1"

    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", "specserve.cli", "serve", *self.serve_args, "--host", self.host,
                "--port", str(port)]

    def shown(self, port: int) -> str:
        """The command as a person would type it, with any API key masked (it goes into reports)."""
        argv = ["python", *self.argv(port)[1:]]
        for i, arg in enumerate(argv):
            if arg == "--api-key" and i + 1 < len(argv):
                argv[i + 1] = "***"
            elif arg.startswith("--api-key="):
                argv[i] = "--api-key=***"
        return shlex.join(argv)


class LaunchedServer:
    """A running server for the duration of a `with` block; its output goes to `log_path`."""

    def __init__(self, command: ServeCommand, log_path: Path, startup_timeout_s: float = 600.0) -> None:
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout: must be > 0 s, got {startup_timeout_s}")
        self.command = command
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.command.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def shown_command(self) -> str:
        return self.command.shown(self.port)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port(self.command.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the server runs
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(self.command.argv(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                      env=env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        import httpx

        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ServerStartError(f"server exited with {self._proc.returncode} before it was healthy "
                                           f"({self.shown_command}):\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise ServerStartError(f"server not healthy after {self.startup_timeout_s:g} s ({self.shown_command}):\n"
                               f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the server finishes or aborts what is in flight), then SIGKILL after `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
