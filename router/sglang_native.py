"""SGLang's native API on the router: POST /generate and GET /health_generate.

    {"text" | "input_ids", "sampling_params", "stream", "rid"}  ->  the same choice flow as /v1/completions
        non-stream: {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
                     "cached_tokens", "finish_reason": {"type": "stop" | "length", "matched" | "length"},
                     "e2e_latency"}}   (a list of them for a batch of prompts)
        stream:     data: {same shape, cumulative "text" and "output_ids", "finish_reason" null until the end,
                     "index" for a batch} ... data: [DONE]

``sampling_params`` take SGLang's names (max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p,
stop, stop_token_ids, ignore_eos, presence/frequency/repetition_penalty, no_stop_trim, skip_special_tokens,
regex, ebnf, json_schema, sampling_seed); ``n`` other than 1 and any other name are a 400 naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.generation import (
    ChoiceEvent,
    ChoiceFinished,
    ChoiceSpec,
    ChoiceStarted,
    ChoiceText,
    generate_choice,
    merge_choices,
)
from router.openai_protocol import (
    INT32_MAX,
    MAX_STOP_STRINGS,
    Constraint,
    OpenAIError,
    SamplingOptions,
    bad_request,
)
from router.serving import (
    RouterState,
    _check_token_ids,
    _Slot,
    _until_disconnect,
    check_text_prompts,
    prompt_ids,
    read_body,
)
from router.sse import SSE_DONE, SSEResponse, sse_event

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_GENERATE_TIMEOUT_S = 20.0  # as SGLang's /health_generate

# top-level fields SGLang accepts that this server does not implement, with the value that means "off"
_REFUSED_NEUTRAL: dict[str, Any] = {
    "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
    "return_text_in_logprobs": False, "image_data": None, "audio_data": None, "video_data": None,
    "lora_path": None, "lora_id": None, "custom_logit_processor": None, "session_params": None,
    "return_hidden_states": False, "modalities": None, "input_embeds": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "data_parallel_rank": None, "log_metrics": True,
    "return_routed_experts": False,
}


class SGLangSamplingParams(BaseModel):
    """One prompt's ``sampling_params`` (SGLang's names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=0, le=INT32_MAX)
    min_new_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    sampling_seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    n: int = 1

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return value

    def constraint(self) -> Constraint | None:
        given = [(k, v) for k, v in (("regex", self.regex), ("ebnf", self.ebnf), ("json_schema", self.json_schema))
                 if v is not None]
        if len(given) > 1:
            raise bad_request(f"at most one of regex, ebnf, json_schema (got {given[0][0]} and {given[1][0]})",
                              f"sampling_params.{given[1][0]}")
        return Constraint(given[0][0], given[0][1]) if given else None

    def options(self, vocab_size: int) -> SamplingOptions:
        stop_ids = list(self.stop_token_ids or ())
        _check_token_ids(stop_ids, vocab_size, "sampling_params.stop_token_ids")
        return SamplingOptions(
            max_tokens=max(1, self.max_new_tokens), temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.sampling_seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(stop_ids), ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_tokens=min(self.min_new_tokens, max(1, self.max_new_tokens)),
            include_stop_str_in_output=self.no_stop_trim, skip_special_tokens=self.skip_special_tokens,
            constraint=self.constraint(), drop_output=self.max_new_tokens == 0)


class GenerateRequest(BaseModel):
    """POST /generate. One of ``text`` (a string or a batch of strings) and ``input_ids`` (ids or a batch)."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # SGLang always reports usage in meta_info
    rid: str | list[str] | None = None

    def prompts(self) -> tuple[list[str] | list[list[int]], bool]:
        """The prompts and whether the request is a batch (its answer a list)."""
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", "text" if self.text is None else "input_ids")
        if self.text is not None:
            batch = isinstance(self.text, list)
            prompts: list[Any] = list(self.text) if batch else [self.text]
            param = "text"
        else:
            batch = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            prompts = list(self.input_ids) if batch else [self.input_ids]  # type: ignore[arg-type]
            param = "input_ids"
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request(f"{param} must not be empty", param)
        return prompts, batch

    def check_refused(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in _REFUSED_NEUTRAL:
                raise bad_request(f"unknown parameter {name!r} for /generate", name)
            if value != _REFUSED_NEUTRAL[name] and value is not None:
                raise bad_request(f"{name} is not supported on /generate by this server (got "
                                  f"{json.dumps(value)[:60]}); logprobs are served by /v1/completions", name)


def _sampling(req: GenerateRequest, num_prompts: int, vocab_size: int) -> list[tuple[SGLangSamplingParams,
                                                                                      SamplingOptions]]:
    raw = req.sampling_params if req.sampling_params is not None else {}
    if isinstance(raw, list) and len(raw) != num_prompts:
        raise bad_request(f"sampling_params has {len(raw)} entries for {num_prompts} prompts", "sampling_params")
    out = []
    for entry in raw if isinstance(raw, list) else [raw] * num_prompts:
        try:
            params = SGLangSamplingParams.model_validate(entry)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ".".join(str(x) for x in err["loc"])
            why = "not supported by this server" if err["type"] == "extra_forbidden" else \
                err["msg"].removeprefix("Value error, ")
            raise bad_request(f"sampling_params.{name}: {why}", f"sampling_params.{name}") from None
        if params.n != 1:
            raise bad_request(f"sampling_params.n: only n=1 is supported on /generate (got {params.n}); send the "
                              f"prompt several times in a batch instead", "sampling_params.n")
        out.append((params, params.options(vocab_size)))
    return out


class _Result:
    """One prompt's answer as SGLang shapes it, built up from its choice events."""

    def __init__(self, rid: str, prompt_len: int, max_new_tokens: int) -> None:
        self.rid, self.prompt_len, self.max_new_tokens = rid, prompt_len, max_new_tokens
        self.text, self.output_ids, self.cached_tokens = "", [], 0
        self.finish: dict[str, Any] | None = None

    def add(self, event: ChoiceEvent) -> None:
        if isinstance(event, ChoiceStarted):
            self.cached_tokens = event.cached_tokens
        elif isinstance(event, ChoiceText):
            self.text += event.text
            self.output_ids.extend(event.token_ids)
        elif isinstance(event, ChoiceFinished):
            if event.finish_reason == "length":
                self.finish = {"type": "length", "length": self.max_new_tokens}
            else:
                self.finish = {"type": "stop", "matched": event.stop_reason}

    def body(self, arrival: float, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": {
            "id": self.rid, "prompt_tokens": self.prompt_len, "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens, "finish_reason": self.finish,
            "e2e_latency": time.perf_counter() - arrival}}
        if index is not None:
            out["index"] = index
        return out


