"""A response stream read ahead of the code that handles its messages.

One reader task keeps a read pending on the stream at all times (up to ``depth`` messages wait in a queue),
so the next message is being received while this one is checked and its pool write posted. Read one message at
a time instead, and every moment spent on a message is a moment the stream's receive stands still: the
sender's next message waits for it (docs/benchmarks/transfer_spy.md: on a KV transfer no thread of either
service is near 100% busy; each end waits on the other).

Invariants: messages come out in stream order, each once; the stream's end and its error come out after every
message before them; ``close`` cancels the reader (the stream itself is cancelled by its caller).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class _End:
    error: BaseException | None  # None: the stream ended normally


class ReadAhead:
    def __init__(self, stream: AsyncIterator[bytes], depth: int):
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self._queue: asyncio.Queue[bytes | _End] = asyncio.Queue(depth)
        self._ended: _End | None = None
        self._task = asyncio.ensure_future(self._run(stream))

    async def _run(self, stream: AsyncIterator[bytes]) -> None:
        try:
            async for msg in stream:
                await self._queue.put(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader of the queue, raised there
            await self._queue.put(_End(e))
            return
        await self._queue.put(_End(None))

    async def next(self) -> bytes:
        """The next message; StopAsyncIteration once the stream ended, or the stream's own error."""
        if self._ended is None:
            item = await self._queue.get()
            if not isinstance(item, _End):
                return item
            self._ended = item
        if self._ended.error is not None:
            raise self._ended.error
        raise StopAsyncIteration

    def close(self) -> None:
        self._task.cancel()
