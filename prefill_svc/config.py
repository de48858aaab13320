"""Prefill service configuration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from engine.config import EngineConfig
from nvfp4_serve.engine_args import add_engine_args, engine_config_from_args
from nvfp4_serve.service_main import add_server_args
from nvfp4_serve.tls import TLSConfig, add_tls_args, tls_from_args


@dataclass(frozen=True)
class PrefillConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 16 * 1024 * 1024  # every KV message stays under this (minus a header margin)
    metrics_port: int | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)
    # Fault injection for tests only: sleep this long before the transfer header / before each KV page message.
    debug_header_delay_s: float = 0.0
    debug_transfer_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        for flag, value in (("--debug-header-delay-s", self.debug_header_delay_s),
                            ("--debug-transfer-delay-s", self.debug_transfer_delay_s)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("nvfp4-serve prefill", description="Run the prefill gRPC service.")
    add_server_args(p, PrefillConfig)
    p.add_argument("--debug-header-delay-s", type=float, default=0.0,
                   help="testing only: sleep before the transfer header (to trip the decode's first-message deadline)")
    p.add_argument("--debug-transfer-delay-s", type=float, default=0.0,
                   help="testing only: sleep before each KV page message (to kill a prefill mid-transfer)")
    add_tls_args(p)
    add_engine_args(p)
    return p


def config_from_args(a: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(engine=engine_config_from_args(a), host=a.host, port=a.port,
                         max_message_bytes=a.max_message_bytes, metrics_port=a.metrics_port, tls=tls_from_args(a),
                         debug_header_delay_s=a.debug_header_delay_s, debug_transfer_delay_s=a.debug_transfer_delay_s)
