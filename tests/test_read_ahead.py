"""The decode's read-ahead of a transfer stream (decode_svc/read_ahead.py): order, end, errors, how far ahead."""

from __future__ import annotations

import asyncio

import pytest

from decode_svc.read_ahead import ReadAhead


async def _stream(items, produced: list, fail: BaseException | None = None):
    for x in items:
        produced.append(x)
        yield x
    if fail is not None:
        raise fail


def test_messages_come_out_in_order_then_the_end_every_time_asked():
    async def main():
        produced = []
        ahead = ReadAhead(_stream([b"a", b"b", b"c"], produced), depth=2)
        got = [await ahead.next() for _ in range(3)]
        for _ in range(2):
            with pytest.raises(StopAsyncIteration):
                await ahead.next()
        ahead.close()
        return got

    assert asyncio.run(main()) == [b"a", b"b", b"c"]


def test_the_stream_error_comes_after_the_messages_before_it():
    async def main():
        ahead = ReadAhead(_stream([b"a"], [], fail=ConnectionError("peer gone")), depth=4)
        assert await ahead.next() == b"a"
        with pytest.raises(ConnectionError, match="peer gone"):
            await ahead.next()
        ahead.close()

    asyncio.run(main())


def test_it_reads_while_the_consumer_is_busy_but_no_more_than_depth_ahead():
    async def main():
        produced = []
        ahead = ReadAhead(_stream([bytes([i]) for i in range(10)], produced), depth=3)
        await asyncio.sleep(0.05)  # the consumer is busy elsewhere: the reader fills the queue, then waits
        # 3 queued + 1 read and waiting to be queued
        assert len(produced) == 4
        assert await ahead.next() == b"\x00"
        await asyncio.sleep(0.05)
        assert len(produced) == 5
        ahead.close()
        await asyncio.sleep(0)
        return produced

    asyncio.run(main())


def test_close_cancels_a_pending_read_and_depth_must_be_positive():
    async def main():
        gate = asyncio.Event()

        async def stalled():
            await gate.wait()
            yield b"never"

        ahead = ReadAhead(stalled(), depth=1)
        await asyncio.sleep(0.01)
        ahead.close()
        await asyncio.sleep(0.01)
        assert ahead._task.cancelled()
        with pytest.raises(ValueError, match="depth"):
            ReadAhead(stalled(), depth=0)

    asyncio.run(main())
