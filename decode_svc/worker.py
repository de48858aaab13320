"""Decode worker: one Generate request's life on this service.

    submit -> [queued: admission deadline] -> PullStart (pages allocated here)
           -> pull missing pages from prefill (receiver deadlines) -> first token
           -> stream tokens [between-tokens deadline] -> finish
    (or, with no prefill address or when the cache holds most of the prompt, the engine extends locally and
    the first token arrives without a PullStart; without a prefill address the first deadline is admission +
    prefill-first-message, as there is no event between admission and the end of the local prefill)

Every exit path that is not a normal finish aborts the request on the engine loop, which frees
all its pages; a cancelled pull cancels the Prefill stream.

Checked before anything is queued (INVALID_ARGUMENT): request id (non-empty, printable, <= 256 characters,
not already in flight here), token ids and stop token ids inside the vocabulary, sampling parameters, the
prompt within the context and the pool, prefill address of the form host:port. max_tokens past the context
or the pool is clamped to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from decode_svc.config import DecodeConfig
from decode_svc.kv_receiver import KVReceiver
from engine.engine_loop import EngineLoop
from engine.grammar import GrammarCompiler, GrammarError, GrammarUnavailable, Matcher
from engine.integrity import IntegrityReport
from engine.outcome import FinishReason
from engine.request import PullStart, Request, StepOutput
from nvfp4_serve_proto import decode_pb2
from svc_common.convert import check_token_ids, logprobs_to_proto, sampling_from_proto
from svc_common.errors import InvalidRequest, TransferTimeout, UntrustedPeer, check_request_id, service_error
from svc_common.kv_transfer import check_address
from svc_common.layout import layout_of
from svc_common.metrics import ServiceMetrics


def _coalesce(ev: StepOutput | PullStart, events: asyncio.Queue) -> StepOutput | PullStart:
    """``ev`` merged with the token outputs already queued behind it: when the stream's reader falls behind
    the engine, the tokens it missed go out as one message instead of one message each (as SGLang's
    detokenizer batches them). A PullStart only ever comes before a request's first token, so nothing queued
    behind a token is one."""
    while isinstance(ev, StepOutput) and ev.finish_reason is None and ev.failure is None and not events.empty():
        nxt = events.get_nowait()
        assert isinstance(nxt, StepOutput), "a PullStart after a token"
        logprobs = [*ev.logprobs, *nxt.logprobs] if ev.logprobs is not None and nxt.logprobs is not None else None
        ev = StepOutput(ev.rid, [*ev.new_token_ids, *nxt.new_token_ids], nxt.finish_reason, ev.num_prompt_tokens,
                        ev.num_cached_tokens, nxt.failure, logprobs, ev.prompt_logprobs)
    return ev


# The engine's finish reasons as the Generate stream states them (PREFILLED is a prefill service's, never here).
FINISH_REASONS = {FinishReason.STOP: decode_pb2.FINISH_REASON_STOP,
                  FinishReason.LENGTH: decode_pb2.FINISH_REASON_LENGTH,
                  FinishReason.ABORT: decode_pb2.FINISH_REASON_ABORT}


async def _next_event(events: asyncio.Queue, timeout_s: float, rid: str, what: str) -> StepOutput | PullStart:
    """The request's next engine event (coalesced), or TransferTimeout after ``timeout_s`` without one."""
    try:
        async with asyncio.timeout(timeout_s):
            ev = await events.get()
    except TimeoutError:
        raise TransferTimeout(f"request {rid} waited more than {timeout_s:g} s for {what}") from None
    return _coalesce(ev, events)


