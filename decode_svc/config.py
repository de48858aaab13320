"""Decode service configuration: engine options plus the deadlines of every transfer state.

The service's own flags (``--kv-transfer``, ``--prefill-addresses``, ``--decode-interval-while-pulling-ms`` and
the deadlines) are declared once, as ``Flag`` metadata on their ``DecodeConfig`` and ``Timeouts`` fields; the
parser and the config of parsed flags are generated from them (``svc_common/config_flags.py``). The server, TLS,
engine and fault-injection flags come from their own modules."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig, flag
from svc_common.config_flags import add_flags, config_from_flags
from svc_common.engine_args import add_engine_args, engine_config_from_args
from svc_common.fault_injection import FaultInjection, add_fault_args, faults_from_args
from svc_common.kv_transfer import TRANSFER_MODES, check_address, check_mode
from svc_common.service_main import add_server_args, server_fields
from svc_common.tls import TLSConfig, add_tls_args, tls_from_args

DEADLINES = "deadlines (seconds)"  # the --help group of the Timeouts flags


def _deadline(seconds: float, name: str, help_text: str) -> Any:
    return field(default=seconds, metadata=flag(help_text, name=name, group=DEADLINES))


@dataclass(frozen=True)
class Timeouts:
    """Seconds each state may last before the request fails and frees everything it holds."""

    admission_s: float = _deadline(  # queued until pages are allocated
        300.0, "--admission-timeout", "longest wait in the queue until the request's pages are allocated")
    prefill_first_message_s: float = _deadline(  # pull started -> transfer header (includes prefill compute)
        600.0, "--prefill-first-message-timeout",
        "longest wait from the pull's start to the prefill's transfer header (includes the prefill's compute)")
    between_pages_s: float = _deadline(  # between two messages of the transfer stream
        30.0, "--between-pages-timeout", "longest wait between two messages of a KV transfer")
    between_tokens_s: float = _deadline(  # between two generated tokens
        120.0, "--between-tokens-timeout", "longest wait between two generated tokens")

    def __post_init__(self) -> None:
        for name in ("admission_s", "prefill_first_message_s", "between_pages_s", "between_tokens_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"timeout {name} must be > 0, got {getattr(self, name)}")


def _seconds_of_ms(ms: float) -> dict[str, float]:
    return {"decode_interval_while_pulling_s": ms / 1e3}


@dataclass(frozen=True)
class DecodeConfig:
    # The service's flags are generated in field order (add_flags): --help lists them in this order.
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50061
    max_message_bytes: int = 16 * 1024 * 1024
    metrics_port: int | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)  # server side, and the client side of the pulls from prefill
    kv_transfer: str = field(default="auto", metadata=flag(  # svc_common/kv_transfer.py: auto | grpc | cuda-ipc | nixl
        "how KV pages arrive from prefill: auto (CUDA IPC when both ends share a host and both pools are on CUDA, "
        "else gRPC), grpc (always bytes over gRPC), cuda-ipc (as auto, and warn when a transfer falls back to gRPC), "
        "nixl (NIXL over UCX reads the pages: any hosts, CPU pools too; chosen only when both ends say nixl, else as "
        "auto with a warning)", choices=TRANSFER_MODES))
    # The prefill services this decode may pull from (host:port, as the router names them); a request naming
    # any other address is refused: a caller alone never decides where KV pages come from.
    prefill_addresses: tuple[str, ...] = field(default=(), metadata=flag(
        "the prefill services this decode pulls KV pages from (a request naming another address is refused); "
        "none: every prompt runs here", nargs="*", metavar="HOST:PORT"))
    # While prompts are pulled, decode-only steps start at least this far apart (a prefill on the same GPU gets
    # the time between them); 0: never paced. ``nvfp4-serve up`` sets it where a prefill shares the GPU.
    # The flag takes milliseconds.
    decode_interval_while_pulling_s: float = field(default=0.0, metadata=flag(
        "while prompts are being pulled from a prefill service, start decode-only steps at least this far apart, "
        "leaving the GPU to a prefill that shares it (0: off; `up` sets it where a prefill shares the decode's GPU)",
        name="--decode-interval-while-pulling-ms", default=0.0, has_default=True, to_fields=_seconds_of_ms))
    # grpc path: streams per transfer, each on a connection of its own (the prefill caps them at 8 and at the
    # layer count); layer l travels on stream l % lanes
    kv_grpc_lanes: int = field(default=1, metadata=flag(
        "grpc path: streams each transfer's pages are spread over, each on its own connection (layer l on stream "
        "l %% lanes; at most 8)"))
    timeouts: Timeouts = Timeouts()
    faults: FaultInjection = field(default_factory=FaultInjection)  # tests only (svc_common/fault_injection.py)

    def __post_init__(self) -> None:
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        check_mode(self.kv_transfer)
        for address in self.prefill_addresses:
            check_address(address, "--prefill-addresses")
        if not 1 <= self.kv_grpc_lanes <= 8:
            raise ValueError(f"--kv-grpc-lanes must be in [1, 8], got {self.kv_grpc_lanes}")
        if not 0 <= self.decode_interval_while_pulling_s <= 1:
            raise ValueError(f"--decode-interval-while-pulling-ms must be in [0, 1000], got "
                             f"{self.decode_interval_while_pulling_s * 1e3:g}")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("nvfp4-serve decode", description="Run the decode gRPC service.")
    add_server_args(p, DecodeConfig)
    add_flags(p, DecodeConfig, skip=("engine",))  # the engine's flags follow the TLS flags, in their group
    add_tls_args(p)
    add_engine_args(p)
    add_fault_args(p, "decode")
    return p


def config_from_args(a: argparse.Namespace) -> DecodeConfig:
    return config_from_flags(DecodeConfig, a, {DecodeConfig: {
        "engine": engine_config_from_args(a), **server_fields(a), "tls": tls_from_args(a),
        "faults": faults_from_args(a)}})
