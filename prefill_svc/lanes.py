"""The extra streams (lanes) of one grpc transfer: the pages of some layers leave on PrefillLane streams that
the decode opens beside the Prefill stream, each on a connection of its own, so the messages of several
layers are on the wire at once (one stream sends one message at a time and waits for it to leave).

    Prefill stream (lane 0):  header (lanes = L, transfer_id) -> pages of layers l % L == 0 -> ... -> done
    PrefillLane(id, k):                                         pages of layers l % L == k -> ... -> end OK

The Prefill stream's producer hands lane k's messages to a bounded queue (``put``); the lane's handler
(``stream``) yields them. Invariants:
- a lane is opened at most once, by the holder of the unguessable transfer id, while the transfer is open;
- the producer never waits longer than ``wait_s`` for a lane's room (a lane never opened, or read too
  slowly, fails the transfer with TransferTimeout);
- a failure on either side (the Prefill stream cancelled or failed, a lane cancelled) ends every stream of
  the transfer with an error, and ``close`` forgets the transfer: nothing stays queued.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from svc_common.errors import InvalidRequest, LaneInUse, PrefillUnavailable, TransferTimeout, UnknownTransfer

MAX_LANES = 8  # streams per transfer, whatever a decode asks for
_QUEUE_MESSAGES = 2  # messages queued per lane (each up to --kv-message-bytes)


@dataclass(frozen=True)
class _End:
    error: BaseException | None  # None: every message was handed over


class LaneTransfer:
    def __init__(self, transfer_id: str, lanes: int, wait_s: float):
        self.transfer_id, self.lanes, self.wait_s = transfer_id, lanes, wait_s
        self._queues = {k: asyncio.Queue(_QUEUE_MESSAGES) for k in range(1, lanes)}
        self._opened: set[int] = set()
        self._running: dict[int, asyncio.Event] = {}  # lane -> set when its stream has ended
        self._error: BaseException | None = None
        self._failed = asyncio.Event()  # set with _error

    def mark_opened(self, lane: int) -> None:
        """Lane ``lane`` is being opened; LaneInUse if it already was."""
        if lane in self._opened:
            raise LaneInUse(f"lane {lane} of transfer {self.transfer_id[:8]} is already open")
        self._opened.add(lane)

    def lane_of(self, layer: int) -> int:
        return layer % self.lanes

    async def put(self, lane: int, msg: bytes) -> None:
        """Queue ``msg`` for lane ``lane`` (1 .. lanes - 1), waiting up to ``wait_s`` for room."""
        self._raise_if_failed()
        q = self._queues[lane]
        if not q.full():
            q.put_nowait(msg)
            return
        put, failed = asyncio.ensure_future(q.put(msg)), asyncio.ensure_future(self._failed.wait())
        try:  # a failure elsewhere wakes this wait at once (it drains the queues only once)
            await asyncio.wait((put, failed), timeout=self.wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (put, failed):
                t.cancel()
        self._raise_if_failed()
        if not put.done() or put.cancelled():
            opened = "read too slowly" if lane in self._opened else "never opened"
            raise TransferTimeout(f"lane {lane} of transfer {self.transfer_id[:8]} was {opened}: no room for a "
                                  f"page message within {self.wait_s:g} s")

    async def end(self) -> None:
        """Every page is queued: each lane's stream ends once it has sent its messages."""
        for lane in self._queues:
            await self.put(lane, _End(None))

    async def drained(self) -> None:
        """Return once every lane's stream has sent everything and ended (each was opened and read)."""
        for lane in self._queues:
            self._raise_if_failed()
            if lane not in self._running:
                self._running[lane] = asyncio.Event()
            try:
                await asyncio.wait_for(self._running[lane].wait(), self.wait_s)
            except TimeoutError:
                raise TransferTimeout(f"lane {lane} of transfer {self.transfer_id[:8]} did not finish within "
                                      f"{self.wait_s:g} s of its last message") from None
        self._raise_if_failed()

    def fail(self, error: BaseException) -> None:
        """End every stream of the transfer with ``error``; queued messages are dropped."""
        if self._error is not None:
            return
        self._error = error
        self._failed.set()
        for q in self._queues.values():
            while not q.empty():
                q.get_nowait()
            q.put_nowait(_End(error))
        for ended in self._running.values():
            ended.set()  # wakes drained(), which raises

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PrefillUnavailable(f"transfer {self.transfer_id[:8]} failed: {self._error}")

    async def stream(self, lane: int) -> AsyncIterator[bytes]:
        """Lane ``lane``'s messages until the transfer's end (checked opened once by ``TransferLanes.open_lane``)."""
        ended = self._running.setdefault(lane, asyncio.Event())
        ok = False
        try:
            while True:
                item = await self._queues[lane].get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise PrefillUnavailable(f"transfer {self.transfer_id[:8]} failed: {item.error}")
                    ok = True
                    return
                yield item
        finally:
            if not ok:  # cancelled by the decode, or the transfer failed: every stream of it ends
                self.fail(PrefillUnavailable(f"lane {lane} ended before its last message"))
            ended.set()


class TransferLanes:
    """The open lane transfers of this prefill, by transfer id."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self._open: dict[str, LaneTransfer] = {}

    def open(self, lanes: int) -> LaneTransfer:
        t = LaneTransfer(secrets.token_hex(16), lanes, self.wait_s)
        self._open[t.transfer_id] = t
        return t

    def lanes_for(self, offered: int, num_layers: int, num_pages: int) -> int:
        """Streams of a transfer whose decode offered ``offered`` (TransferOffer.grpc_lanes): at most
        ``MAX_LANES`` and one per layer; one when no page travels."""
        return min(offered, MAX_LANES, num_layers) if num_pages else 1

    async def serve_lane(self, request) -> AsyncIterator[bytes]:
        """One PrefillLane stream (a ``PrefillLaneRequest``): the lane's page messages, then the end."""
        if not request.transfer_id or len(request.transfer_id) > 64 or not request.transfer_id.isalnum():
            raise InvalidRequest("transfer_id must be the 1-64 letters and digits of a transfer header")
        transfer = self.open_lane(request.transfer_id, request.lane)
        async for msg in transfer.stream(request.lane):
            yield msg

    def open_lane(self, transfer_id: str, lane: int) -> LaneTransfer:
        """The transfer a PrefillLane request names, with ``lane`` marked opened (once)."""
        t = self._open.get(transfer_id)
        if t is None:
            raise UnknownTransfer(f"no open transfer {transfer_id[:8]!r} with lanes")
        if not 1 <= lane < t.lanes:
            raise InvalidRequest(f"lane {lane} outside 1..{t.lanes - 1} of transfer {transfer_id[:8]}")
        t.mark_opened(lane)
        return t

    def close(self, t: LaneTransfer, error: BaseException | None) -> None:
        """Forget ``t``; with ``error`` (the Prefill stream did not complete), its lanes end with it."""
        if error is not None:
            t.fail(error)
        self._open.pop(t.transfer_id, None)

    def __len__(self) -> int:
        return len(self._open)
