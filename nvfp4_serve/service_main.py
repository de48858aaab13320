"""Common entry point of a service process: parse once, configure logging, run under uvloop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable


def run_service(parser: argparse.ArgumentParser, to_config: Callable, serve: Callable,
                argv: list[str] | None = None) -> int:
    parser.add_argument("--log-level", default=os.environ.get("NVFP4_LOG_LEVEL", "info"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = to_config(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config))
    return 0


def add_server_args(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """The flags every gRPC service shares, defaults taken from its config dataclass."""
    parser.add_argument("--host", default=config_cls.host, help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=config_cls.port)
    parser.add_argument("--max-message-bytes", type=int, default=config_cls.max_message_bytes)
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics over HTTP here")
