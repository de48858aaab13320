"""Decode worker: one Generate request's life on this service.

    submit -> [queued: admission deadline] -> PullStart (pages allocated here)
           -> pull missing pages from prefill (receiver deadlines) -> first token
           -> stream tokens [between-tokens deadline] -> finish
    (or, when the cache holds most of the prompt, the engine extends locally and the first
    token arrives without a PullStart)

Every exit path that is not a normal finish aborts the request on the engine loop, which frees
all its pages; a cancelled pull cancels the Prefill stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from decode_svc.config import DecodeConfig
from decode_svc.kv_receiver import KVReceiver
from engine.engine_loop import EngineLoop
from engine.request import PullStart, Request, StepOutput
from nvfp4_serve.convert import check_token_ids, sampling_from_proto
from nvfp4_serve.errors import InvalidRequest, ServiceError, TransferTimeout
from nvfp4_serve.layout import layout_of
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve_proto import decode_pb2


class DecodeWorker:
    def __init__(self, loop: EngineLoop, config: DecodeConfig, metrics: ServiceMetrics):
        self.loop = loop
        self.engine = loop.engine
        self.config = config
        self.timeouts = config.timeouts
        self.metrics = metrics
        self.layout = layout_of(self.engine)
        self.receiver = KVReceiver(self.engine.pool, self.layout, metrics, config.timeouts,
                                   config.max_message_bytes, self._run_on_engine)

    async def _run_on_engine(self, fn) -> None:
        await asyncio.wrap_future(self.loop.call(fn))

    def _build_request(self, request: decode_pb2.GenerateRequest) -> Request:
        if not request.request_id:
            raise InvalidRequest("request_id is empty")
        ids = check_token_ids(request.token_ids, self.engine.model_config.vocab_size)
        sampling = sampling_from_proto(request.sampling)
        return Request(request.request_id, ids, sampling, remote_prefill=bool(request.prefill_address))

    async def generate(self, request: decode_pb2.GenerateRequest) -> AsyncIterator[decode_pb2.GenerateResponse]:
        req = self._build_request(request)
        rid, aio_loop = req.rid, asyncio.get_running_loop()
        events: asyncio.Queue[StepOutput | PullStart] = asyncio.Queue()
        self.loop.submit(req, lambda ev: aio_loop.call_soon_threadsafe(events.put_nowait, ev))
        self.metrics.prompt_tokens.inc(req.prompt_len)
        t0 = last = time.perf_counter()
        get = pull = None
        finished, first, num_generated = False, True, 0
        deadline, state = self.timeouts.admission_s, "admission"
        try:
            while True:
                if get is None:
                    get = asyncio.ensure_future(events.get())
                waiting = {get} if pull is None else {get, pull}
                done, _ = await asyncio.wait(waiting, timeout=None if pull else deadline,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise TransferTimeout(f"request {rid} waited more than {deadline:g} s for {state}")
                if pull is not None and pull in done:
                    first_token = pull.result()  # raises the transfer's error, if any
                    pull = None
                    self.loop.complete_pull(rid, first_token)
                    deadline, state = self.timeouts.between_tokens_s, "its first token"
                    continue
                ev, get = get.result(), None
                if isinstance(ev, PullStart):
                    pull = asyncio.ensure_future(
                        self.receiver.pull(request.prefill_address, ev, req.prompt_ids, req.sampling))
                    continue
                if ev.error:
                    raise ServiceError(ev.error)
                now = time.perf_counter()
                if first:
                    self.metrics.ttft.observe(now - t0)
                    self.metrics.cache_hit_tokens.inc(ev.num_cached_tokens)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                self.metrics.generated_tokens.inc(len(ev.new_token_ids))
                num_generated += len(ev.new_token_ids)
                finished = ev.finish_reason is not None
                yield decode_pb2.GenerateResponse(
                    request_id=rid, token_ids=ev.new_token_ids, prompt_tokens=ev.num_prompt_tokens if first else 0,
                    cached_tokens=ev.num_cached_tokens if first else 0, finish_reason=ev.finish_reason or "",
                    completion_tokens=num_generated)
                first = False
                deadline, state = self.timeouts.between_tokens_s, "the next token"
                if finished:
                    self.metrics.requests.labels(ev.finish_reason).inc()
                    return
        finally:
            for fut in (get, pull):
                if fut is not None and not fut.done():
                    fut.cancel()
            if pull is not None:
                await asyncio.gather(pull, return_exceptions=True)  # its pool writes are queued before the abort
            if not finished:
                self.metrics.requests.labels("aborted").inc()
                self.loop.abort(rid)
