"""The decode's side of the cuda-ipc path: per prefill address, that prefill's pool opened through CUDA
IPC (or why it is not), and the offer each PrefillRequest carries.

A share is fetched with GetKVShare on the first pull from an address and opened once; it is fetched
again when a header shows that the prefill process changed (its share id), and, after a failure,
once ``retry_s`` passed. Opening never fails a request: every failure means "gRPC bytes this time"
with a warning (once per address and reason) and a metrics count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.kv_pool import KVPool
from nvfp4_serve.kv_transfer import PATH_GRPC, PATH_IPC, PathChoice, describe, local_endpoint, select_path
from nvfp4_serve.kv_transfer_ipc import PoolView, open_share
from nvfp4_serve.layout import check_layout
from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)

Opener = Callable[[prefill_pb2.KVShare, KVPool], PoolView]
_SHARE_RPC_TIMEOUT_S = 10.0


@dataclass
class PeerShare:
    """What this decode knows about one prefill address."""

    choice: PathChoice  # PATH_IPC exactly when ``view`` is open
    share_id: str = ""
    view: PoolView | None = None
    fetched_at: float = 0.0  # time.monotonic()


class PrefillShares:
    def __init__(self, pool: KVPool, layout: common_pb2.KVLayout, mode: str,
                 endpoint: common_pb2.TransferEndpoint | None = None, opener: Opener = open_share,
                 retry_s: float = 60.0):
        self.pool = pool
        self.layout = layout
        self.mode = mode
        self.endpoint = endpoint if endpoint is not None else local_endpoint(pool.device, mode)
        self.opener = opener
        self.retry_s = retry_s
        self._peers: dict[str, PeerShare] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        log.info("KV transfer endpoint of this decode: %s", describe(self.endpoint))

    @property
    def wants_ipc(self) -> bool:
        """This end asked for cuda-ipc (then a gRPC fallback is warned about)."""
        return self.mode == "cuda-ipc"

    async def offer(self, address: str, stub: prefill_pb2_grpc.PrefillStub) -> tuple[prefill_pb2.TransferOffer,
                                                                                    PeerShare]:
        """The TransferOffer of the next pull from ``address`` and the share it names (view None: gRPC)."""
        own = select_path(self.endpoint, self.endpoint, "decode", "decode")
        if own.path == PATH_GRPC:  # this end alone rules IPC out: no RPC at all (CPU deployments)
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
        else:
            peer = await self._open(address, share, now)
        self._peers[address] = peer
        return peer

    async def _open(self, address: str, share: prefill_pb2.KVShare, now: float) -> PeerShare:
        try:
            check_layout(self.layout, share.layout, "decode", "prefill")
            view = await asyncio.to_thread(self.opener, share, self.pool)
        except Exception as e:  # noqa: BLE001 - any failure to open means gRPC bytes, never a failed request
            detail = f"cannot open the pool of prefill {address} through CUDA IPC: {type(e).__name__}: {e}"
            log.warning("%s; its transfers use gRPC (retried in %g s)", detail, self.retry_s)
            return PeerShare(PathChoice(PATH_GRPC, "open_failed", detail), share.share_id, None, now)
        log.info("opened the KV pool of prefill %s (%s) for cuda-ipc transfers: %d tensors, %d pages",
                 address, share.endpoint.device, len(share.tensors), view.num_pages)
        return PeerShare(PathChoice(PATH_IPC, ""), share.share_id, view, now)
