"""Prefill service configuration.

The service's own flags (``--kv-transfer``, ``--kv-hold-timeout``, ``--kv-message-bytes``, ``--kv-sender``, ...) are declared once, as
``Flag`` metadata on their ``PrefillConfig`` fields; the parser and the config of parsed flags are generated from
them (``svc_common/config_flags.py``). The server, TLS, engine and fault-injection flags come from their own
modules."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.config import EngineConfig, flag
from svc_common.config_flags import add_flags, config_from_flags
from svc_common.engine_args import add_engine_args, engine_config_from_args
from svc_common.fault_injection import FaultInjection, add_fault_args, faults_from_args
from svc_common.kv_transfer import TRANSFER_MODES, check_mode
from svc_common.service_main import add_server_args, server_fields
from svc_common.tls import TLSConfig, add_tls_args, tls_from_args

if TYPE_CHECKING:
    import torch


SENDER_THREAD, SENDER_PROCESS = "thread", "process"
KV_SENDERS = ("auto", SENDER_THREAD, SENDER_PROCESS)


@dataclass(frozen=True)
class PrefillConfig:
    # The service's flags are generated in field order (add_flags): --help lists them in this order.
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 16 * 1024 * 1024  # every KV message stays under this (minus a header margin)
    metrics_port: int | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)
    kv_transfer: str = field(default="auto", metadata=flag(  # svc_common/kv_transfer.py: auto | grpc | cuda-ipc | nixl
        "how KV pages reach the decode: auto (CUDA IPC when both ends share a host and both pools are on CUDA, else "
        "gRPC), grpc (always bytes over gRPC), cuda-ipc (as auto, and warn when a transfer falls back to gRPC), nixl "
        "(NIXL over UCX reads the pages: any hosts, CPU pools too; chosen only when both ends say nixl, else as auto "
        "with a warning)", choices=TRANSFER_MODES))
    # cuda-ipc: source pages are freed this long after the last page message
    kv_hold_timeout_s: float = field(default=60.0, metadata=flag(
        "cuda-ipc: seconds after the last page message at which the source pages are freed even if the decode has "
        "not released them", name="--kv-hold-timeout"))
    # grpc path: bytes of page data per message (capped by max_message_bytes). Every message holds at least
    # one page of one layer. 4 MiB: each message costs both ends Python work under the GIL (framing, checks,
    # the write's launches) that the engine thread of the same process waits on; fewer, larger messages
    # leave it more of the GIL (the transfer benchmark's raw grpcio anchor runs at the same message size).
    kv_message_bytes: int = field(default=4 << 20, metadata=flag(
        "grpc path: page bytes per message (at least one page; capped by --max-message-bytes)"))
    # grpc path with lanes (the decode's --kv-grpc-lanes): how long a lane may stay unopened or unread before
    # the transfer fails and frees everything (prefill_svc/lanes.py)
    kv_lane_timeout_s: float = field(default=30.0, metadata=flag(
        "grpc path with lanes: seconds the prefill waits for the decode to open or read each extra stream of a "
        "transfer before failing it", name="--kv-lane-timeout"))
    # grpc path: which process frames and sends page messages (prefill_svc/sender_process.py)
    kv_sender: str = field(default="auto", metadata=flag(
        "grpc path: where page messages are framed and sent: process (a sender process beside the engine serves "
        "this service's port and reads the pool where the engine wrote it, so the engine never waits for the "
        "GIL behind gRPC's copies), thread (in the engine's process), auto (process when the pool is on CUDA)",
        choices=KV_SENDERS))
    # grpc path: page exports (gather, copy to host, framing) a transfer keeps in flight on worker threads while
    # its messages go out (prefill_svc/page_sender.py); 0: the measured default of the sender, page_sender.exports_ahead
    kv_exports_ahead: int = field(default=0, metadata=flag(
        "grpc path: page exports a transfer keeps in flight while its messages go out (0: 3 in a sender process, "
        "2 in the engine's process)"))
    faults: FaultInjection = field(default_factory=FaultInjection)  # tests only (svc_common/fault_injection.py)

    def __post_init__(self) -> None:
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        check_mode(self.kv_transfer)
        if self.kv_message_bytes < 1:
            raise ValueError(f"--kv-message-bytes must be >= 1, got {self.kv_message_bytes}")
        if not self.kv_hold_timeout_s > 0:
            raise ValueError(f"--kv-hold-timeout must be > 0 seconds, got {self.kv_hold_timeout_s}")
        if self.kv_sender not in KV_SENDERS:
            raise ValueError(f"--kv-sender must be one of {', '.join(KV_SENDERS)}, got {self.kv_sender!r}")
        if not 0 <= self.kv_exports_ahead <= 16:
            raise ValueError(f"--kv-exports-ahead must be in 0..16 (0: the default), got {self.kv_exports_ahead}")
        if not self.kv_lane_timeout_s > 0:
            raise ValueError(f"--kv-lane-timeout must be > 0 seconds, got {self.kv_lane_timeout_s}")


def sender_of(config: PrefillConfig, device: torch.device) -> str:
    """SENDER_PROCESS or SENDER_THREAD: ``--kv-sender``, with auto resolved for the pool's ``device``."""
    if config.kv_sender != "auto":
        return config.kv_sender
    return SENDER_PROCESS if device.type == "cuda" else SENDER_THREAD


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("nvfp4-serve prefill", description="Run the prefill gRPC service.")
    add_server_args(p, PrefillConfig)
    add_flags(p, PrefillConfig, skip=("engine",))  # the engine's flags follow the TLS flags, in their group
    add_tls_args(p)
    add_engine_args(p)
    add_fault_args(p, "prefill")
    return p


def config_from_args(a: argparse.Namespace) -> PrefillConfig:
    # A prefill service never runs a decode step (every request ends at its first token): no decode graphs,
    # no start-up compile of the decode kernels, no graph staging buffers.
    engine = replace(engine_config_from_args(a), disable_cuda_graph=True)
    return config_from_flags(PrefillConfig, a, {PrefillConfig: {
        "engine": engine, **server_fields(a), "tls": tls_from_args(a), "faults": faults_from_args(a)}})
