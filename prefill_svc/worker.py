"""Prefill worker: runs prompts on the engine loop (batched with every other prompt in flight) and
turns their pages into the transfer stream: header, page runs layer by layer, first token."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator

from engine.engine_loop import EngineLoop
from engine.request import Request, StepOutput
from nvfp4_serve.convert import check_token_ids, sampling_from_proto
from nvfp4_serve.errors import InvalidRequest, check_request_id, engine_error
from nvfp4_serve.layout import check_layout, layout_of
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve_proto import prefill_pb2

_HEADER_MARGIN = 4096  # bytes kept free in each message for the protobuf framing


class PrefillWorker:
    def __init__(self, loop: EngineLoop, max_message_bytes: int, metrics: ServiceMetrics,
                 debug_transfer_delay_s: float = 0.0, debug_header_delay_s: float = 0.0):
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

    def _validate(self, request: prefill_pb2.PrefillRequest) -> list[int]:
        check_request_id(request.request_id)
        ids = check_token_ids(request.token_ids, self.engine.model_config.vocab_size)
        p = request.prefix_len
        if p < 0 or p % self.page_size or p > len(ids):
            raise InvalidRequest(f"prefix_len {p} must be a multiple of the page size {self.page_size} "
                                 f"within the prompt of {len(ids)} tokens")
        if request.HasField("expected_layout"):
            check_layout(self.layout, request.expected_layout, "prefill", "decode")
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
        try:
            out = await done
            if out.error or out.finish_reason != "prefill":
                raise engine_error(out.error or f"prefill ended with {out.finish_reason}")
            self.metrics.ttft.observe(time.perf_counter() - t0)
            if self.debug_header_delay:
                await asyncio.sleep(self.debug_header_delay)
            first_page = request.prefix_len // self.page_size
            num_pages = math.ceil(len(ids) / self.page_size) - first_page
            yield prefill_pb2.PrefillMessage(request_id=rid, header=prefill_pb2.TransferHeader(
                layout=self.layout, num_tokens=len(ids), prefix_len=request.prefix_len,
                first_page=first_page, num_pages=num_pages))
            t1, sent = time.perf_counter(), 0
            pages = req.page_ids[first_page:first_page + num_pages]
            for layer in range(self.layout.num_layers):
                for start in range(0, num_pages, self.pages_per_message):
                    run = pages[start:start + self.pages_per_message]
                    if self.debug_delay:
                        await asyncio.sleep(self.debug_delay)
                    payload = await asyncio.to_thread(self.engine.pool.export_pages, layer, run)
                    sent += len(payload.k) + len(payload.k_sf) + len(payload.v) + len(payload.v_sf)
                    yield prefill_pb2.PrefillMessage(request_id=rid, pages=prefill_pb2.KVPageRun(
                        layer=layer, first_page=first_page + start, num_pages=len(run),
                        k=payload.k, k_scales=payload.k_sf, v=payload.v, v_scales=payload.v_sf))
            self.metrics.observe_transfer(sent, time.perf_counter() - t1)
            yield prefill_pb2.PrefillMessage(request_id=rid, done=prefill_pb2.PrefillDone(
                first_token_id=out.new_token_ids[0], num_computed_tokens=len(ids) - out.num_cached_tokens))
            self.metrics.requests.labels("ok").inc()
        except BaseException:
            self.metrics.requests.labels("failed").inc()
            raise
        finally:
            self.loop.abort(req.rid)  # frees (or caches) its transient pages whatever ended the stream
