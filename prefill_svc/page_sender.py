"""The grpc path's sending side of one transfer: runs of pool pages exported as page messages (``PageExporter``)
and handed, in order, to the Prefill stream or to the transfer's lanes.

Used where the bytes leave: by the engine's process (``prefill_svc/worker.py``, ``--kv-sender thread``) and by
the sender process beside it (``prefill_svc/sender_stream.py``, ``--kv-sender process``), which exports the same
pages out of the pool it opened at start-up.

    pages(ids, first, fence) --exports (gather + one D2H copy + framing, a few in flight on worker
    threads), each a few messages of one layer--> messages in layer order, lane by lane

Invariants: messages leave in ``_export_units`` order (every layer's pages in sequence order); a cancelled
``pages`` leaves no export queued (one already running ends on its thread and its bytes are dropped).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from engine.fence import Fence
from prefill_svc.lanes import LaneTransfer
from svc_common.page_export import ExportTimes, PageExporter

HEADER_MARGIN = 4096  # bytes kept free in each message for the protobuf framing
_MESSAGES_PER_EXPORT = 8  # messages gathered and copied to host at once (one gather, one device->host copy)
# exports of a stream in flight while its messages go out: one export at a time kept the stream waiting for a
# third of a ready transfer (the export, ~2 GB/s on one thread, was slower than the stream's send). In the
# engine's process a third one measured worse (its threads wait for the GIL behind the engine thread); the
# sender process shares its GIL with nothing else and keeps three in flight (--kv-exports-ahead sets either).
EXPORTS_AHEAD = 2
EXPORTS_AHEAD_SENDER_PROCESS = 3


def exports_ahead(configured: int, sender_process: bool) -> int:
    """Exports in flight per transfer: ``--kv-exports-ahead`` (``configured``), else the measured default of the
    process that sends (the engine's, or the sender process beside it)."""
    if configured:
        return configured
    return EXPORTS_AHEAD_SENDER_PROCESS if sender_process else EXPORTS_AHEAD

log = logging.getLogger(__name__)


def pages_per_message(max_message_bytes: int, kv_message_bytes: int, page_bytes: int) -> int:
    """Pages of one layer per message: ``--kv-message-bytes`` of pages, under ``--max-message-bytes`` with room
    for the framing, at least one. ValueError when one page does not fit a message."""
    if max_message_bytes - HEADER_MARGIN < page_bytes:
        raise ValueError(f"one KV page of one layer is {page_bytes} bytes, over --max-message-bytes "
                         f"{max_message_bytes}: lower --page-size or raise the limit")
    return max(1, min(max_message_bytes - HEADER_MARGIN, kv_message_bytes) // page_bytes)


def export_units(layers: Sequence[int], num_pages: int, per_message: int, max_messages: int
                 ) -> list[tuple[int, int, int]]:
    """(layer, first page, pages) of each export of a stream's pages, in send order: every layer's pages in
    order, the first export one message, each next one twice as many messages up to ``max_messages``. The
    stream sends nothing before its first export is complete: a small first one starts it early; the large
    ones after it cost fewer gathers and copies per byte."""
    out, size = [], per_message
    for layer in layers:
        i = 0
        while i < num_pages:
            m = min(size, num_pages - i)
            out.append((layer, i, m))
            i += m
            size = min(2 * size, per_message * max_messages)
    return out


class PageSender:
    """One transfer's page messages: ``pages`` for each run of pages as it becomes ready; the counters say
    whether the exports kept up with the stream (``log_line``)."""

    def __init__(self, exporter: PageExporter, rid: str, per_message: int, num_layers: int,
                 lanes: LaneTransfer | None = None, debug_delay_s: float = 0.0,
                 before_export: Callable[[], None] | None = None, exports_ahead: int = EXPORTS_AHEAD):
        self.exporter, self.rid, self.per_message, self.num_layers = exporter, rid, per_message, num_layers
        self.lanes = lanes  # the transfer's other streams (None: every message on this stream)
        self.debug_delay_s = debug_delay_s  # tests only (svc_common/fault_injection.py)
        self.before_export = before_export  # raises to stop the transfer before an export reads the pool
        self.exports_ahead = exports_ahead
        self.num_bytes = 0
        self.t_start = time.perf_counter()
        self.export_s = 0.0  # seconds the exports ran (on worker threads, summed)
        self.export_times = ExportTimes()  # the same time split into device copies and framing
        self._export_lock = threading.Lock()  # exports run on several threads at once
        self.export_wait_s = 0.0  # seconds this stream waited for an export to send its messages
        self.first_message_s = 0.0  # from ``t_start`` to the first page message handed over

    async def pages(self, page_ids: list[int], first: int, fence: Fence | None,
                    layers: Sequence[int] | None = None) -> AsyncIterator[bytes]:
        """Messages of sequence pages [first, first + len(page_ids)) of ``layers`` (default: every layer), in
        layer order; messages of a lane's layers go to that lane, the rest are yielded."""
        n = self.per_message
        runs = export_units(range(self.num_layers) if layers is None else layers, len(page_ids), n,
                            _MESSAGES_PER_EXPORT)

        def timed(layer: int, i: int, m: int) -> list[bytes]:
            t0 = time.perf_counter()
            try:
                return self.exporter.messages(self.rid, layer, first + i, page_ids[i:i + m], n, fence,
                                              self.export_times)
            finally:
                with self._export_lock:
                    self.export_s += time.perf_counter() - t0

        def export(k: int) -> asyncio.Future[list[bytes]]:
            if self.before_export is not None:
                self.before_export()
            return asyncio.ensure_future(asyncio.to_thread(timed, *runs[k]))

        ahead: collections.deque[asyncio.Future[list[bytes]]] = collections.deque()  # the next units, exporting
        try:
            for k in range(len(runs)):
                while len(ahead) < self.exports_ahead and k + len(ahead) < len(runs):
                    ahead.append(export(k + len(ahead)))
                t_wait = time.perf_counter()
                msgs = await ahead.popleft()
                self.export_wait_s += time.perf_counter() - t_wait
                lane = self.lanes.lane_of(runs[k][0]) if self.lanes is not None else 0
                for msg in msgs:
                    if self.debug_delay_s:
                        await asyncio.sleep(self.debug_delay_s)
                    if not self.num_bytes:
                        self.first_message_s = time.perf_counter() - self.t_start
                    self.num_bytes += len(msg)
                    if lane:
                        await self.lanes.put(lane, msg)
                    else:
                        yield msg
        finally:
            for f in ahead:
                f.cancel()  # an export already running ends on its thread; its bytes are dropped

    def log_line(self, seconds: float, where: str) -> None:
        """Whether the sender kept up: the stream's waits for its page exports."""
        log.info("request %s: %.1f MB of pages via grpc (%s) in %.1f ms after the header, the first message after "
                 "%.1f ms; %.1f ms exporting them%s, %.1f ms of the stream's time waiting for an export (each "
                 "waits for its chunk's writes first)", self.rid, self.num_bytes / 1e6, where, seconds * 1e3,
                 self.first_message_s * 1e3, self.export_s * 1e3, self.export_times.summary(),
                 self.export_wait_s * 1e3)
