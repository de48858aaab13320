"""Which way a prompt's KV pages travel from prefill to decode: the gRPC byte stream, CUDA IPC or NIXL.

Both ends state a ``TransferEndpoint`` in the handshake (the decode in ``PrefillRequest.transfer``,
the prefill in ``KVShare`` and ``TransferHeader``): host identity, device, and its ``--kv-transfer``
mode. ``select_path`` is the one rule both ends apply:

    nixl      when both ends say --kv-transfer nixl (any hosts, CPU or GPU pools: NIXL over UCX
              reads the prefill's pages into the decode's pool);
    cuda-ipc  otherwise, when neither end says --kv-transfer grpc, both run on one host (equal, known boot ids)
              and both pools live on CUDA devices;
    grpc      otherwise (it works everywhere).

``cuda-ipc`` as a mode means "expect GPU-direct": it is chosen under the same rule as ``auto``, and a
request that falls back to gRPC anyway logs a warning. ``nixl`` on one end only is ``auto`` for
that pair (and warned about). No request ever fails because IPC or NIXL was unavailable: the decode
falls back to gRPC whenever the prefill's pool cannot be opened (or NIXL cannot start).

cuda-ipc and nixl are the by-reference paths (``by_reference``): the prefill names source page ids
(KVPageRefs) and holds the pages until the decode released them; only how the decode copies differs.

Host identity is the kernel's boot id (/proc/sys/kernel/random/boot_id): random per boot, shared by
every process and container of one running host, different on any other host. The hostname is
carried for logs only (containers of one host have different hostnames and can still share memory
when they share the IPC namespace).
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import Counter

from nvfp4_serve_proto import common_pb2
from svc_common.metrics import ServiceMetrics

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TRANSFER_MODES = ("auto", "grpc", "cuda-ipc", "nixl")
PATH_GRPC = "grpc"
PATH_IPC = "cuda-ipc"
PATH_NIXL = "nixl"
# Between a prefill's engine process and its own sender process only (prefill_svc/sender_process.py): the engine
# names source pages as on cuda-ipc, and the sender, which opened the pool when it was started, sends their bytes
# as the grpc path. Never in a header a decode receives.
PATH_RELAY = "relay"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def check_mode(mode: str, flag: str = "--kv-transfer") -> str:
    """Raise ValueError (naming the choices) unless ``mode`` is a transfer mode."""
    if mode not in TRANSFER_MODES:
        raise ValueError(f"{flag} must be one of {', '.join(TRANSFER_MODES)}, got {mode!r}")
    return mode


_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")  # host:port, [v6]:port


def check_address(address: str, what: str = "address") -> str:
    """Raise ValueError unless ``address`` is host:port with a port in 1..65535."""
    m = _ADDRESS.match(address)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{what} {address[:80]!r} is not host:port with a port in 1..65535")
    return address


def boot_id() -> str:
    """This host's boot id, or "" when it cannot be read (then no peer is ever on the same host)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def device_id(device: torch.device | str) -> str:
    """"cuda:<GPU UUID>" for a CUDA device (the same GPU reads the same in every process, whatever
    CUDA_VISIBLE_DEVICES says), "cpu" otherwise."""
    import torch  # here: the launcher reads TRANSFER_MODES without importing torch

    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda:{uuid}" if uuid is not None else f"cuda:index-{index}"  # any "cuda:" id selects IPC


def local_endpoint(device: torch.device | str, mode: str) -> common_pb2.TransferEndpoint:
    """The endpoint of this process with its pool on ``device`` and ``--kv-transfer mode``."""
    return common_pb2.TransferEndpoint(hostname=socket.gethostname(), boot_id=boot_id(),
                                       device=device_id(device), kv_transfer=check_mode(mode))


def by_reference(path: str) -> bool:
    """``path`` names source pages (KVPageRefs) held by the prefill until ReleaseTransfer, not page bytes."""
    return path in (PATH_IPC, PATH_NIXL, PATH_RELAY)


def wanted_path(mode: str) -> str:
    """The path ``--kv-transfer mode`` asks for ("" for auto and grpc: no fallback is warned about)."""
    return mode if by_reference(mode) else ""


class PathChoice(NamedTuple):
    path: str  # PATH_GRPC | PATH_IPC | PATH_NIXL
    reason: str  # why gRPC: one of FALLBACK_REASONS ("" for a by-reference path), a metrics label
    detail: str = ""  # the same for a log line


# Every reason a transfer takes gRPC although IPC or NIXL was possible in principle (bounded metrics labels).
FALLBACK_REASONS = ("kv_transfer_grpc", "no_mode", "host_unknown", "different_hosts", "not_cuda", "no_share",
                    "share_failed", "open_failed", "share_changed", "nixl_unavailable")


