"""The decode's side of the by-reference paths: per prefill address, that prefill's pool opened through CUDA
IPC or NIXL (or why it is not), and the offer each PrefillRequest carries.

Which one is opened is ``select_path`` of both endpoints: nixl when both ends say --kv-transfer nixl (then
this process's one NIXL agent is started, its pool registered, on the first such share), else cuda-ipc.

A share is fetched with GetKVShare on the first pull from an address and opened once; it is fetched
again when a header shows that the prefill process changed (its share id), and, after a failure,
once ``retry_s`` passed. Opening never fails a request: every failure means "gRPC bytes this time"
with a warning (once per address and reason) and a metrics count.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.kv_pool import KVPool
from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from svc_common.kv_transfer import (
    PATH_GRPC,
    PATH_IPC,
    PATH_NIXL,
    PathChoice,
    describe,
    local_endpoint,
    select_path,
    wanted_path,
)
from svc_common.kv_transfer_ipc import PoolView, open_share
from svc_common.kv_transfer_nixl import NixlAgent, NixlUnavailable, NixlView, open_nixl_share
from svc_common.layout import check_layout

log = logging.getLogger(__name__)

Opener = Callable[[prefill_pb2.KVShare, KVPool], PoolView]
AgentFactory = Callable[[str, KVPool], NixlAgent]
_SHARE_RPC_TIMEOUT_S = 10.0


@dataclass
class PeerShare:
    """What this decode knows about one prefill address."""

    choice: PathChoice  # PATH_IPC or PATH_NIXL exactly when ``view`` is open (a PoolView or a NixlView)
    share_id: str = ""
    view: PoolView | NixlView | None = None
    fetched_at: float = 0.0  # time.monotonic()


class PrefillShares:
    def __init__(self, pool: KVPool, layout: common_pb2.KVLayout, mode: str,
                 endpoint: common_pb2.TransferEndpoint | None = None, opener: Opener = open_share,
                 retry_s: float = 60.0, nixl_agent: AgentFactory = NixlAgent):
        self.pool = pool
        self.layout = layout
        self.mode = mode
        self.endpoint = endpoint if endpoint is not None else local_endpoint(pool.device, mode)
        self.opener = opener
        self.retry_s = retry_s
        self._peers: dict[str, PeerShare] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._nixl_factory = nixl_agent
        self.nixl: NixlAgent | None = None  # this process's agent, started on the first nixl share
        self._nixl_error = ""  # why it cannot start (then never retried: NIXL or UCX is missing here)
        self._nixl_lock = asyncio.Lock()
        log.info("KV transfer endpoint of this decode: %s", describe(self.endpoint))

    @property
    def wanted(self) -> str:
        """The path this end asked for ("" for none): taking another one is warned about."""
        return wanted_path(self.mode)

    async def offer(self, address: str, stub: prefill_pb2_grpc.PrefillStub) -> tuple[prefill_pb2.TransferOffer,
                                                                                    PeerShare]:
        """The TransferOffer of the next pull from ``address`` and the share it names (view None: gRPC)."""
        own = select_path(self.endpoint, self.endpoint, "decode", "decode")
        if own.path == PATH_GRPC:  # this end alone rules IPC and NIXL out: no RPC at all (CPU deployments)
            peer = PeerShare(own)
        else:
            lock = self._locks.setdefault(address, asyncio.Lock())
            async with lock:
                peer = self._peers.get(address)
                if peer is None or (peer.view is None and time.monotonic() - peer.fetched_at > self.retry_s):
                    peer = await self._fetch(address, stub)
        return prefill_pb2.TransferOffer(endpoint=self.endpoint,
                                         ipc_share_id=peer.share_id if peer.view is not None else ""), peer

    def forget(self, address: str, share_id: str) -> None:
        """The prefill at ``address`` no longer serves ``share_id`` (it restarted): fetch again next time."""
        peer = self._peers.get(address)
        if peer is not None and peer.share_id == share_id:
            del self._peers[address]

    async def _fetch(self, address: str, stub: prefill_pb2_grpc.PrefillStub) -> PeerShare:
        now = time.monotonic()
        try:
            share = await stub.GetKVShare(prefill_pb2.KVShareRequest(endpoint=self.endpoint),
                                        timeout=_SHARE_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            # not remembered: the prefill may be restarting; the Prefill call reports a real outage
            return PeerShare(PathChoice(PATH_GRPC, "share_failed", f"GetKVShare failed: {e.code().name}"), "",
                             None, now)
        choice = select_path(self.endpoint, share.endpoint, "decode", "prefill")
        if choice.path == PATH_GRPC:
            peer = PeerShare(choice, fetched_at=now)
        elif share.error or not share.share_id:
            peer = PeerShare(PathChoice(PATH_GRPC, "no_share", share.error or "the prefill shares no pool"),
                             fetched_at=now)
        elif choice.path == PATH_NIXL and not await self._start_nixl():
            peer = PeerShare(PathChoice(PATH_GRPC, "nixl_unavailable", self._nixl_error), fetched_at=now)
            log.warning("KV transfers from prefill %s use gRPC: %s", address, self._nixl_error)
        else:
            peer = await self._open(address, share, choice.path, now)
        self._peers[address] = peer
        return peer

    async def _start_nixl(self) -> bool:
        """Start this process's NIXL agent and register the pool, once; False (and why, kept) if it cannot."""
        async with self._nixl_lock:
            if self.nixl is None and not self._nixl_error:
                try:
                    self.nixl = await asyncio.to_thread(self._nixl_factory, f"decode-{uuid.uuid4().hex}", self.pool)
                    log.info("NIXL agent %s started, KV pool registered (%s)", self.nixl.name, self.nixl.mem_type)
                except NixlUnavailable as e:
                    self._nixl_error = str(e)
        return self.nixl is not None

    async def _open(self, address: str, share: prefill_pb2.KVShare, path: str, now: float) -> PeerShare:
        how = "through CUDA IPC" if path == PATH_IPC else "with NIXL"
        try:
            check_layout(self.layout, share.layout, "decode", "prefill")
            if path == PATH_IPC:
                view = await asyncio.to_thread(self.opener, share, self.pool)
            else:
                view = await asyncio.to_thread(open_nixl_share, share, self.pool, self.nixl)
        except Exception as e:  # noqa: BLE001 - any failure to open means gRPC bytes, never a failed request
            detail = f"cannot open the pool of prefill {address} {how}: {type(e).__name__}: {e}"
            log.warning("%s; its transfers use gRPC (retried in %g s)", detail, self.retry_s)
            return PeerShare(PathChoice(PATH_GRPC, "open_failed", detail), share.share_id, None, now)
        log.info("opened the KV pool of prefill %s (%s) for %s transfers: %d tensors, %d pages",
                 address, share.endpoint.device, path, len(share.tensors), view.num_pages)
        return PeerShare(PathChoice(path, ""), share.share_id, view, now)
