"""Bounded admission: at most N requests generate at once, at most M wait (FIFO), the rest get a 429.

    acquire() --slot free--> run ... release()
        |--all busy, queue < M--> wait (FIFO, at most queue_timeout_s, else 503)
        '--all busy, queue full--> 429 + Retry-After

Invariant: ``num_active`` <= max_active; a released slot passes straight to the oldest waiter (it never
becomes free in between, so a newcomer cannot overtake the queue).
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.openai_protocol import OpenAIError


class AdmissionGate:
    """The generation slots of one router process (used from its event loop only)."""

    def __init__(self, max_active: int, max_queued: int, queue_timeout_s: float, retry_after_s: int = 1) -> None:
        if max_active < 1 or max_queued < 0 or queue_timeout_s <= 0:
            raise ValueError(f"AdmissionGate needs max_active >= 1, max_queued >= 0 and queue_timeout_s > 0 "
                             f"(got {max_active}, {max_queued}, {queue_timeout_s})")
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.num_active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def _overloaded(self, status: int, message: str) -> OpenAIError:
        return OpenAIError(status, message, code="overloaded", headers={"Retry-After": str(self.retry_after_s)})

    async def acquire(self) -> None:
        """Take a slot, waiting in line if needed. Raises 429 when the line is full, 503 after the timeout."""
        if self.num_active < self.max_active and not self._waiters:
            self.num_active += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise self._overloaded(429, f"server overloaded: {self.num_active} requests running and "
                                        f"{len(self._waiters)} queued (limits {self.max_active} and "
                                        f"{self.max_queued}); retry later")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived as we gave up: pass it on
            else:
                fut.cancel()
                if fut in self._waiters:  # release() may have skipped it already
                    self._waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise self._overloaded(503, f"timed out after {self.queue_timeout_s:g}s waiting for a free "
                                            f"generation slot; retry later") from None
            raise

    def release(self) -> None:
        """Give a slot back (to the oldest waiter if any)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        if self.num_active <= 0:
            raise RuntimeError("AdmissionGate.release without a matching acquire")
        self.num_active -= 1
