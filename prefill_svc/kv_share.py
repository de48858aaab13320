"""The prefill's side of the by-reference paths (cuda-ipc, nixl): its endpoint, its pool's share (CUDA IPC
handles, or NIXL agent metadata and registered addresses), the path choice per request, and the holds that
keep source pages alive until the decode has copied them.

Hold lifecycle (one per cuda-ipc or nixl transfer; every transition on the service's event loop):

    open (before the header) --ReleaseTransfer(transfer_id)--> released  -> the stream ends OK
                             --stream cancelled / broken-----> stream_ended
                             --hold_timeout_s after the last---> expired  -> DEADLINE_EXCEEDED
                               page message (touch)
    then (whatever ended it) the worker aborts the engine request, which frees or caches its pages.

So a killed decode or a cancelled stream never leaks prefill pages, and the pages are never freed
while a decode that keeps to the deadline may still be copying them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_pool import KVPool
from nvfp4_serve_proto import common_pb2, prefill_pb2
from svc_common.errors import TransferTimeout
from svc_common.kv_transfer import (
    PATH_GRPC,
    PATH_IPC,
    PATH_NIXL,
    PATH_RELAY,
    PathChoice,
    TransferMetrics,
    describe,
    local_endpoint,
    select_path,
    wanted_path,
)
from svc_common.kv_transfer_ipc import export_share, pool_rows
from svc_common.kv_transfer_nixl import NixlAgent, export_nixl_share

log = logging.getLogger(__name__)

Exporter = Callable[[KVPool], list[prefill_pb2.SharedTensor]]
NixlExporter = Callable[[KVPool, str], tuple[NixlAgent, prefill_pb2.KVShare]]


def export_nixl(pool: KVPool, name: str) -> tuple[NixlAgent, prefill_pb2.KVShare]:
    """This process's NIXL agent ``name`` with ``pool`` registered, and the nixl fields of its share."""
    agent = NixlAgent(name, pool)
    return agent, export_nixl_share(pool, agent)


