"""One choice's flow: choose workers -> Decode.Generate stream -> detokenize -> stop strings -> events.

    choose(decode, prefill) -> Generate(prompt, sampling, prefill_address) --read--> token messages
       ^                                   |                                     | detokenize, stop strings
       '--- retry on another worker <-- fails before the first token             v
                                                                         ChoiceStarted / ChoiceText /
                                                                         ChoiceFinished events

Retries happen only while no token of the attempt came back (so the client never sees text twice), at most
``max_retries`` times, on UNAVAILABLE, CANCELLED, an "abort" finish (the worker or its prefill died or gave
up) and RESOURCE_EXHAUSTED (that worker's queue is full: only to a worker not tried yet). Every exit path
cancels the gRPC call and releases the workers' load counts.
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

# RESOURCE_EXHAUSTED whose message contains one of these is a prompt that can never fit: 400, not 429.
NEVER_FITS_MARKERS = ("never fit", "can never", "larger than the pool", "exceeds the pool")


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


def map_grpc_error(exc: grpc.aio.AioRpcError, address: str) -> _AttemptFailed:
    """The OpenAI error, failure kind and retryability of a failed Generate."""
    code, details = exc.code(), exc.details() or ""
    where = f"decode worker {address}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return _AttemptFailed(OpenAIError(400, details or f"{where} rejected the request"), "invalid_argument", False)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return _AttemptFailed(OpenAIError(500, f"{where}: {details}"), "failed_precondition", False)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if any(m in details.lower() for m in NEVER_FITS_MARKERS):
            return _AttemptFailed(OpenAIError(400, details, code="context_length_exceeded"),
                                  "prompt_too_large", False)
        err = OpenAIError(429, f"{where} is overloaded: {details}", code="overloaded", headers={"Retry-After": "1"})
        return _AttemptFailed(err, "resource_exhausted", True)
    if code == grpc.StatusCode.UNAVAILABLE:
        return _AttemptFailed(OpenAIError(503, f"{where} unavailable: {details}"), "unavailable", True)
    if code == grpc.StatusCode.CANCELLED:
        return _AttemptFailed(OpenAIError(503, f"{where} cancelled the request: {details}"), "cancelled", True)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return _AttemptFailed(OpenAIError(504, f"{where}: deadline exceeded: {details}"), "timeout", False)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return _AttemptFailed(OpenAIError(502, f"{address} does not implement Decode.Generate (is it a decode "
                                               f"service?): {details}"), "unimplemented", False)
    return _AttemptFailed(OpenAIError(502, f"{where} failed: {code.name}: {details}"), "internal", False)


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


async def _read_attempt(ctx: GenerationContext, spec: ChoiceSpec, call: grpc.aio.UnaryStreamCall,
                        state: _Attempt, arrival: float) -> AsyncIterator[ChoiceEvent]:
    """One Generate attempt's events. Raises _AttemptFailed."""
    cfg, metrics, address = ctx.config, ctx.metrics, state.address
    opts = spec.options
    detok = ctx.detokenizer_cls(ctx.tokenizer, prompt_ids=list(spec.prompt_ids),
                                skip_special_tokens=opts.skip_special_tokens)
    stopper = StopStringMatcher(opts.stop)
    stop_reason: int | str | None = None
    output: list[int] = []
    cached_tokens = -1  # from the first message
    last = arrival
    while True:
        timeout = cfg.inter_token_timeout_s if output else cfg.first_token_timeout_s
        try:
            msg = await asyncio.wait_for(call.read(), timeout)
        except TimeoutError:
            what = "the next token" if output else "the first token (admission + prefill)"
            raise _AttemptFailed(OpenAIError(504, f"decode worker {address} sent nothing for {timeout:g}s while "
                                                  f"waiting for {what}"), "timeout", False) from None
        except grpc.aio.AioRpcError as exc:
            raise map_grpc_error(exc, address) from None
        if msg is grpc.aio.EOF:
            raise _AttemptFailed(OpenAIError(502, f"decode worker {address} ended the stream without a finish "
                                                  f"reason"), "protocol", True)
        now = time.perf_counter()
        if cached_tokens < 0:
            cached_tokens = msg.cached_tokens
            state.dispatch.prefill_done()
            yield ChoiceStarted(spec.index, cached_tokens, logprobs_from_proto(msg.prompt_logprobs))
        if msg.finish_reason == "abort":
            raise _AttemptFailed(OpenAIError(503, f"decode worker {address} aborted the request"), "abort", True)
        if opts.drop_output:  # echo with max_tokens 0: the one generated token is not part of the answer
            if msg.finish_reason:
                metrics.prompt_tokens.inc(len(spec.prompt_ids))
                metrics.cached_prompt_tokens.inc(cached_tokens)
                yield ChoiceFinished(spec.index, "length", 0)
                return
            continue
        stopped = False
        lps = logprobs_from_proto(msg.logprobs)
        if msg.token_ids:
            if output:
                gap = (now - last) / len(msg.token_ids)
                for _ in msg.token_ids:
                    metrics.itl.observe(gap)
            else:
                metrics.ttft.observe(now - arrival)
            last = now
            pieces, new_ids = [], []
            for token in msg.token_ids:
                output.append(token)
                new_ids.append(token)
                delta = detok.push(token)
                if len(output) < opts.min_tokens:  # stop strings count only from min_tokens on (as vLLM)
                    pieces.append(delta)
                    continue
                result = stopper.push(delta)
                pieces.append(result.text)
                if result.stopped:
                    stopped, stop_reason = True, stopper.matched
                    if opts.include_stop_str_in_output and stopper.matched:
                        pieces.append(stopper.matched)
                    break
            state.num_tokens = len(output)
            metrics.generated_tokens.inc(len(pieces))
            text = "".join(pieces)
            yield ChoiceText(spec.index, text, tuple(new_ids), lps[:len(new_ids)] if lps else ())
        if not (stopped or msg.finish_reason):
            continue
        if not stopped:  # the detokenizer's partial-character tail, then the stop matcher's held-back text
            result = stopper.push(detok.flush())
            stopped = result.stopped
            tail = result.text if stopped else result.text + stopper.flush()
            if stopped:
                stop_reason = stopper.matched
                if opts.include_stop_str_in_output and stopper.matched:
                    tail += stopper.matched
            if tail:
                yield ChoiceText(spec.index, tail)
        metrics.prompt_tokens.inc(len(spec.prompt_ids))
        metrics.cached_prompt_tokens.inc(cached_tokens)
        ctx.pool.policy.record(address, (*spec.prompt_ids, *output))  # the worker caches finished sequences
        reason = "stop" if stopped or msg.finish_reason != "length" else "length"
        if not stopped and reason == "stop" and output and output[-1] in opts.stop_token_ids:
            stop_reason = output[-1]
        yield ChoiceFinished(spec.index, reason, len(output), stop_reason)
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
