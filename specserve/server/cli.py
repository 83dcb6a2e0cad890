"""`specserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
from types import FrameType

from specserve.entrypoints.engine_args import EngineArgs

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
API_KEY_ENV = "SPECSERVE_API_KEY"

logger = logging.getLogger("specserve.server")


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to specserve's command line."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    EngineArgs.add_cli_args(p)
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
    s = p.add_argument_group("security and connection limits")
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: ${API_KEY_ENV})")
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--allowed-hosts", type=_csv, default=None,
                   help="comma-separated Host header names answered, '*' for any (default: this machine's "
                        "names when bound to loopback, else any)")
    s.add_argument("--allowed-origins", type=_csv, default=(),
                   help="comma-separated origins allowed by CORS, '*' for any (default: none)")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="open client connections at most; beyond, the one idle longest is closed, else the new "
                        "one gets 503 (default: 1024, capped below the open-file limit)")
    s.add_argument("--header-timeout", type=float, default=20.0,
                   help="seconds a connection has to send a complete request head (default: 20)")
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request has to send its whole body, else 408 (default: 60)")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from specserve.server.app import ServerOptions, create_app
    from specserve.server.guard import ConnectionGuard, ConnectionLimits, GuardedProtocol, fit_to_fd_limit
    from specserve.server.middleware import AccessPolicy, default_allowed_hosts, is_loopback
    from specserve.server.runner import DrainingServer

    if a.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout: must be >= 0, got {a.shutdown_timeout}")
    options = ServerOptions(
        served_model_name=a.served_model_name or a.model,
        max_waiting=a.max_waiting,
        max_body_bytes=a.max_body_bytes,
        body_timeout=a.body_timeout,
        access=AccessPolicy(api_key=a.api_key, metrics_public=a.metrics_public,
                            allowed_hosts=a.allowed_hosts or default_allowed_hosts(a.host)),
        allowed_origins=a.allowed_origins,
    )
    limits = ConnectionLimits(max_connections=a.max_connections, header_timeout=a.header_timeout)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.access.api_key is None and not is_loopback(a.host):
        logger.warning("serving on %s without an API key: anyone who can reach this address can generate and "
                       "read /metrics; set --api-key or $%s", a.host, API_KEY_ENV)
    from specserve.entrypoints.llm import LLM
    from specserve.server.engine_loop import build_on_passing_thread

    engine_args = EngineArgs.from_cli(a)
    llm = build_on_passing_thread(lambda: LLM.from_engine_args(engine_args))
    limits, backlog = fit_to_fd_limit(limits)  # after the model: its files and threads hold descriptors too
    guard = ConnectionGuard(limits)
    app = create_app(llm, options, guard)
    config = uvicorn.Config(
        app, host=a.host, port=a.port, log_level=a.log_level,
        http=functools.partial(GuardedProtocol, guard=guard, inner=AutoHTTPProtocol),  # type: ignore[arg-type]
        proxy_headers=False,  # the guard matches ASGI "client" to the connection's own peer address
        backlog=backlog,
        timeout_graceful_shutdown=5.0,  # a backstop: the engine's drain ends every response before
    )
    server = DrainingServer(config, drain=lambda: app.state.engine.drain(a.shutdown_timeout))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: end quietly with 0.
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        server.run()
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Stopped(Exception):
    """SIGTERM, re-raised by uvicorn once it has shut down."""


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped
