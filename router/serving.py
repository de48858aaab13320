"""The two generation endpoints: /v1/completions and /v1/chat/completions.

    body (<= max_body_bytes) -> validate -> prompt bytes vs context -> admission slot -> tokenize (a thread)
        -> max_tokens vs context -> n Generate flows per prompt (router.generation) -> JSON | SSE -> release slot

A text prompt longer in bytes than the context can hold (context tokens x the longest vocabulary entry's
bytes) is refused before it is tokenized; tokenizing runs in a thread and releases the GIL, so the event loop
(/health, every other stream) keeps running while a long prompt is tokenized.

A streamed response starts (HTTP 200) only once the first choice has been admitted by a decode worker, so
errors before that (overload, bad input found by the worker, no healthy worker) keep their HTTP status;
later errors become an SSE error event followed by [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.admission import AdmissionGate
from router.config import ModelLimits, RouterConfig
from router.generation import (
    ChoiceEvent,
    ChoiceSpec,
    GenerationContext,
    generate_choice,
    merge_choices,
)
from router.metrics import RouterMetrics
from router.openai_protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    SamplingOptions,
    bad_request,
    parse_request,
)
from router.responses import Job, Tally, full_response, log_done, sse_body
from router.sse import SSEResponse
from router.workers import WorkerPool

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as the OpenAI API; chat defaults to the rest of the context
CHOICES_PER_N = 16  # a request may ask for at most max_n * CHOICES_PER_N choices (prompts x n)


@dataclass
class RouterState:
    """Everything the endpoints share; built once by create_app."""

    config: RouterConfig
    tokenizer: Any
    detokenizer_cls: Any
    limits: ModelLimits
    metrics: RouterMetrics
    pool: WorkerPool
    gate: AdmissionGate
    generation: GenerationContext = field(init=False)

    def __post_init__(self) -> None:
        self.generation = GenerationContext(self.config, self.pool, self.tokenizer, self.detokenizer_cls,
                                            self.metrics)

    def context_len(self) -> int:
        """Longest prompt + completion: the model's context, capped by the decode workers' pool capacity."""
        cap = self.pool.context_cap()
        return min(self.limits.context_len, cap) if cap else self.limits.context_len


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    too_large = OpenAIError(413, f"request body exceeds the limit of {max_bytes} bytes (--max-body-bytes)",
                            code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(config: RouterConfig, model: str) -> None:
    if model not in (config.model_name, config.model_dir):
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves '{config.model_name}'",
                          param="model", code="model_not_found")


def resolve_max_tokens(requested: int | None, prompt_len: int, context_len: int, default_cap: int | None,
                       param: str) -> int:
    """max_tokens to ask for: the request's (400 when prompt + it exceed the context), else the default
    (the rest of the context, capped by ``default_cap``)."""
    room = context_len - prompt_len
    if room <= 0:
        raise bad_request(f"This model's maximum context length is {context_len} tokens, but the prompt has "
                          f"{prompt_len} tokens; shorten the prompt", param, code="context_length_exceeded")
    if requested is None:
        return min(room, default_cap) if default_cap else room
    if requested == 0:  # echo-only scoring: one token is generated (and dropped), it must fit
        return 0
    if requested > room:
        raise bad_request(f"This model's maximum context length is {context_len} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                          f"completion); reduce the prompt or max_tokens", "max_tokens",
                          code="context_length_exceeded")
    return requested


def check_prompt_bytes(state: RouterState, num_bytes: int, param: str) -> None:
    """400 when ``num_bytes`` of text cannot fit the context whatever it tokenizes to (no tokenizing needed)."""
    context, per_token = state.context_len(), state.tokenizer.max_token_bytes
    if num_bytes > context * per_token:
        raise bad_request(f"This model's maximum context length is {context} tokens, but the prompt has {num_bytes} "
                          f"bytes, more than {context} tokens of at most {per_token} bytes each can hold; shorten "
                          f"the prompt", param, code="context_length_exceeded")


def check_text_prompts(state: RouterState, prompts: list, param: str) -> None:
    """``check_prompt_bytes`` for each text prompt of a batch (token-id prompts are checked once tokenized)."""
    for p in prompts:
        if isinstance(p, str):
            check_prompt_bytes(state, len(p.encode("utf-8")), param)


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    top = vocab_size - 1 if vocab_size else INT32_MAX  # the proto's ids are int32 even when the vocabulary is unknown
    if any(t < 0 or t > top for t in ids):
        bad = next(t for t in ids if t < 0 or t > top)
        raise bad_request(f"token id {bad} is out of the vocabulary (0..{top})", param)


def _options(req: Any, max_tokens: int, vocab_size: int, logprobs: int | None = None,
             prompt_logprobs: int | None = None) -> SamplingOptions:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    stop_ids = list(req.stop_token_ids or ())
    _check_token_ids(stop_ids, vocab_size, "stop_token_ids")
    bias = tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items()))
    _check_token_ids([t for t, _ in bias], vocab_size, "logit_bias")
    drop = max_tokens == 0  # echo with max_tokens 0: the worker generates one token nobody sees
    return SamplingOptions(max_tokens=max(1, max_tokens), temperature=req.temperature, top_p=req.top_p,
                           top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=stop, stop_token_ids=tuple(stop_ids),
                           ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                           frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                           logit_bias=bias, min_tokens=min(req.min_tokens, max(1, max_tokens)),
                           include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs, constraint=req.constraint(), drop_output=drop)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


async def tokenize(state: RouterState, request: Request) -> dict[str, Any]:
    """POST /tokenize (vLLM): {"model", "prompt"} -> {"tokens", "count", "max_model_len"}."""
    req: TokenizeRequest = parse_request(TokenizeRequest, await read_body(request, state.config.max_body_bytes))
    if req.model is not None:
        check_model(state.config, req.model)
    check_prompt_bytes(state, len(req.prompt.encode("utf-8")), "prompt")
    ids = await asyncio.to_thread(state.tokenizer.encode, req.prompt, req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.context_len()}


async def detokenize(state: RouterState, request: Request) -> dict[str, Any]:
    """POST /detokenize (vLLM): {"model", "tokens"} -> {"prompt"}."""
    req: DetokenizeRequest = parse_request(DetokenizeRequest, await read_body(request, state.config.max_body_bytes))
    if req.model is not None:
        check_model(state.config, req.model)
    _check_token_ids(req.tokens, state.limits.vocab_size, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _token_text(state: RouterState) -> Any:
    def text(token_id: int) -> str:
        return state.tokenizer.decode([token_id], skip_special_tokens=False)

    return text


class _Slot:
    """The request's admission slot; released exactly once, by the endpoint or by the stream it returns."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate
        self.handed_over = False
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.release()

    async def release_async(self) -> None:
        self.release()


