"""The decode's channels to prefill services: one per address, bounded, closed once idle, never while a pull
uses one."""

from __future__ import annotations

import asyncio

from decode_svc.peer_channels import PeerChannels
from svc_common.tls import TLSConfig


def test_channels_are_reused_bounded_and_closed_when_idle():
    async def scenario():
        ch = PeerChannels(TLSConfig(), 1 << 20, max_channels=2, idle_s=3600)
        async with ch.lease("127.0.0.1:1") as a1:
            pass
        async with ch.lease("127.0.0.1:1") as a2:
            reused = a1 is a2
        async with ch.lease("127.0.0.1:2"), ch.lease("127.0.0.1:3"):
            # 1 was idle and least recently used: closed to stay within two; 2 and 3 are in use
            bounded = sorted(ch._peers) == ["127.0.0.1:2", "127.0.0.1:3"]
            async with ch.lease("127.0.0.1:4"):
                in_use_kept = {"127.0.0.1:2", "127.0.0.1:3"} <= set(ch._peers)  # never closed under a pull
        ch.idle_s = 0.0
        async with ch.lease("127.0.0.1:5"):
            idle_closed = sorted(ch._peers) == ["127.0.0.1:5"]
        await ch.close()
        return reused, bounded, in_use_kept, idle_closed, len(ch)

    assert asyncio.run(scenario()) == (True, True, True, True, 0)
