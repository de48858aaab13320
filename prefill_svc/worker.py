"""Prefill worker: runs prompts on the engine loop (batched with every other prompt in flight) and
turns their pages into the transfer stream while they are computed:

    header (with the first chunk's pages) -> pages of chunk 1, every layer -> ... -> the last pages -> done

The header states the path (``prefill_svc/kv_share.py`` chooses it per request):

    grpc      KVPageRun messages carry the pages' bytes;
    cuda-ipc  KVPageRefs messages name the source pages, one message per run of pages for every layer; the
    nixl      decode copies them out of this process's pool (CUDA IPC) or reads them with NIXL (this process's
              registered pool); each chunk's pool writes are complete before a message names its pages, and
              the pages stay held until ReleaseTransfer, the end of the stream, or the hold deadline;
    relay     as cuda-ipc, to this prefill's own sender process (``--kv-sender process``), which sends the
              pages' bytes as the grpc path: the callers of the service never see this path.

So TTFT is the prompt's compute plus the last chunk's transfer, not compute plus the whole transfer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator

from engine.engine_loop import EngineLoop
from engine.fence import Fence
from engine.outcome import Failure, FailureKind, FinishReason
from engine.request import PrefillProgress, Request, StepOutput
from nvfp4_serve_proto import prefill_pb2
from prefill_svc.kv_share import Hold, KVShareSource
from prefill_svc.lanes import LaneTransfer, TransferLanes
from prefill_svc.page_sender import EXPORTS_AHEAD, HEADER_MARGIN, PageSender, pages_per_message
from svc_common.convert import check_token_ids, sampling_from_proto
from svc_common.errors import InvalidRequest, PrefillUnavailable, check_request_id, service_error
from svc_common.fault_injection import FaultInjection
from svc_common.kv_transfer import (
    PATH_GRPC,
    PATH_NIXL,
    PATH_RELAY,
    TRANSFER_MODES,
    TransferMetrics,
    by_reference,
)
from svc_common.kv_transfer_ipc import pool_view
from svc_common.layout import check_layout, layout_of
from svc_common.metrics import ServiceMetrics
from svc_common.page_export import PageExporter

_PAGE_ID_BYTES = 5  # most bytes of one packed int32 page id in a KVPageRefs message


_NO_FAULTS = FaultInjection()  # frozen: one shared default

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, loop: EngineLoop, max_message_bytes: int, metrics: ServiceMetrics,
                 faults: FaultInjection = _NO_FAULTS,
                 kv_transfer: str = "auto", kv_hold_timeout_s: float = 60.0, kv_message_bytes: int = 4 << 20,
                 kv_lane_timeout_s: float = 30.0, relayed: bool = False, exports_ahead: int = EXPORTS_AHEAD):
        """``relayed``: a sender process beside this one serves every caller (prefill_svc/sender_process.py); a
        transfer that would send page bytes names its pages instead (PATH_RELAY) and the sender sends them."""
        self.loop = loop
        self.exports_ahead = exports_ahead  # page exports in flight per transfer (grpc path, this process)
        self.debug_delay = faults.transfer_delay_s  # tests only (svc_common/fault_injection.py); 0 in a deployment
        self.debug_header_delay = faults.header_delay_s
        self.debug_done_delay = faults.done_delay_s
        # Engine request ids are made unique here: callers are independent decode services whose ids may collide.
        self._seq = itertools.count()
        self.engine = loop.engine
        self.layout = layout_of(self.engine)
        self.metrics = metrics
        self.page_size = self.layout.page_size
        self.pages_per_message = pages_per_message(max_message_bytes, kv_message_bytes,
                                                   self.engine.pool.page_bytes_per_layer)
        self.refs_per_message = (max_message_bytes - HEADER_MARGIN) // _PAGE_ID_BYTES
        # behind a sender process no page bytes leave this process (the relay path instead of grpc)
        self.exporter = None if relayed else PageExporter(pool_view(self.engine.pool))
        self.transfer_metrics = TransferMetrics(metrics)
        self.share = KVShareSource(self.engine.pool, self.layout, kv_transfer, kv_hold_timeout_s,
                                   self.transfer_metrics, relayed=relayed)
        self.lanes = TransferLanes(kv_lane_timeout_s)

    def _validate(self, request: prefill_pb2.PrefillRequest) -> list[int]:
        check_request_id(request.request_id)
        ids = check_token_ids(request.token_ids, self.engine.model_config.vocab_size)
        p = request.prefix_len
        if p < 0 or p % self.page_size or p > len(ids):
            raise InvalidRequest(f"prefix_len {p} must be a multiple of the page size {self.page_size} "
                                 f"within the prompt of {len(ids)} tokens")
        if request.HasField("expected_layout"):
            check_layout(self.layout, request.expected_layout, "prefill", "decode")
        mode = request.transfer.endpoint.kv_transfer
        if request.HasField("transfer") and mode not in TRANSFER_MODES:
            raise InvalidRequest(f"transfer.endpoint.kv_transfer must be one of {', '.join(TRANSFER_MODES)}, "
                                 f"got {mode[:40]!r}")
        if request.transfer.grpc_lanes < 0:
            raise InvalidRequest(f"transfer.grpc_lanes must be >= 0, got {request.transfer.grpc_lanes}")
        return ids

    def lane(self, request: prefill_pb2.PrefillLaneRequest) -> AsyncIterator[bytes]:
        """One lane of a grpc transfer with lanes (``prefill_svc/lanes.py``): its page messages, then the end."""
        return self.lanes.serve_lane(request)

    async def prefill(self, request: prefill_pb2.PrefillRequest) -> AsyncIterator[prefill_pb2.PrefillMessage | bytes]:
        """The transfer stream of one prompt. Pages go out as the engine writes them: after each chunk of the
        chunked prefill (``PrefillProgress``), the pages that chunk completed, every layer; after the last
        chunk, the rest and the first token. The header goes out with the first pages (or the end)."""
        ids = self._validate(request)
        rid = request.request_id
        req = Request(f"{rid}#{next(self._seq)}", ids, sampling_from_proto(request.sampling, 1),
                      prefill_only=True)
        aio_loop = asyncio.get_running_loop()
        events: asyncio.Queue[StepOutput | PrefillProgress] = asyncio.Queue()

        computed_at: list[float] = []  # when the engine produced the first token: the prompt's compute is done

        def on_output(ev) -> None:  # on the engine loop thread
            if isinstance(ev, StepOutput) and not computed_at:
                computed_at.append(time.perf_counter())
            if isinstance(ev, (StepOutput, PrefillProgress)):
                aio_loop.call_soon_threadsafe(events.put_nowait, ev)

        t0 = time.perf_counter()
        self.metrics.prompt_tokens.inc(len(ids))
        self.loop.submit(req, on_output)
        first_page = request.prefix_len // self.page_size
        end_page = math.ceil(len(ids) / self.page_size)
        stream = _Stream(self, request, rid, first_page, end_page - first_page)
        try:
            sent, out = first_page, None
            while out is None:
                ev = await _latest(events)
                if isinstance(ev, StepOutput):
                    if ev.failure is not None:
                        raise service_error(ev.failure)
                    if ev.finish_reason is not FinishReason.PREFILLED:
                        why = f"prefill ended with {ev.finish_reason.value if ev.finish_reason else 'no finish reason'}"
                        raise service_error(Failure(FailureKind.INTERNAL, why))
                    # the compute's own time, not when this stream got to it (behind earlier chunks' pages)
                    self.metrics.ttft.observe(computed_at[0] - t0)
                    out, ready, fence = ev, end_page, None  # the first token's sampling synchronised the device
                else:
                    ready, fence = min(ev.kv_len // self.page_size, end_page), ev.fence
                if not stream.started:
                    if self.debug_header_delay:
                        await asyncio.sleep(self.debug_header_delay)
                    yield await stream.start()
                if ready > sent:
                    async for msg in stream.pages(req.page_ids[sent:ready], sent, fence):
                        yield msg
                    sent = ready
            await stream.end_lanes()
            yield prefill_pb2.PrefillMessage(request_id=rid, done=prefill_pb2.PrefillDone(
                first_token_id=out.new_token_ids[0], num_computed_tokens=len(ids) - out.num_cached_tokens))
            if self.debug_done_delay:
                await asyncio.sleep(self.debug_done_delay)
            await stream.finish()
            self.metrics.requests.labels("ok").inc()
        except BaseException:
            self.metrics.requests.labels("failed").inc()
            raise
        finally:
            stream.close()
            self.loop.abort(req.rid)  # frees (or caches) its transient pages whatever ended the stream


async def _latest(events: asyncio.Queue):
    """The next event, skipping progress already superseded by a later event in the queue."""
    ev = await events.get()
    while isinstance(ev, PrefillProgress) and not events.empty():
        ev = events.get_nowait()
    return ev


class _Stream:
    """One prompt's transfer: its header, then page messages for each run of pages as it becomes ready.

    grpc      each (layer, run) as one pre-serialized KVPageRun message (``prefill_svc/page_sender.py``: a few
              runs of a layer gathered on a side stream after the chunk's fence, copied to pinned host memory
              at once, each framed without protobuf copies);
    cuda-ipc  each run's source page ids, every layer in one message, once the chunk's writes are complete
    nixl      (the decode copies them out of this pool; relay: this prefill's sender process sends their
    relay     bytes); the hold keeps the pages until ReleaseTransfer, the stream's end, or ``hold_timeout_s``
              after the last message.
    """

    def __init__(self, worker: PrefillWorker, request: prefill_pb2.PrefillRequest, rid: str, first_page: int,
                 num_pages: int):
        self.w, self.request, self.rid = worker, request, rid
        self.first_page, self.num_pages = first_page, num_pages
        self.started = False
        self.hold: Hold | None = None
        self.lanes: LaneTransfer | None = None  # grpc with lanes: the other streams of this transfer
        self.completed = False
        self.serving = False  # nixl: this process's agent serves the decode's READs until close()
        self.path = ""
        self.num_bytes = 0
        self.t_header = 0.0
        self.sender: PageSender | None = None  # grpc: this transfer's page messages

    async def start(self) -> prefill_pb2.PrefillMessage:
        w = self.w
        choice = w.share.choose(self.request)
        self.path = choice.path
        header = prefill_pb2.TransferHeader(
            layout=w.layout, num_tokens=len(self.request.token_ids), prefix_len=self.request.prefix_len,
            first_page=self.first_page, num_pages=self.num_pages, path=choice.path, endpoint=w.share.endpoint,
            share_id=w.share.share_id)
        if by_reference(choice.path):
            self.hold = w.share.holds.open(w.share.hold_timeout_s)
            header.transfer_id, header.hold_timeout_s = self.hold.transfer_id, self.hold.timeout_s
        lanes = w.lanes.lanes_for(self.request.transfer.grpc_lanes, w.layout.num_layers, self.num_pages)
        if choice.path == PATH_GRPC and lanes > 1:
            self.lanes = w.lanes.open(lanes)
            header.transfer_id, header.lanes = self.lanes.transfer_id, lanes
        if choice.path == PATH_NIXL:
            w.share.nixl_agent.serve_begin()
            self.serving = True
        if choice.path == PATH_GRPC:
            self.sender = PageSender(w.exporter, self.rid, w.pages_per_message, w.layout.num_layers, self.lanes,
                                     w.debug_delay, exports_ahead=w.exports_ahead)
        self.started, self.t_header = True, time.perf_counter()
        return prefill_pb2.PrefillMessage(request_id=self.rid, header=header)

    async def pages(self, page_ids: list[int], first: int, fence: Fence | None
                    ) -> AsyncIterator[prefill_pb2.PrefillMessage | bytes]:
        """Messages for sequence pages [first, first + len(page_ids)), every layer, in layer order."""
        w = self.w
        if by_reference(self.path):
            if fence is not None:
                await asyncio.to_thread(fence.wait)  # every page is written before any message names it
            # one message names a run's pages of every layer, or (a decode that does not read num_layers) of one
            step = w.layout.num_layers if self.request.transfer.refs_all_layers or self.path == PATH_RELAY else 1
            for i in range(0, len(page_ids), w.refs_per_message):
                for layer in range(0, w.layout.num_layers, step):
                    if w.debug_delay:
                        await asyncio.sleep(w.debug_delay)
                    self.hold.check()
                    refs = page_ids[i:i + w.refs_per_message]
                    yield prefill_pb2.PrefillMessage(request_id=self.rid, page_refs=prefill_pb2.KVPageRefs(
                        layer=layer, num_layers=step, first_page=first + i, src_page_ids=refs))
                    self.num_bytes += len(refs) * w.engine.pool.page_bytes_per_layer * step
            self.hold.touch()
            return
        async for msg in self.sender.pages(page_ids, first, fence):
            yield msg
        self.num_bytes = self.sender.num_bytes

    async def end_lanes(self) -> None:
        """Before PrefillDone: every lane's stream ends after its last queued page."""
        if self.lanes is not None:
            await self.lanes.end()

    async def finish(self) -> None:
        """After PrefillDone: cuda-ipc and nixl wait for the decode's release (or the hold's deadline); grpc
        with lanes for every lane's stream to have sent its pages."""
        if self.hold is not None:
            await self.hold.wait_released()
        if self.lanes is not None:
            await self.lanes.drained()
        self.completed = True
        seconds = time.perf_counter() - self.t_header
        self.w.metrics.observe_transfer(self.num_bytes, seconds, len(self.request.token_ids) - self.request.prefix_len)
        if self.sender is not None:
            self.sender.log_line(seconds, "engine process")

    def close(self) -> None:
        if self.lanes is not None:
            self.w.lanes.close(self.lanes, None if self.completed else
                               PrefillUnavailable("the Prefill stream of the transfer ended early"))
        if self.serving:
            self.w.share.nixl_agent.serve_end()
        if self.hold is not None:
            self.w.transfer_metrics.holds.labels(self.w.share.holds.close(self.hold)).inc()