async def generate(state: RouterState, request: Request) -> Response:
    """POST /generate (SGLang native)."""
    arrival = time.perf_counter()
    body = await read_body(request, state.config.max_body_bytes)
    try:
        req = GenerateRequest.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"]]
        raise bad_request(f"{'.'.join(loc)}: {err['msg']}" if loc else err["msg"], loc[0] if loc else None) from None
    req.check_refused()
    prompts, batch = req.prompts()
    if len(prompts) > state.config.max_n * 16:
        raise bad_request(f"at most {state.config.max_n * 16} prompts per request, got {len(prompts)}", "text")
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise bad_request(f"rid has {len(rids)} entries for {len(prompts)} prompts", "rid")
    sampling = _sampling(req, len(prompts), state.limits.vocab_size)
    check_text_prompts(state, prompts, "text")
    slot = _Slot(state.gate)
    await state.gate.acquire()
    try:
        specs, results = [], []
        for i, (p, (params, opts)) in enumerate(zip(prompts, sampling, strict=True)):
            ids = await prompt_ids(state, p, True, "text", "input_ids")
            room = state.context_len() - len(ids)
            if params.max_new_tokens > room or room <= 0:
                raise bad_request(f"the prompt has {len(ids)} tokens and max_new_tokens is {params.max_new_tokens}: "
                                  f"more than the context of {state.context_len()} tokens",
                                  "sampling_params.max_new_tokens", code="context_length_exceeded")
            rid = rids[i] or uuid.uuid4().hex
            specs.append(ChoiceSpec(i, f"gen-{rid}", tuple(ids), opts, opts.seed))
            results.append(_Result(rid, len(ids), params.max_new_tokens))
        events = merge_choices([generate_choice(state.generation, s, arrival) for s in specs])
        if not req.stream:
            async def collect() -> None:
                async for event in events:
                    results[event.index].add(event)

            try:
                gone = await _until_disconnect(request, collect())
            finally:
                await events.aclose()  # type: ignore[attr-defined]
            if gone:
                return Response(status_code=499)
            bodies = [r.body(arrival) for r in results]
            return JSONResponse(bodies if batch else bodies[0])
        first = await anext(events, None)  # errors before the first event keep their HTTP status
        if first is None:
            raise OpenAIError(502, "the decode worker stream ended before any event")
        slot.handed_over = True
        return SSEResponse(_stream(events, first, results, arrival, batch), on_close=slot.release_async)
    finally:
        if not slot.handed_over:
            slot.release()


async def _stream(events: AsyncIterator[ChoiceEvent], first: ChoiceEvent, results: list[_Result], arrival: float,
                  batch: bool) -> AsyncIterator[bytes]:
    """A chunk per text piece and one at each prompt's finish, cumulative as SGLang's; an error becomes an error
    event before [DONE]."""
    try:
        event: ChoiceEvent | None = first
        while event is not None:
            r = results[event.index]
            r.add(event)
            if isinstance(event, ChoiceFinished) or (isinstance(event, ChoiceText) and (event.text or event.token_ids)):
                yield sse_event(r.body(arrival, event.index if batch else None))
            event = await anext(events, None)
    except OpenAIError as err:
        yield sse_event(err.body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


async def health_generate(state: RouterState) -> JSONResponse:
    """GET /health_generate: one token through a decode worker; 200 when it came back, else 503."""
    arrival = time.perf_counter()
    opts = SamplingOptions(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, stop=(),
                           stop_token_ids=(), ignore_eos=True)
    spec = ChoiceSpec(0, f"health-{uuid.uuid4().hex}", (0,), opts, None)

    async def one_token() -> ChoiceFinished | None:
        async with contextlib.aclosing(generate_choice(state.generation, spec, arrival)) as events:
            async for event in events:
                if isinstance(event, ChoiceFinished):
                    return event
        return None

    try:
        done = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        why = f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s"
    except OpenAIError as err:
        why = err.message
    else:
        if done is not None and done.completion_tokens == 1:
            return JSONResponse({"status": "ok", "latency_s": time.perf_counter() - arrival})
        why = "the decode worker finished without a token"
    err = OpenAIError(503, f"health_generate failed: {why}", code="no_healthy_worker",
                      headers={"Retry-After": str(max(1, state.config.retry_after_s))})
    return JSONResponse(err.body(), status_code=503, headers=err.headers)

