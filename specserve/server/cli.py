"""`specserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from specserve.entrypoints.engine_args import EngineArgs
from specserve.server.routing import ROUTING_POLICIES

if TYPE_CHECKING:
    from specserve.server.app import ServerOptions
    from specserve.server.guard import ConnectionLimits

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
    r = p.add_argument_group("scale-out on Ray Serve (pip install 'specserve[ray]')")
    r.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas deployed with Ray Serve behind this endpoint (default: one engine "
                        "in this process, no Ray)")
    r.add_argument("--ray-address", default=None,
                   help="the Ray cluster to deploy on, e.g. 'auto' or ray://host:10001 (default: start a local one)")
    r.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica; its engine's threads default to this (default: 1)")
    r.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs Ray reserves for each replica (default: 1 with --device cuda, else 0)")
    r.add_argument("--replica-start-timeout", type=float, default=900.0,
                   help="seconds every replica has to be placed and load its model before the start fails, "
                        "naming the replicas still pending (default: 900)")
    r.add_argument("--routing", default="affinity", choices=ROUTING_POLICIES,
                   help="how a request picks its replica: affinity (the replica that was sent the longest prefix "
                        "of its prompt, unless it is loaded well above the least loaded), round-robin, or "
                        "least-loaded (default: affinity)")
    r.add_argument("--ray-app-name", default="specserve",
                   help="Serve applications are named NAME-0 .. NAME-(N-1) (default: specserve)")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(a: argparse.Namespace) -> int:
    # Python's cyclic collector traverses every tracked object in a full collection: after importing
    # torch, 180k of them, 60 ms each time, and importing the server and loading the 1.5B set off
    # three more (0.2 s of a 2.5 s start). What exists by now (torch, the package) lives as long as
    # the server: frozen, later collections see only newer objects. Once the model is loaded, one
    # collection of what loading made (1 ms) and it is frozen too, so no step pauses to traverse the
    # model's modules and vocabularies. (The server only: a process that builds and drops engines,
    # as a test suite does, would keep their cycles forever.)
    gc.freeze()
    from specserve.server.app import ServerOptions, create_app
    from specserve.server.guard import ConnectionGuard, ConnectionLimits, fit_to_fd_limit
    from specserve.server.middleware import AccessPolicy, default_allowed_hosts, is_loopback

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
    engine_args = EngineArgs.from_cli(a)
    if a.replicas is not None:
        return _serve_replicas(a, engine_args, options, limits)
    from specserve.entrypoints.llm import LLM
    from specserve.server.engine_loop import build_on_passing_thread

    llm = build_on_passing_thread(lambda: LLM.from_engine_args(engine_args))
    gc.collect()
    gc.freeze()
    limits, backlog = fit_to_fd_limit(limits)  # after the model: its files and threads hold descriptors too
    guard = ConnectionGuard(limits)
    app = create_app(llm, options, guard)
    _run_server(app, a, guard, backlog)
    return 0


def _serve_replicas(a: argparse.Namespace, engine_args: EngineArgs, options: ServerOptions,
                    limits: ConnectionLimits) -> int:
    """--replicas N: the same app in this process, over engine replicas deployed with Ray Serve."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ValueError("--replicas needs Ray Serve, which is not installed: pip install 'specserve[ray]'")
    from specserve.server.app import build_app
    from specserve.server.guard import ConnectionGuard, fit_to_fd_limit
    from specserve.server.replica import ReplicaOptions, ReplicaStartError, connect, deploy_replicas, disconnect
    from specserve.server.replicas import ReplicaPool
    from specserve.server.routing import Router, RoutingConfig

    gpus = a.replica_gpus if a.replica_gpus is not None else (1.0 if engine_args.device.startswith("cuda") else 0.0)
    replica_options = ReplicaOptions(replicas=a.replicas, app_prefix=a.ray_app_name, cpus=a.replica_cpus,
                                     gpus=gpus, max_waiting=a.max_waiting, start_timeout_s=a.replica_start_timeout)
    router = Router(RoutingConfig(policy=a.routing), a.replicas)
    local = connect(a.ray_address)
    try:  # from here on, Ctrl-C or an error still takes the replicas (and a local cluster) down
        logger.info("deploying %d engine replica(s) on Ray Serve", a.replicas)
        try:
            handles = deploy_replicas(engine_args, replica_options)
        except ReplicaStartError as e:
            print(f"specserve: error: {e}", file=sys.stderr)
            return 1
        model = handles[0].describe.remote().result()
        pool = ReplicaPool(replica_options.names(), handles, router)
        limits, backlog = fit_to_fd_limit(limits)
        guard = ConnectionGuard(limits)
        app = build_app(pool, model, options, guard, collectors=[pool.collector()])
        logger.info("routing %s over %s", a.routing, ", ".join(replica_options.names()))
        _run_server(app, a, guard, backlog)
    finally:
        disconnect(replica_options, local)
    return 0


def _run_server(app: Any, a: argparse.Namespace, guard: Any, backlog: int) -> None:
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from specserve.server.guard import GuardedProtocol
    from specserve.server.runner import DrainingServer

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


class _Stopped(Exception):
    """SIGTERM, re-raised by uvicorn once it has shut down."""


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped
