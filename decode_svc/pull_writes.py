"""One pull's pool writes on the receiver's threads (``PullWrites``) and the lanes of a grpc transfer with lanes
(``PullLanes``): what ``decode_svc/kv_receiver.py`` runs beside its reading of the Prefill stream.

Invariants: at most ``limit`` writes of a stream run behind its reader; ``settle`` returns only once every write
already started has ended, even while the pull is being cancelled (the pages may be freed after it); the first
failure of any lane ends every stream of the transfer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from decode_svc.read_ahead import ReadAhead
from nvfp4_serve_proto import prefill_pb2
from svc_common.errors import PrefillUnavailable


class PullWrites:
    """One pull's pool writes on the receiver's threads, at most ``limit`` running behind the reader.
    ``settle`` waits for every write already started, even when the pull is being cancelled."""

    def __init__(self, executor: concurrent.futures.ThreadPoolExecutor, limit: int):
        self.executor, self.limit = executor, limit
        self._running: list[concurrent.futures.Future] = []
        self.busy_s = 0.0  # seconds the writes ran (copy rate = bytes / busy_s)

    async def post(self, fn: Callable[[], object], what: str, address: str) -> None:
        def timed() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                self.busy_s += time.perf_counter() - t0

        self._running.append(self.executor.submit(timed))
        while len(self._running) > self.limit:
            await self._result(self._running.pop(0), what, address)

    async def drain(self, what: str, address: str) -> None:
        while self._running:
            await self._result(self._running.pop(0), what, address)

    @staticmethod
    async def _result(fut: concurrent.futures.Future, what: str, address: str) -> None:
        try:
            await asyncio.wrap_future(fut)
        except ValueError as e:
            raise PrefillUnavailable(f"bad KV {what} from prefill {address}: {e}") from None

    async def settle(self) -> None:
        running = [f for f in self._running if not f.cancel()]  # not started: dropped
        self._running.clear()
        if running:
            await uncancellable(asyncio.to_thread(concurrent.futures.wait, running))


async def uncancellable(coro) -> None:
    """Run ``coro`` to its end even if the awaiting task is cancelled meanwhile (re-raised afterwards)."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 - reported by whoever reads the task
            break
    if cancelled:
        raise asyncio.CancelledError


@dataclass
class Lane:
    call: grpc.aio.UnaryStreamCall
    ahead: ReadAhead
    writes: PullWrites


class PullLanes:
    """The PrefillLane streams of one grpc transfer with lanes (none without): read ahead each, their pool
    writes apart, received concurrently with the Prefill stream; the first failure of any stream ends all."""

    def __init__(self, read_ahead: int) -> None:
        self.read_ahead = read_ahead  # messages of each lane received ahead of the one being handled
        self.lanes: list[Lane] = []

    def open(self, call: grpc.aio.UnaryStreamCall, writes: PullWrites) -> None:
        self.lanes.append(Lane(call, ReadAhead(call.__aiter__(), self.read_ahead), writes))

    async def run(self, main: Awaitable, lanes: list[Awaitable]) -> tuple[int, prefill_pb2.PrefillDone, float]:
        """``main``'s result (its bytes plus every lane's) once it and every lane completed; the first error of
        any, the others cancelled."""
        tasks = [asyncio.ensure_future(main), *(asyncio.ensure_future(c) for c in lanes)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:  # the first failure in stream order (a cancelled lane's own error comes after)
                if t in done and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            received, done_msg, t_last = tasks[0].result()
            for t in tasks[1:]:
                lane_bytes, lane_last = t.result()
                received, t_last = received + lane_bytes, max(t_last, lane_last)
            return received, done_msg, t_last
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self, address: str) -> None:
        for lane in self.lanes:
            await lane.writes.drain("pages", address)

    def cancel(self) -> None:
        for lane in self.lanes:
            lane.call.cancel()
            lane.ahead.close()

    async def settle(self) -> None:
        for lane in self.lanes:
            await lane.writes.settle()

    def busy_s(self) -> float:
        """Seconds the lanes' pool writes ran (their own, beside lane 0's)."""
        return sum(lane.writes.busy_s for lane in self.lanes)
