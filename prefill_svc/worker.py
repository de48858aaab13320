"""Prefill worker: runs prompts on the engine loop (batched with every other prompt in flight) and
turns their pages into the transfer stream: header, pages layer by layer, first token.

The header states the path (``prefill_svc/kv_share.py`` chooses it per request):

    grpc      KVPageRun messages carry the pages' bytes;
    cuda-ipc  KVPageRefs messages name the source pages, which the decode copies out of this process's
              pool; the pool writes are fenced (complete) before the header, and the pages stay held
              until ReleaseTransfer, the end of the stream, or the hold deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator

from engine.engine_loop import EngineLoop
from engine.kv_pool import PagePayload
from engine.request import Request, StepOutput
from nvfp4_serve.convert import check_token_ids, sampling_from_proto
from nvfp4_serve.errors import InvalidRequest, check_request_id, engine_error
from nvfp4_serve.kv_transfer import PATH_IPC, TRANSFER_MODES, TransferMetrics
from nvfp4_serve.kv_transfer_ipc import Fence
from nvfp4_serve.layout import check_layout, layout_of
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve_proto import prefill_pb2
from prefill_svc.kv_share import Hold, KVShareSource

_HEADER_MARGIN = 4096  # bytes kept free in each message for the protobuf framing
_PAGE_ID_BYTES = 5  # most bytes of one packed int32 page id in a KVPageRefs message


class PrefillWorker:
    def __init__(self, loop: EngineLoop, max_message_bytes: int, metrics: ServiceMetrics,
                 debug_transfer_delay_s: float = 0.0, debug_header_delay_s: float = 0.0,
                 kv_transfer: str = "auto", kv_hold_timeout_s: float = 60.0):
        self.loop = loop
        self.debug_delay = debug_transfer_delay_s
        self.debug_header_delay = debug_header_delay_s
        # Engine request ids are made unique here: callers are independent decode services whose ids may collide.
        self._seq = itertools.count()
        self.engine = loop.engine
        self.layout = layout_of(self.engine)
        self.metrics = metrics
        self.page_size = self.layout.page_size
        page_bytes = self.engine.pool.page_bytes_per_layer
        self.pages_per_message = (max_message_bytes - _HEADER_MARGIN) // page_bytes
        if self.pages_per_message < 1:
            raise ValueError(f"one KV page of one layer is {page_bytes} bytes, over --max-message-bytes "
                             f"{max_message_bytes}: lower --page-size or raise the limit")
        self.refs_per_message = (max_message_bytes - _HEADER_MARGIN) // _PAGE_ID_BYTES
        self.transfer_metrics = TransferMetrics(metrics)
        self.share = KVShareSource(self.engine.pool, self.layout, kv_transfer, kv_hold_timeout_s,
                                   self.transfer_metrics)

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
        return ids

    async def prefill(self, request: prefill_pb2.PrefillRequest) -> AsyncIterator[prefill_pb2.PrefillMessage]:
        ids = self._validate(request)
        rid = request.request_id
        req = Request(f"{rid}#{next(self._seq)}", ids, sampling_from_proto(request.sampling), prefill_only=True)
        aio_loop = asyncio.get_running_loop()
        done: asyncio.Future[StepOutput] = aio_loop.create_future()

        def on_output(out) -> None:
            if isinstance(out, StepOutput):
                aio_loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        t0 = time.perf_counter()
        self.metrics.prompt_tokens.inc(len(ids))
        self.loop.submit(req, on_output)
        hold: Hold | None = None
        try:
            out = await done
            if out.error or out.finish_reason != "prefill":
                raise engine_error(out.error or f"prefill ended with {out.finish_reason}")
            self.metrics.ttft.observe(time.perf_counter() - t0)
            if self.debug_header_delay:
                await asyncio.sleep(self.debug_header_delay)
            first_page = request.prefix_len // self.page_size
            num_pages = math.ceil(len(ids) / self.page_size) - first_page
            pages = req.page_ids[first_page:first_page + num_pages]
            choice = self.share.choose(request)
            header = prefill_pb2.TransferHeader(
                layout=self.layout, num_tokens=len(ids), prefix_len=request.prefix_len, first_page=first_page,
                num_pages=num_pages, path=choice.path, endpoint=self.share.endpoint, share_id=self.share.share_id)
            if choice.path == PATH_IPC:
                fence = await asyncio.wrap_future(self.loop.call(lambda: Fence(self.engine.pool.device)))
                await asyncio.to_thread(fence.wait)  # every page is written before any message names it
                hold = self.share.holds.open(self.share.hold_timeout_s)
                header.transfer_id, header.hold_timeout_s = hold.transfer_id, hold.timeout_s
                messages = self._page_refs(rid, header, pages, hold)
            else:
                messages = self._page_bytes(rid, header, pages)
            yield prefill_pb2.PrefillMessage(request_id=rid, header=header)
            async for msg in messages:
                yield msg
            yield prefill_pb2.PrefillMessage(request_id=rid, done=prefill_pb2.PrefillDone(
                first_token_id=out.new_token_ids[0], num_computed_tokens=len(ids) - out.num_cached_tokens))
            if hold is not None:
                t1 = time.perf_counter()
                await hold.wait_released()
                self.metrics.observe_transfer(num_pages * self.layout.num_layers * self.engine.pool.page_bytes_per_layer,
                                              time.perf_counter() - t1)
            self.metrics.requests.labels("ok").inc()
        except BaseException:
            self.metrics.requests.labels("failed").inc()
            raise
        finally:
            if hold is not None:
                self.transfer_metrics.holds.labels(self.share.holds.close(hold)).inc()
            self.loop.abort(req.rid)  # frees (or caches) its transient pages whatever ended the stream

    async def _page_bytes(self, rid: str, header: prefill_pb2.TransferHeader,
                          pages: list[int]) -> AsyncIterator[prefill_pb2.PrefillMessage]:
        """grpc path: every page's bytes, layer by layer, in runs under the message size limit. The next run is
        read out of the pool (on a worker thread) while this one is sent."""
        n = self.pages_per_message
        runs = [(layer, i) for layer in range(self.layout.num_layers) for i in range(0, len(pages), n)]

        def export(k: int) -> asyncio.Future[PagePayload]:
            layer, i = runs[k]
            return asyncio.ensure_future(asyncio.to_thread(self.engine.pool.export_pages, layer, pages[i:i + n]))

        t1, sent = time.perf_counter(), 0
        ahead = export(0) if runs else None
        try:
            for k, (layer, i) in enumerate(runs):
                if self.debug_delay:
                    await asyncio.sleep(self.debug_delay)
                payload, ahead = await ahead, (export(k + 1) if k + 1 < len(runs) else None)
                sent += payload.num_bytes
                yield prefill_pb2.PrefillMessage(request_id=rid, pages=prefill_pb2.KVPageRun(
                    layer=layer, first_page=header.first_page + i, num_pages=len(pages[i:i + n]),
                    k=payload.k, k_scales=payload.k_sf, v=payload.v, v_scales=payload.v_sf))
        finally:
            if ahead is not None:
                ahead.cancel()  # an export already running ends on its thread; its bytes are dropped
        self.metrics.observe_transfer(sent, time.perf_counter() - t1)

    async def _page_refs(self, rid: str, header: prefill_pb2.TransferHeader, pages: list[int],
                         hold: Hold) -> AsyncIterator[prefill_pb2.PrefillMessage]:
        """cuda-ipc path: each layer's source page ids (the pages themselves stay held in this pool)."""
        for layer in range(self.layout.num_layers):
            for start in range(0, len(pages), self.refs_per_message):
                if self.debug_delay:
                    await asyncio.sleep(self.debug_delay)
                hold.check()
                yield prefill_pb2.PrefillMessage(request_id=rid, page_refs=prefill_pb2.KVPageRefs(
                    layer=layer, first_page=header.first_page + start,
                    src_page_ids=pages[start:start + self.refs_per_message]))