class DecodeWorker:
    def __init__(self, loop: EngineLoop, config: DecodeConfig, metrics: ServiceMetrics):
        self.loop = loop
        self.engine = loop.engine
        self.config = config
        self.timeouts = config.timeouts
        self.metrics = metrics
        self.layout = layout_of(self.engine)
        self.receiver = KVReceiver(self.engine.pool, self.layout, metrics, config.timeouts,
                                   config.max_message_bytes, self.engine.model_config.vocab_size, config.tls,
                                   config.kv_transfer, config.kv_grpc_lanes)
        # tests only (svc_common/fault_injection.py): the engine callback itself unless a token delay is set
        self._with_faults = config.faults.stall_after_tokens
        self._in_flight: set[str] = set()  # request ids between submit and the end of their stream
        self.max_sequence_len = min(self.engine.max_context_len, self.engine.capacity().max_tokens)
        self.grammars = GrammarCompiler(self.engine.config.model_dir, self.engine.model_config.vocab_size,
                                        self.engine.eos_token_ids)

    def _build_request(self, request: decode_pb2.GenerateRequest) -> Request:
        rid = check_request_id(request.request_id)
        if rid in self._in_flight:
            raise InvalidRequest(f"request_id {rid!r} is already in flight on this decode service")
        vocab = self.engine.model_config.vocab_size
        ids = check_token_ids(request.token_ids, vocab)
        # max_tokens 0 (unset) is the rest of the context (common.proto)
        sampling = sampling_from_proto(request.sampling, max(1, self.max_sequence_len - len(ids)))
        bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]  # negative ones fail in SamplingParams
        if bad_stop:
            raise InvalidRequest(f"stop_token_ids has ids outside the vocabulary [0, {vocab}), e.g. {bad_stop[0]}")
        # max_tokens past the context (or the whole pool) is clamped: the request ends with "length" there
        # instead of being retracted forever, and load reports never count tokens that cannot be generated.
        # A prompt that does not fit at all is rejected by the scheduler's validate().
        room = self.max_sequence_len - len(ids)
        if 0 < room < sampling.max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=room)
        address = request.prefill_address
        if address:
            try:
                check_address(address, "prefill_address")
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            if address not in self.config.prefill_addresses:
                allowed = ", ".join(self.config.prefill_addresses) or "none (--prefill-addresses)"
                raise UntrustedPeer(f"prefill_address {address!r} is not a prefill service of this deployment; "
                                     f"this decode pulls only from: {allowed}")
        # logprobs and structured output need the first token's logits here: such prompts run on this service
        local = sampling.logprobs is not None or sampling.prompt_logprobs is not None or \
            bool(request.sampling.structured.kind)
        return Request(rid, ids, sampling, remote_prefill=bool(address) and not local)

    def _compile(self, structured) -> Matcher:
        try:
            return self.grammars.compile(structured.kind, structured.spec)
        except GrammarError as e:
            raise InvalidRequest(f"structured output: {e}") from None
        except GrammarUnavailable as e:
            raise InvalidRequest(f"structured output is not available on this server: {e}") from None

    async def flush_cache(self) -> tuple[int, bool]:
        """FlushCache: (pages freed, whether no request was active), between two engine steps."""
        return await asyncio.wrap_future(self.loop.flush_cache())

    async def check_integrity(self) -> IntegrityReport:
        """CheckIntegrity: the pool's page accounting between two engine steps (raises IntegrityError)."""
        return await asyncio.wrap_future(self.loop.check_integrity())

    async def generate(self, request: decode_pb2.GenerateRequest) -> AsyncIterator[decode_pb2.GenerateResponse]:
        req = self._build_request(request)
        if request.sampling.structured.kind:
            req.grammar = await asyncio.to_thread(self._compile, request.sampling.structured)
        rid, aio_loop = req.rid, asyncio.get_running_loop()
        events: asyncio.Queue[StepOutput | PullStart] = asyncio.Queue()

        def on_output(ev: StepOutput | PullStart) -> None:  # on the engine loop thread
            aio_loop.call_soon_threadsafe(events.put_nowait, ev)

        self.loop.submit(req, self._with_faults(on_output))
        self.metrics.prompt_tokens.inc(req.prompt_len)
        t0 = last = time.perf_counter()
        finished, first, num_generated = False, True, 0
        self._in_flight.add(rid)
        try:
            ev = await self._first_output(request, req, events)
            while True:  # streaming: the first output, then one event per message within between_tokens_s
                assert isinstance(ev, StepOutput), "a PullStart after the first output"
                if ev.failure is not None:
                    raise service_error(ev.failure)
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
                reason = decode_pb2.FINISH_REASON_UNSPECIFIED
                if finished:  # counted before the last yield: the caller may cancel right after receiving it
                    self.metrics.requests.labels(ev.finish_reason.value).inc()
                    reason = FINISH_REASONS[ev.finish_reason]
                yield decode_pb2.GenerateResponse(
                    request_id=rid, token_ids=ev.new_token_ids, prompt_tokens=ev.num_prompt_tokens if first else 0,
                    cached_tokens=ev.num_cached_tokens if first else 0, finish_reason=reason,
                    completion_tokens=num_generated, logprobs=logprobs_to_proto(ev.logprobs or ()),
                    prompt_logprobs=logprobs_to_proto(ev.prompt_logprobs or ()))
                if finished:
                    return
                first = False
                ev = await _next_event(events, self.timeouts.between_tokens_s, rid, "the next token")
        finally:
            self._in_flight.discard(rid)
            if not finished:
                self.metrics.requests.labels("aborted").inc()
                self.loop.abort(rid)

    async def _first_output(self, request: decode_pb2.GenerateRequest, req: Request,
                            events: asyncio.Queue) -> StepOutput:
        """Admission and, when the prompt's pages come from a prefill, the pull, up to the request's first output
        (its first token, or its failure). Admission is bounded by admission_s (plus prefill_first_message_s
        when the prompt runs here: no event comes between admission and the end of the local prefill); the pull
        by the receiver's own deadlines; the first token after the pull by between_tokens_s."""
        rid, t = req.rid, self.timeouts
        if request.prefill_address:
            ev = await _next_event(events, t.admission_s, rid, "admission")
        else:
            ev = await _next_event(events, t.admission_s + t.prefill_first_message_s, rid,
                                   "admission and the local prefill")
        if isinstance(ev, StepOutput):  # extended here (or failed)
            return ev
        first_token = await self._pull(request.prefill_address, ev, req, events)
        if isinstance(first_token, StepOutput):  # the request failed while its pages were pulled
            return first_token
        self.loop.complete_pull(rid, first_token)
        ev = await _next_event(events, t.between_tokens_s, rid, "its first token")
        assert isinstance(ev, StepOutput), "a second PullStart"
        return ev

    async def _pull(self, address: str, start: PullStart, req: Request, events: asyncio.Queue) -> int | StepOutput:
        """Pull the prompt's missing pages; the first token, or the engine's output when one comes first (a
        failure: the pull is then cancelled). The pull is over (its pool writes queued) when this returns."""
        pull = asyncio.ensure_future(self.receiver.pull(address, start, req.prompt_ids, req.sampling))
        get = asyncio.ensure_future(events.get())
        try:
            await asyncio.wait((pull, get), return_when=asyncio.FIRST_COMPLETED)
            if get.done():  # only a failure comes while a request is pulled; it wins over the pull's end
                return _coalesce(get.result(), events)
            return pull.result()  # raises the pull's error, if any
        finally:
            for fut in (get, pull):
                fut.cancel()
            await asyncio.gather(pull, return_exceptions=True)  # its pool writes are queued before the abort
