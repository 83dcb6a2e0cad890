"""`specserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

from specserve.cli import _add_engine_args, _make_llm

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to specserve's command line."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    _add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name the API answers to (default: --model)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for the engine before new ones get 429 (default: 256)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted, else 413 (default: 1 MiB)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from specserve.server.app import create_app

    if a.max_waiting < 1:
        raise ValueError(f"max_waiting: must be >= 1, got {a.max_waiting}")
    if a.max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be >= 1, got {a.max_body_bytes}")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = _make_llm(a)
    app = create_app(llm, served_model_name=a.served_model_name or a.model, max_waiting=a.max_waiting,
                     max_body_bytes=a.max_body_bytes)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: end quietly with 0.
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level,
                    timeout_graceful_shutdown=a.shutdown_timeout)
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Stopped(Exception):
    """SIGTERM, re-raised by uvicorn once it has shut down."""


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped
