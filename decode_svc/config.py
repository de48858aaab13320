"""Decode service configuration: engine options plus the deadlines of every transfer state."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from engine.config import EngineConfig
from svc_common.engine_args import add_engine_args, engine_config_from_args
from svc_common.fault_injection import FaultInjection, add_fault_args, faults_from_args
from svc_common.kv_transfer import TRANSFER_MODES, check_address, check_mode
from svc_common.service_main import add_server_args
from svc_common.tls import TLSConfig, add_tls_args, tls_from_args


@dataclass(frozen=True)
class Timeouts:
    """Seconds each state may last before the request fails and frees everything it holds."""

    admission_s: float = 300.0  # queued until pages are allocated
    prefill_first_message_s: float = 600.0  # pull started -> transfer header (includes prefill compute)
    between_pages_s: float = 30.0  # between two messages of the transfer stream
    between_tokens_s: float = 120.0  # between two generated tokens

    def __post_init__(self) -> None:
        for name in ("admission_s", "prefill_first_message_s", "between_pages_s", "between_tokens_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"timeout {name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class DecodeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50061
    max_message_bytes: int = 16 * 1024 * 1024
    metrics_port: int | None = None
    timeouts: Timeouts = Timeouts()
    tls: TLSConfig = field(default_factory=TLSConfig)  # server side, and the client side of the pulls from prefill
    kv_transfer: str = "auto"  # svc_common/kv_transfer.py: auto | grpc | cuda-ipc | nixl
    # The prefill services this decode may pull from (host:port, as the router names them); a request naming
    # any other address is refused: a caller alone never decides where KV pages come from.
    prefill_addresses: tuple[str, ...] = ()
    # While prompts are pulled, decode-only steps start at least this far apart (a prefill on the same GPU gets
    # the time between them); 0: never paced. ``nvfp4-serve up`` sets it where a prefill shares the GPU.
    decode_interval_while_pulling_s: float = 0.0
    faults: FaultInjection = field(default_factory=FaultInjection)  # tests only (svc_common/fault_injection.py)

    def __post_init__(self) -> None:
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        check_mode(self.kv_transfer)
        for address in self.prefill_addresses:
            check_address(address, "--prefill-addresses")
        if not 0 <= self.decode_interval_while_pulling_s <= 1:
            raise ValueError(f"--decode-interval-while-pulling-ms must be in [0, 1000], got "
                             f"{self.decode_interval_while_pulling_s * 1e3:g}")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("nvfp4-serve decode", description="Run the decode gRPC service.")
    add_server_args(p, DecodeConfig)
    p.add_argument("--kv-transfer", default=DecodeConfig.kv_transfer, choices=TRANSFER_MODES,
                   help="how KV pages arrive from prefill: auto (CUDA IPC when both ends share a host and both pools "
                        "are on CUDA, else gRPC), grpc (always bytes over gRPC), cuda-ipc (as auto, and warn when "
                        "a transfer falls back to gRPC), nixl (NIXL over UCX reads the pages: any hosts, CPU "
                        "pools too; chosen only when both ends say nixl, else as auto with a warning)")
    p.add_argument("--prefill-addresses", nargs="*", default=[], metavar="HOST:PORT",
                   help="the prefill services this decode pulls KV pages from (a request naming another address "
                        "is refused); none: every prompt runs here")
    p.add_argument("--decode-interval-while-pulling-ms", type=float, default=0.0,
                   help="while prompts are being pulled from a prefill service, start decode-only steps at least "
                        "this far apart, leaving the GPU to a prefill that shares it (0: off; `up` sets it where a "
                        "prefill shares the decode's GPU)")
    t = Timeouts()
    g = p.add_argument_group("deadlines (seconds)")
    g.add_argument("--admission-timeout", type=float, default=t.admission_s,
                   help="longest wait in the queue until the request's pages are allocated")
    g.add_argument("--prefill-first-message-timeout", type=float, default=t.prefill_first_message_s,
                   help="longest wait from the pull's start to the prefill's transfer header (includes the "
                        "prefill's compute)")
    g.add_argument("--between-pages-timeout", type=float, default=t.between_pages_s,
                   help="longest wait between two messages of a KV transfer")
    g.add_argument("--between-tokens-timeout", type=float, default=t.between_tokens_s,
                   help="longest wait between two generated tokens")
    add_tls_args(p)
    add_engine_args(p)
    add_fault_args(p, "decode")
    return p


def config_from_args(a: argparse.Namespace) -> DecodeConfig:
    t = Timeouts(a.admission_timeout, a.prefill_first_message_timeout, a.between_pages_timeout,
                 a.between_tokens_timeout)
    return DecodeConfig(engine=engine_config_from_args(a), host=a.host, port=a.port,
                        max_message_bytes=a.max_message_bytes, metrics_port=a.metrics_port, timeouts=t,
                        tls=tls_from_args(a), faults=faults_from_args(a), kv_transfer=a.kv_transfer,
                        decode_interval_while_pulling_s=a.decode_interval_while_pulling_ms / 1e3,
                        prefill_addresses=tuple(a.prefill_addresses))