async def prompt_ids(state: RouterState, prompt: str | list[int], add_special_tokens: bool, text_param: str,
                     ids_param: str | None = None) -> tuple[int, ...]:
    """A prompt's token ids: text tokenized off the event loop, ids taken as given; empty or out of the vocabulary
    is a 400 naming ``text_param`` (``ids_param`` for ids outside the vocabulary, when it differs)."""
    ids = await asyncio.to_thread(state.tokenizer.encode, prompt, add_special_tokens) if isinstance(prompt, str) \
        else list(prompt)
    if not ids:
        raise bad_request(f"{text_param} must contain at least one token", text_param)
    _check_token_ids(ids, state.limits.vocab_size, ids_param or text_param)
    return tuple(ids)


async def completions(state: RouterState, request: Request) -> Response:
    """POST /v1/completions."""
    arrival = time.perf_counter()
    req: CompletionRequest = parse_request(CompletionRequest, await read_body(request, state.config.max_body_bytes))
    check_model(state.config, req.model)
    prompts = req.prompts()
    _check_n(state.config, req.n, len(prompts))
    check_text_prompts(state, prompts, "prompt")
    slot = _Slot(state.gate)
    await state.gate.acquire()
    try:
        token_prompts = [await prompt_ids(state, p, req.add_special_tokens, "prompt") for p in prompts]
        context = state.context_len()
        prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        options = [_options(req, resolve_max_tokens(req.max_tokens, len(ids), context,
                                                     COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt"),
                            state.limits.vocab_size, req.logprobs, prompt_lps) for ids in token_prompts]
        job = Job("completion", f"cmpl-{uuid.uuid4().hex}", state.config.model_name, token_prompts, options,
                  req.n, req.stream, bool(req.stream_options and req.stream_options.include_usage),
                  return_token_ids=req.return_token_ids, echo=req.echo,
                  continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
                  logprobs=req.logprobs is not None, token_text=_token_text(state),
                  prompt_texts=[p if isinstance(p, str) else state.tokenizer.decode(list(p), skip_special_tokens=False)
                                for p in prompts] if req.echo else [])
        return await _run(state, request, job, arrival, slot)
    finally:
        if not slot.handed_over:
            slot.release()


async def chat_completions(state: RouterState, request: Request) -> Response:
    """POST /v1/chat/completions."""
    arrival = time.perf_counter()
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest,
                                               await read_body(request, state.config.max_body_bytes))
    check_model(state.config, req.model)
    _check_n(state.config, req.n, 1)
    messages = [m.template_dict() for m in req.messages]
    check_prompt_bytes(state, sum(len(m["content"].encode("utf-8")) for m in messages), "messages")
    slot = _Slot(state.gate)
    await state.gate.acquire()
    try:
        try:
            text = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages,
                                           add_generation_prompt=req.add_generation_prompt, tools=req.tools)
        except ValueError as exc:  # the template rejected the messages (ChatTemplateError) or has none
            raise bad_request(str(exc), "messages") from None
        ids = await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens=False)
        if not ids:
            raise bad_request("the rendered chat prompt has no tokens", "messages")
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(ids), state.context_len(), None, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        job = Job("chat", f"chatcmpl-{uuid.uuid4().hex}", state.config.model_name, [tuple(ids)],
                  [_options(req, max_tokens, state.limits.vocab_size, logprobs)], req.n, req.stream,
                  bool(req.stream_options and req.stream_options.include_usage),
                  continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
                  logprobs=req.logprobs, token_text=_token_text(state))
        return await _run(state, request, job, arrival, slot)
    finally:
        if not slot.handed_over:
            slot.release()


