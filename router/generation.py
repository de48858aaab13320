"""One choice's flow: choose workers -> Decode.Generate stream -> detokenize -> stop strings -> events.

    choose(decode, prefill) -> Generate(prompt, sampling, prefill_address) --read--> token messages
       ^                                   |                                     | detokenize, stop strings
       '--- retry on another worker <-- fails before the first token             v
                                                                         ChoiceStarted / ChoiceText /
                                                                         ChoiceFinished events

Retries happen only while no token of the attempt came back (so the client never sees text twice), at most
``max_retries`` times, on UNAVAILABLE, CANCELLED, a FINISH_REASON_ABORT finish (the worker or its prefill died
or gave up) and RESOURCE_EXHAUSTED (that worker's queue is full: only to a worker not tried yet); the gRPC status
alone decides (``GRPC_ANSWERS``), never its details. Every exit path cancels the gRPC call and releases the
workers' load counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from nvfp4_serve_proto import common_pb2, decode_pb2
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.openai_protocol import OpenAIError, SamplingOptions
from router.stop_strings import StopStringMatcher
from router.workers import Dispatch, WorkerPool


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_ids, m.top_logprobs))) for m in msgs)


class ChoiceStarted(NamedTuple):
    index: int
    cached_tokens: int  # prompt tokens the decode worker served from its prefix cache
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # echo + logprobs: prompt tokens from the second


class ChoiceText(NamedTuple):
    index: int
    text: str  # may be "" when the ids do not complete a character yet
    token_ids: tuple[int, ...] = ()  # the generated ids this text came from (none for the final tail)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for logprobs


class ChoiceFinished(NamedTuple):
    index: int
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: EOS/length)


ChoiceEvent = ChoiceStarted | ChoiceText | ChoiceFinished


@dataclass(frozen=True)
class ChoiceSpec:
    """What one choice generates. ``seed`` already includes the choice offset (seed + i)."""

    index: int
    request_id: str
    prompt_ids: tuple[int, ...]
    options: SamplingOptions
    seed: int | None


@dataclass(frozen=True)
class GenerationContext:
    config: RouterConfig
    pool: WorkerPool
    tokenizer: Any  # tokenization.tokenizer.Tokenizer (duck-typed: the router must not import heavy engine code)
    detokenizer_cls: Any  # tokenization.tokenizer.IncrementalDetokenizer
    metrics: RouterMetrics


class _AttemptFailed(Exception):
    def __init__(self, error: OpenAIError, kind: str, retryable: bool) -> None:
        super().__init__(error.message)
        self.error, self.kind, self.retryable = error, kind, retryable


def sampling_proto(options: SamplingOptions, seed: int | None) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        temperature=options.temperature, top_p=options.top_p, top_k=options.top_k, min_p=options.min_p,
        max_tokens=options.max_tokens, stop_token_ids=list(options.stop_token_ids), ignore_eos=options.ignore_eos,
        presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty, logit_bias=dict(options.logit_bias),
        min_tokens=options.min_tokens)
    if seed is not None:
        params.seed = seed
    if options.logprobs is not None:
        params.logprobs = options.logprobs
    if options.prompt_logprobs is not None:
        params.prompt_logprobs = options.prompt_logprobs
    if options.constraint is not None:
        params.structured.kind = options.constraint.kind
        params.structured.spec = options.constraint.spec
    return params


@dataclass(frozen=True)
class StatusAnswer:
    """What a Generate that failed with one gRPC status becomes. ``message`` is formatted with ``where``
    ("decode worker ADDRESS"), ``address``, ``code`` (the status's name) and ``details`` (the worker's message,
    shown to the client, never read); ``bare`` replaces it when the worker sent no details."""

    http_status: int
    kind: str  # the failures / retries metric label
    retryable: bool  # before the first token, on another try
    message: str
    code: str | None = None  # the OpenAI error code
    headers: tuple[tuple[str, str], ...] = ()
    bare: str | None = None


# The one table from a failed Generate's gRPC status to the HTTP answer (tests/test_failure_tables.py checks that
# every status the services send is in it). A prompt that can never fit is INVALID_ARGUMENT (400), distinct from
# RESOURCE_EXHAUSTED (a full queue: 429, retried on a worker not tried yet).
GRPC_ANSWERS: dict[grpc.StatusCode, StatusAnswer] = {
    grpc.StatusCode.INVALID_ARGUMENT: StatusAnswer(400, "invalid_argument", False, "{details}",
                                                   bare="{where} rejected the request"),
    grpc.StatusCode.FAILED_PRECONDITION: StatusAnswer(500, "failed_precondition", False, "{where}: {details}"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: StatusAnswer(429, "resource_exhausted", True, "{where} is overloaded: {details}",
                                                     code="overloaded", headers=(("Retry-After", "1"),)),
    grpc.StatusCode.UNAVAILABLE: StatusAnswer(503, "unavailable", True, "{where} unavailable: {details}"),
    grpc.StatusCode.CANCELLED: StatusAnswer(503, "cancelled", True, "{where} cancelled the request: {details}"),
    grpc.StatusCode.DEADLINE_EXCEEDED: StatusAnswer(504, "timeout", False, "{where}: deadline exceeded: {details}"),
    grpc.StatusCode.UNIMPLEMENTED: StatusAnswer(502, "unimplemented", False, "{address} does not implement "
                                                "Decode.Generate (is it a decode service?): {details}"),
}
OTHER_STATUS = StatusAnswer(502, "internal", False, "{where} failed: {code}: {details}")  # INTERNAL and the rest


def map_grpc_error(exc: grpc.aio.AioRpcError, address: str) -> _AttemptFailed:
    """The OpenAI error, failure kind and retryability of a failed Generate, from its status alone."""
    code, details = exc.code(), exc.details() or ""
    answer = GRPC_ANSWERS.get(code, OTHER_STATUS)
    template = answer.bare if answer.bare is not None and not details else answer.message
    message = template.format(where=f"decode worker {address}", address=address, code=code.name, details=details)
    error = OpenAIError(answer.http_status, message, code=answer.code, headers=dict(answer.headers) or None)
    return _AttemptFailed(error, answer.kind, answer.retryable)


async def generate_choice(ctx: GenerationContext, spec: ChoiceSpec, arrival: float) -> AsyncIterator[ChoiceEvent]:
    """Events of one choice. ``arrival``: time.perf_counter() when the HTTP request came in (for TTFT).

    Raises OpenAIError on failure (after any retries). Closing the iterator cancels the Generate call."""
    cfg = ctx.config
    prompt = spec.prompt_ids
    request = decode_pb2.GenerateRequest(request_id=spec.request_id, token_ids=prompt,
                                         sampling=sampling_proto(spec.options, spec.seed))
    tried_decode: set[str] = set()
    tried_prefill: set[str] = set()
    only_untried = False
    for attempt in range(cfg.max_retries + 1):
        route = ctx.pool.choose(prompt, tried_decode, tried_prefill, allow_excluded=not only_untried)
        tried_decode.add(route.decode.address)
        if route.prefill is not None:
            tried_prefill.add(route.prefill.address)
        # logprobs and structured output need the prompt's logits on the decode worker: it runs the prompt
        local = spec.options.runs_locally
        request.prefill_address = route.prefill.address if route.prefill is not None and not local else ""
        request.request_id = spec.request_id if attempt == 0 else f"{spec.request_id}-retry{attempt}"
        dispatch = ctx.pool.dispatch(route, prompt)
        call = route.decode.generate(request, cfg.request_timeout_s or None)
        state = _Attempt(route.decode.address, dispatch)
        try:
            async with contextlib.aclosing(_read_attempt(ctx, spec, call, state, arrival)) as events:
                async for event in events:
                    yield event
            return
        except _AttemptFailed as failed:
            ctx.metrics.failures.labels(failed.kind).inc()
            only_untried = failed.kind == "resource_exhausted"  # that worker is full: only another may help
            if not (failed.retryable and state.num_tokens == 0 and attempt < cfg.max_retries) or (
                    only_untried and not ctx.pool.has_untried("decode", tried_decode)):
                raise failed.error from None
            ctx.metrics.retries.labels(failed.kind).inc()
            if not only_untried:
                await ctx.pool.probe(route)
        finally:
            call.cancel()
            dispatch.end()
    raise AssertionError("unreachable: the last attempt returns or raises")


@dataclass
class _Attempt:
    address: str  # the decode worker
    dispatch: Dispatch
    num_tokens: int = 0  # tokens received: once > 0 the attempt can no longer be retried


class _ChoiceText:
    """One attempt's text so far: token ids -> detokenized text, cut at the first stop string (counted only from
    min_tokens on, as vLLM)."""

    def __init__(self, ctx: GenerationContext, spec: ChoiceSpec) -> None:
        self.opts = spec.options
        self.detok = ctx.detokenizer_cls(ctx.tokenizer, prompt_ids=list(spec.prompt_ids),
                                         skip_special_tokens=self.opts.skip_special_tokens)
        self.stopper = StopStringMatcher(self.opts.stop)
        self.output: list[int] = []
        self.stopped = False
        self.stop_reason: int | str | None = None

    def push(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """The text of ``token_ids`` and the ids it came from (those up to a stop string)."""
        pieces, new_ids = [], []
        for token in token_ids:
            self.output.append(token)
            new_ids.append(token)
            delta = self.detok.push(token)
            if len(self.output) < self.opts.min_tokens:
                pieces.append(delta)
                continue
            result = self.stopper.push(delta)
            pieces.append(result.text)
            if result.stopped:
                self._stop()
                pieces.append(self._matched_suffix())
                break
        return "".join(pieces), new_ids

    def tail(self) -> str:
        """At the worker's finish: the detokenizer's partial-character tail, then the stop matcher's held-back
        text (cut at a stop string completed by the tail)."""
        result = self.stopper.push(self.detok.flush())
        if result.stopped:
            self._stop()
            return result.text + self._matched_suffix()
        return result.text + self.stopper.flush()

    def _stop(self) -> None:
        self.stopped, self.stop_reason = True, self.stopper.matched

    def _matched_suffix(self) -> str:
        return self.stopper.matched if self.opts.include_stop_str_in_output and self.stopper.matched else ""


async def _next_message(ctx: GenerationContext, call: grpc.aio.UnaryStreamCall, address: str,
                        waiting_for_first: bool) -> decode_pb2.GenerateResponse:
    """The attempt's next message within its deadline. Raises _AttemptFailed (the stream's status, a deadline,
    an end without a finish reason)."""
    timeout = ctx.config.first_token_timeout_s if waiting_for_first else ctx.config.inter_token_timeout_s
    try:
        msg = await asyncio.wait_for(call.read(), timeout)
    except TimeoutError:
        what = "the first token (admission + prefill)" if waiting_for_first else "the next token"
        raise _AttemptFailed(OpenAIError(504, f"decode worker {address} sent nothing for {timeout:g}s while "
                                              f"waiting for {what}"), "timeout", False) from None
    except grpc.aio.AioRpcError as exc:
        raise map_grpc_error(exc, address) from None
    if msg is grpc.aio.EOF:
        raise _AttemptFailed(OpenAIError(502, f"decode worker {address} ended the stream without a finish "
                                              f"reason"), "protocol", True)
    return msg


async def _read_attempt(ctx: GenerationContext, spec: ChoiceSpec, call: grpc.aio.UnaryStreamCall,
                        state: _Attempt, arrival: float) -> AsyncIterator[ChoiceEvent]:
    """One Generate attempt's events. Raises _AttemptFailed."""
    metrics, address, opts = ctx.metrics, state.address, spec.options
    text = _ChoiceText(ctx, spec)
    output = text.output
    cached_tokens = -1  # from the first message
    last = arrival
    while True:
        msg = await _next_message(ctx, call, address, waiting_for_first=not output)
        finished = msg.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED
        now = time.perf_counter()
        if cached_tokens < 0:
            cached_tokens = msg.cached_tokens
            state.dispatch.prefill_done()
            yield ChoiceStarted(spec.index, cached_tokens, logprobs_from_proto(msg.prompt_logprobs))
        if msg.finish_reason == decode_pb2.FINISH_REASON_ABORT:
            raise _AttemptFailed(OpenAIError(503, f"decode worker {address} aborted the request"), "abort", True)
        if opts.drop_output:  # echo with max_tokens 0: the one generated token is not part of the answer
            if finished:
                metrics.prompt_tokens.inc(len(spec.prompt_ids))
                metrics.cached_prompt_tokens.inc(cached_tokens)
                yield ChoiceFinished(spec.index, "length", 0)
                return
            continue
        if msg.token_ids:
            if output:
                gap = (now - last) / len(msg.token_ids)
                for _ in msg.token_ids:
                    metrics.itl.observe(gap)
            else:
                metrics.ttft.observe(now - arrival)
            last = now
            lps = logprobs_from_proto(msg.logprobs)
            piece, new_ids = text.push(msg.token_ids)
            state.num_tokens = len(output)
            metrics.generated_tokens.inc(len(new_ids))
            yield ChoiceText(spec.index, piece, tuple(new_ids), lps[:len(new_ids)] if lps else ())
        if not (text.stopped or finished):
            continue
        if not text.stopped and (tail := text.tail()):
            yield ChoiceText(spec.index, tail)
        metrics.prompt_tokens.inc(len(spec.prompt_ids))
        metrics.cached_prompt_tokens.inc(cached_tokens)
        ctx.pool.policy.record(address, (*spec.prompt_ids, *output))  # the worker caches finished sequences
        length = not text.stopped and msg.finish_reason == decode_pb2.FINISH_REASON_LENGTH
        stop_reason = text.stop_reason
        if not text.stopped and not length and output and output[-1] in opts.stop_token_ids:
            stop_reason = output[-1]
        yield ChoiceFinished(spec.index, "length" if length else "stop", len(output), stop_reason)
        return


_END = object()


async def merge_choices(streams: Sequence[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    """Interleave the events of several choices as they come; the first error cancels the rest and raises."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield event
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceEvent]) -> None:
        try:
            async for event in stream:
                queue.put_nowait(event)
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 (forwarded to the consumer; CancelledError passes)
            queue.put_nowait(exc)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
