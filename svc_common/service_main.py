"""Common entry point of a service process: parse once, configure logging, run under uvloop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from svc_common.cli_help import HelpFormatter, add_version


def run_service(parser: argparse.ArgumentParser, to_config: Callable, serve: Callable,
                argv: list[str] | None = None) -> int:
    """Parse, resolve ``--model`` once (a hub id becomes its cached directory) and check it, build the config,
    serve. A user mistake (bad flag value, unusable model, no CUDA, too little GPU memory) exits with one line
    on stderr, ``<prog>: error: <what to change>``: 2 before start-up, 1 when the engine refuses to start."""
    from engine.startup_error import StartupError
    from svc_common.preflight import prepare_engine_args

    parser.add_argument("--log-level", default=os.environ.get("NVFP4_LOG_LEVEL", "info"),
                        help="critical, error, warning, info or debug (default: $NVFP4_LOG_LEVEL, else info)")
    add_version(parser)
    parser.formatter_class = HelpFormatter
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        prepare_engine_args(args)
        config = to_config(args)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(config))
    except StartupError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def add_server_args(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """The flags every gRPC service shares, defaults taken from its config dataclass."""
    parser.add_argument("--host", default=config_cls.host,
                        help="bind address (default: loopback only; 0.0.0.0 listens on the network)")
    parser.add_argument("--port", type=int, default=config_cls.port, help="gRPC port")
    parser.add_argument("--max-message-bytes", type=int, default=config_cls.max_message_bytes,
                        help="largest gRPC message sent or received")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics over HTTP on this port (default: none; GetMetrics RPC only)")


def server_fields(a: argparse.Namespace) -> dict[str, object]:
    """The config fields of the flags ``add_server_args`` adds."""
    return {"host": a.host, "port": a.port, "max_message_bytes": a.max_message_bytes, "metrics_port": a.metrics_port}