@dataclass
class Hold:
    """One by-reference (cuda-ipc or nixl) transfer's hold on its source pages."""

    transfer_id: str  # random and unguessable: only the decode that got the header can release it
    timeout_s: float
    deadline: float  # time.monotonic() at which the pages are freed whatever the decode does
    released: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: str = ""  # set when it ends: released | stream_ended | expired

    def touch(self) -> None:
        """More pages were named: the decode has ``timeout_s`` from now to copy them (pages stream while the
        prompt runs, so the deadline counts from the last page message, not from the header)."""
        if not self.released.is_set():
            self.deadline = time.monotonic() + self.timeout_s

    def check(self) -> None:
        """Raise TransferTimeout once the deadline passed (the caller's stream then ends and frees the pages)."""
        if time.monotonic() > self.deadline and not self.released.is_set():
            self.outcome = "expired"
            raise TransferTimeout(f"the decode did not copy and release transfer {self.transfer_id[:8]} within "
                                  f"{self.timeout_s:g} s of its last page message; its source pages are freed")

    async def wait_released(self) -> None:
        """Return once released; TransferTimeout at the deadline."""
        try:
            await asyncio.wait_for(self.released.wait(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            pass
        self.check()
        self.outcome = "released"


class TransferHolds:
    """The open holds of this prefill, by transfer id."""

    def __init__(self) -> None:
        self._open: dict[str, Hold] = {}

    def open(self, timeout_s: float) -> Hold:
        """A new hold whose deadline starts now (call right before sending the header)."""
        hold = Hold(secrets.token_hex(16), timeout_s, time.monotonic() + timeout_s)
        self._open[hold.transfer_id] = hold
        return hold

    def release(self, transfer_id: str) -> bool:
        """The decode's copies are complete; False when the id is unknown (ended, expired or never opened)."""
        hold = self._open.get(transfer_id)
        if hold is None:
            return False
        hold.released.set()
        return True

    def close(self, hold: Hold) -> str:
        """Forget ``hold`` (its pages are about to be freed); returns how it ended."""
        self._open.pop(hold.transfer_id, None)
        hold.outcome = hold.outcome or "stream_ended"
        return hold.outcome

    def __len__(self) -> int:
        return len(self._open)


class KVShareSource:
    """What this prefill offers the by-reference paths. The pool is exported lazily, per path, on the first
    GetKVShare that path is chosen for (once per process: CUDA IPC handles, or a NIXL agent with every pool
    tensor registered); ``share_id`` names this process's shares so that a decode holding a share of an
    earlier process on the same address is told to fetch the new one."""

    def __init__(self, pool: KVPool, layout: common_pb2.KVLayout, mode: str, hold_timeout_s: float,
                 metrics: TransferMetrics, endpoint: common_pb2.TransferEndpoint | None = None,
                 exporter: Exporter = export_share, nixl_exporter: NixlExporter = export_nixl,
                 relayed: bool = False):
        self.pool = pool
        self.relayed = relayed  # every caller comes through this prefill's sender process: grpc becomes relay
        self.layout = layout
        self.mode = mode
        self.hold_timeout_s = hold_timeout_s
        self.metrics = metrics
        self.endpoint = endpoint if endpoint is not None else local_endpoint(pool.device, mode)
        self.holds = TransferHolds()
        self._exporters = {PATH_IPC: self._export_ipc, PATH_NIXL: self._export_nixl}
        self._exporter, self._nixl_exporter = exporter, nixl_exporter
        self._share_id = uuid.uuid4().hex
        self._shares: dict[str, prefill_pb2.KVShare] = {}  # path -> exported (or failed, with .error), once
        self.nixl_agent: NixlAgent | None = None  # lives as long as the process: decodes read through it
        self._lock = asyncio.Lock()
        log.info("KV transfer endpoint of this prefill: %s", describe(self.endpoint))

    def exported(self, path: str) -> bool:
        """The pool is shared for ``path`` (PATH_IPC or PATH_NIXL)."""
        share = self._shares.get(path)
        return share is not None and not share.error

    @property
    def share_id(self) -> str:
        """This process's share id once its pool was exported for any path, else ""."""
        return self._share_id if any(not s.error for s in self._shares.values()) else ""

    async def kv_share(self, request: prefill_pb2.KVShareRequest) -> prefill_pb2.KVShare:
        """The answer to GetKVShare: the share of the path the rule chooses with the caller's endpoint, or an
        ``error`` saying why there is none (shares go only to a caller with which cuda-ipc or nixl is chosen)."""
        choice = select_path(self.endpoint, request.endpoint, "prefill", "caller")
        if choice.path == PATH_GRPC:
            return prefill_pb2.KVShare(endpoint=self.endpoint, layout=self.layout, error=choice.detail)
        async with self._lock:
            if choice.path not in self._shares:
                try:
                    share = await asyncio.to_thread(self._exporters[choice.path])
                    share.MergeFrom(prefill_pb2.KVShare(endpoint=self.endpoint, share_id=self._share_id,
                                                        layout=self.layout))
                    self._shares[choice.path] = share
                    log.info("KV pool shared for %s transfers (%d tensors, share %s)", choice.path,
                             len(share.tensors), self._share_id[:8])
                except Exception as e:  # noqa: BLE001 - any failure means "no share": decodes use gRPC
                    log.warning("cannot share the KV pool for %s (transfers use gRPC): %s: %s", choice.path,
                                type(e).__name__, e)
                    self._shares[choice.path] = prefill_pb2.KVShare(
                        endpoint=self.endpoint, layout=self.layout,
                        error=f"prefill cannot share its pool for {choice.path}: {type(e).__name__}: {e}")
        return self._shares[choice.path]

    def _export_ipc(self) -> prefill_pb2.KVShare:
        return prefill_pb2.KVShare(num_pages=pool_rows(self.pool), tensors=self._exporter(self.pool))

    def _export_nixl(self) -> prefill_pb2.KVShare:
        self.nixl_agent, share = self._nixl_exporter(self.pool, f"prefill-{self._share_id}")
        return share

    def choose(self, request: prefill_pb2.PrefillRequest) -> PathChoice:
        """The path of one request's transfer; counted in the metrics (warns when cuda-ipc or nixl was asked
        for on this end and another path is taken). Behind a sender process, a grpc transfer is counted as
        grpc (what the decode gets) and taken as PATH_RELAY (the sender sends the bytes)."""
        choice = self._choose(request)
        peer = f"decode {request.transfer.endpoint.hostname or '?'} {request.transfer.endpoint.device or '?'}"
        self.metrics.count(peer, choice, wanted=wanted_path(self.mode))
        if self.relayed and choice.path == PATH_GRPC:
            return PathChoice(PATH_RELAY, choice.reason, choice.detail)
        return choice

    def _choose(self, request: prefill_pb2.PrefillRequest) -> PathChoice:
        if not request.HasField("transfer"):
            return PathChoice(PATH_GRPC, "no_mode", "the decode states no transfer endpoint")
        offer = request.transfer
        choice = select_path(self.endpoint, offer.endpoint, "prefill", "decode")
        if choice.path == PATH_GRPC:
            return choice
        if not offer.ipc_share_id:
            return PathChoice(PATH_GRPC, "no_share", "the decode has not opened this prefill's pool")
        if not self.exported(choice.path):
            return PathChoice(PATH_GRPC, "share_failed", f"this prefill's pool is not shared for {choice.path}")
        if offer.ipc_share_id != self._share_id:
            return PathChoice(PATH_GRPC, "share_changed", "the decode holds the share of an earlier prefill process")
        return choice