def select_path(mine: common_pb2.TransferEndpoint, theirs: common_pb2.TransferEndpoint,
                me: str, them: str) -> PathChoice:
    """The path a transfer between ``mine`` and ``theirs`` takes (symmetric in the two ends)."""
    for who, ep in ((me, mine), (them, theirs)):
        if ep.kv_transfer == "grpc":
            return PathChoice(PATH_GRPC, "kv_transfer_grpc", f"{who} has --kv-transfer grpc")
        if ep.kv_transfer not in TRANSFER_MODES:  # "" from a peer that predates the handshake
            return PathChoice(PATH_GRPC, "no_mode", f"{who} states no transfer mode")
    if mine.kv_transfer == theirs.kv_transfer == PATH_NIXL:  # asked for on both ends: no host or device condition
        return PathChoice(PATH_NIXL, "")
    if not mine.boot_id or not theirs.boot_id:
        return PathChoice(PATH_GRPC, "host_unknown", "a boot id is unknown: cannot tell whether both run on one host")
    if mine.boot_id != theirs.boot_id:
        return PathChoice(PATH_GRPC, "different_hosts",
                          f"{me} on {mine.hostname or '?'} and {them} on {theirs.hostname or '?'} are different hosts")
    for who, ep in ((me, mine), (them, theirs)):
        if not ep.device.startswith("cuda:"):
            return PathChoice(PATH_GRPC, "not_cuda", f"the {who} pool is on {ep.device or 'an unknown device'}")
    return PathChoice(PATH_IPC, "")


def describe(ep: common_pb2.TransferEndpoint) -> str:
    return f"{ep.hostname or '?'} {ep.device or '?'} (--kv-transfer {ep.kv_transfer or '?'})"


class TransferMetrics:
    """Per-path counters of one service, registered on its ``ServiceMetrics`` registry:

    ``nvfp4_<role>_kv_transfer_path_total{path}``        transfers by the path they took
    ``nvfp4_<role>_kv_transfer_grpc_reasons_total{reason}`` why each gRPC transfer did not take cuda-ipc
                                                          or nixl (one of FALLBACK_REASONS)
    ``nvfp4_<role>_kv_transfer_wait_seconds_total``      decode: pull start -> transfer header (prefill
                                                          queueing and compute); the transfer itself is
                                                          ``..._kv_transfer_seconds`` (header -> last page in)
    ``nvfp4_<role>_kv_transfer_copy_seconds_total`` decode: time the pool writes of transfers ran (pages
                                                          stream while the prefill computes, so the
                                                          transfer's own duration says little of its rate)
    ``nvfp4_<role>_kv_transfer_phase_seconds_total{phase}`` decode: a transfer's span cut into phases
                                                          (decode_svc/transfer_phases.py: first_page, stream,
                                                          done, drain, finish)
    ``nvfp4_<role>_kv_nixl_reads_total``                 decode: NIXL READs issued (one per run of pages, every
                                                          layer's together), and ``..._nixl_descriptors_total``
                                                          their descriptors (one per part and run of consecutive
                                                          pages: the fewer, the faster a READ)
    ``nvfp4_<role>_kv_holds_total{outcome}``              prefill, cuda-ipc and nixl: how the hold on source pages ended
                                                          (released | stream_ended | expired)
    """

    def __init__(self, metrics: ServiceMetrics):
        r, p = metrics.registry, f"nvfp4_{metrics.role}"
        self.path = Counter(f"{p}_kv_transfer_path", "KV transfers by path", ["path"], registry=r)
        self.grpc_reasons = Counter(f"{p}_kv_transfer_grpc_reasons", "why a KV transfer took gRPC, not cuda-ipc or nixl",
                                    ["reason"], registry=r)
        self.wait_seconds = Counter(f"{p}_kv_transfer_wait_seconds",
                                    "pull start to transfer header (prefill queueing and compute)", registry=r)
        self.copy_seconds = Counter(f"{p}_kv_transfer_copy_seconds",
                                    "time spent writing received pages into the pool (copy rate = bytes / this)",
                                    registry=r)
        self.phase_seconds = Counter(f"{p}_kv_transfer_phase_seconds", "transfer header to pages in, by phase "
                                     "(first_page, stream, done, drain, finish)", ["phase"], registry=r)
        self.nixl_reads = Counter(f"{p}_kv_nixl_reads", "NIXL READs issued (one per run of pages, every layer's)",
                                  registry=r)
        self.nixl_descriptors = Counter(f"{p}_kv_nixl_descriptors", "descriptors of the NIXL READs issued (one per "
                                        "part and run of consecutive pages)", registry=r)
        self.holds = Counter(f"{p}_kv_holds", "by-reference holds on prefill source pages by outcome", ["outcome"],
                             registry=r)
        self._warned: set[tuple[str, str]] = set()

    def count(self, peer: str, choice: PathChoice, wanted: str) -> None:
        """Count one transfer's path (and why gRPC); warn, once per peer and reason, when a transfer takes
        another path than ``wanted`` (the path this end's mode asked for, "" for none)."""
        self.path.labels(choice.path).inc()
        if choice.path == PATH_GRPC:
            self.grpc_reasons.labels(choice.reason).inc()
        if wanted and choice.path != wanted and (peer, choice.reason) not in self._warned:
            self._warned.add((peer, choice.reason))
            taken = "gRPC" if choice.path == PATH_GRPC else choice.path
            log.warning("KV transfer with %s falls back to %s: %s", peer, taken,
                        choice.detail or choice.reason or f"the peer does not ask for {wanted}")
