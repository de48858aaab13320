"""gRPC channels from a decode service to its prefill services: one per address, reused by every pull,
closed once idle, and bounded in number (a channel costs memory and a polling thread's time even idle).

A decode pulls only from the prefill addresses its deployment names (``--prefill-addresses``), so the
bound is a second line of defence; a channel in use by a pull is never closed under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from nvfp4_serve_proto import prefill_pb2, prefill_pb2_grpc
from svc_common.grpc_server import server_options
from svc_common.tls import TLSConfig, open_channel

# A restarted prefill is reached again within a second (gRPC's default backoff grows to 120 s).
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                      ("grpc.max_reconnect_backoff_ms", 1000)]
PREFILL_METHOD = "/nvfp4serve.v1.Prefill/Prefill"
LANE_METHOD = "/nvfp4serve.v1.Prefill/PrefillLane"
# A lane's channel gets a TCP connection of its own (channels with equal arguments share gRPC's global
# subchannel pool, so they would share one connection, and its one reader).
_LANE_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


@dataclass
class PeerStubs:
    channel: grpc.aio.Channel
    stub: prefill_pb2_grpc.PrefillStub  # every method, protobuf in and out
    prefill: grpc.aio.UnaryStreamMultiCallable  # Prefill with each response left as its serialized bytes
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # PrefillLane on lanes 1, 2, ...: each on a channel (connection) of its own, opened on first use
    lanes: list[tuple[grpc.aio.Channel, grpc.aio.UnaryStreamMultiCallable]] = field(default_factory=list)

    async def close(self) -> None:
        for ch in [self.channel, *(c for c, _ in self.lanes)]:
            await ch.close()


class PeerChannels:
    def __init__(self, tls: TLSConfig, max_message_bytes: int, max_channels: int = 16, idle_s: float = 300.0):
        self.tls = tls
        self.options = [*server_options(max_message_bytes), *_RECONNECT_OPTIONS]
        self.max_channels = max_channels
        self.idle_s = idle_s
        self._peers: dict[str, PeerStubs] = {}

    def __len__(self) -> int:
        return len(self._peers)

    @contextlib.asynccontextmanager
    async def lease(self, address: str) -> AsyncIterator[PeerStubs]:
        """The stubs of ``address`` for one pull (its channel stays open until the pull ends)."""
        peer = self._open(address)
        peer.users += 1
        try:
            yield peer
        finally:
            peer.users -= 1
            peer.last_used = time.monotonic()

    def lane_calls(self, address: str, peer: PeerStubs, lanes: int) -> list[grpc.aio.UnaryStreamMultiCallable]:
        """PrefillLane of ``address`` on lanes 1 .. lanes - 1 (the channels opened once, kept with the peer's)."""
        while len(peer.lanes) < lanes - 1:
            ch = open_channel(address, self.tls, [*self.options, *_LANE_OPTIONS])
            peer.lanes.append((ch, ch.unary_stream(
                LANE_METHOD, request_serializer=prefill_pb2.PrefillLaneRequest.SerializeToString,
                response_deserializer=None)))
        return [call for _, call in peer.lanes[:lanes - 1]]

    def _open(self, address: str) -> PeerStubs:
        self._close_idle()
        peer = self._peers.get(address)
        if peer is None:
            ch = open_channel(address, self.tls, self.options)
            peer = self._peers[address] = PeerStubs(
                ch, prefill_pb2_grpc.PrefillStub(ch),
                ch.unary_stream(PREFILL_METHOD, request_serializer=prefill_pb2.PrefillRequest.SerializeToString,
                                response_deserializer=None))
        peer.last_used = time.monotonic()
        return peer

    def _close_idle(self) -> None:
        """Close channels idle past ``idle_s``, and the least recently used idle ones beyond the bound."""
        now = time.monotonic()
        idle = sorted((p.last_used, a) for a, p in self._peers.items() if p.users == 0)
        excess = len(self._peers) + 1 - self.max_channels
        for i, (last, address) in enumerate(idle):
            if now - last > self.idle_s or i < excess:
                asyncio.ensure_future(self._peers.pop(address).close())

    async def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            await p.close()