def _check_n(config: RouterConfig, n: int, num_prompts: int) -> None:
    if n > config.max_n:
        raise bad_request(f"n must be <= {config.max_n} (--max-n), got {n}", "n")
    if n * num_prompts > config.max_n * CHOICES_PER_N:
        raise bad_request(f"at most {config.max_n * CHOICES_PER_N} choices (prompts x n) per request, got "
                          f"{n * num_prompts}", "prompt")


def _events(state: RouterState, job: Job, arrival: float) -> AsyncIterator[ChoiceEvent]:
    streams = []
    for p, (prompt, opts) in enumerate(zip(job.prompts, job.options, strict=True)):
        for i in range(job.n):
            index = p * job.n + i
            seed = opts.seed + i if opts.seed is not None else None
            spec = ChoiceSpec(index, f"{job.response_id}-{index}", prompt, opts, seed)
            streams.append(generate_choice(state.generation, spec, arrival))
    return merge_choices(streams)


async def _run(state: RouterState, request: Request, job: Job, arrival: float, slot: _Slot) -> Response:
    events = _events(state, job, arrival)
    if not job.stream:
        tally = Tally(job)

        async def collect() -> None:
            async for event in events:
                tally.add(event)

        try:
            gone = await _until_disconnect(request, collect())
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        if gone:
            log.info("%s: client disconnected before the response", job.response_id)
            return Response(status_code=499)
        log_done(job, tally, arrival, 200)
        return JSONResponse(full_response(job, tally).model_dump(mode="json"))
    peeked: list[ChoiceEvent | None] = []

    async def peek() -> None:  # the HTTP status is decided by the first event (or error)
        peeked.append(await anext(events, None))

    try:
        gone = await _until_disconnect(request, peek())
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    if gone or peeked[0] is None:
        await events.aclose()  # type: ignore[attr-defined]
        if gone:
            log.info("%s: client disconnected before the first token", job.response_id)
            return Response(status_code=499)
        raise OpenAIError(502, "the decode worker stream ended before any event")
    first = peeked[0]
    slot.handed_over = True
    return SSEResponse(sse_body(job, events, first, arrival), on_close=slot.release_async)


async def _until_disconnect(request: Request, work: Any) -> bool:
    """Run ``work``; True (and ``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True
    task.result()  # re-raises the work's error
    return False


