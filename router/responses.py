"""OpenAI response bodies of one request: the JSON of a non-streamed response, the SSE chunks of a streamed one.

Usage counts each prompt once however many choices it has (n); ``cached_tokens`` of a prompt is the least any
of its choices reused (a retry's report replaces the failed attempt's). With ``return_token_ids``
(completions only) each choice carries its generated ``token_ids`` and its ``prompt_token_ids``; streamed,
every chunk carries the ids generated since the last one (a chunk may then have empty text) and a choice's
first chunk the prompt's.

Logprobs: completions in the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs`` with the chosen
token among the alternatives, as vLLM, and ``text_offset``), with ``echo`` the prompt's first (its first token
None); chat as ``content: [{token, logprob, bytes, top_logprobs}]``. Streamed, each chunk carries the
logprobs of its tokens. ``continuous_usage_stats``: every chunk carries the usage so far.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.generation import ChoiceEvent, ChoiceFinished, ChoiceStarted, ChoiceText, TokenLogprob
from router.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    OpenAIError,
    SamplingOptions,
    UsageInfo,
    make_usage,
)
from router.sse import SSE_DONE, sse_event

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One validated, tokenized request: ``len(prompts) * n`` choices, choice index = prompt index * n + i."""

    kind: str  # "completion" | "chat"
    response_id: str
    model: str
    prompts: list[tuple[int, ...]]
    options: list[SamplingOptions]  # per prompt
    n: int
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    return_token_ids: bool = False
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    continuous_usage: bool = False
    logprobs: bool = False
    token_text: Callable[[int], str] = str  # one token's text (special tokens included)
    prompt_texts: list[str] = field(default_factory=list)  # per prompt, for echo

    def prompt_of(self, index: int) -> tuple[int, ...]:
        """The prompt of choice ``index``."""
        return self.prompts[index // self.n]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


class Tally:
    """Per-choice results and the request's usage (the prompt counts once per prompt, not per choice)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.texts: dict[int, list[str]] = {i: [] for i in range(job.num_choices)}
        self.finish: dict[int, str] = {}
        self.completion_tokens: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.token_ids: dict[int, list[int]] = {i: [] for i in range(job.num_choices)}
        self.logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in range(job.num_choices)}
        self.prompt_logprobs: dict[int, tuple[TokenLogprob, ...]] = {}
        self.stop_reason: dict[int, int | str | None] = {}

    def add(self, event: ChoiceEvent) -> None:
        if isinstance(event, ChoiceStarted):
            self.cached[event.index] = event.cached_tokens  # a retry overwrites
            self.prompt_logprobs[event.index] = event.prompt_logprobs
        elif isinstance(event, ChoiceText):
            self.texts[event.index].append(event.text)
            self.token_ids[event.index].extend(event.token_ids)
            self.logprobs[event.index].extend(event.logprobs)
        else:
            self.finish[event.index] = event.finish_reason
            self.completion_tokens[event.index] = event.completion_tokens
            self.stop_reason[event.index] = event.stop_reason

    def usage(self) -> UsageInfo:
        n = self.job.n
        prompt_tokens = sum(len(p) for p in self.job.prompts)
        cached = sum(min(self.cached.get(p * n + i, 0) for i in range(n)) for p in range(len(self.job.prompts)))
        done = sum(self.completion_tokens.get(i, len(self.token_ids[i])) for i in range(self.job.num_choices))
        return make_usage(prompt_tokens, done, cached)


def completion_logprobs(job: Job, lps: Sequence[TokenLogprob], offset: int,
                        prompt_ids: Sequence[int] = ()) -> CompletionLogprobs:
    """The legacy shape of ``lps``; with ``prompt_ids`` (echo) the first prompt token (no logprob) first."""
    out = CompletionLogprobs()
    if prompt_ids:
        first = job.token_text(prompt_ids[0])
        out.tokens.append(first)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(first)
    for lp in lps:
        token = job.token_text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top = {job.token_text(t): v for t, v in lp.top}
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(job: Job, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> ChatTopLogprob:
        token = job.token_text(token_id)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for lp in lps:
        head = entry(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[entry(t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)


def _echo_logprobs(job: Job, tally: Tally, i: int) -> CompletionLogprobs | None:
    if not job.logprobs:
        return None
    prompt = job.prompt_of(i)
    if job.echo:
        both = [*tally.prompt_logprobs.get(i, ()), *tally.logprobs[i]]
        return completion_logprobs(job, both, 0, prompt)
    return completion_logprobs(job, tally.logprobs[i], 0)


def full_response(job: Job, tally: Tally) -> CompletionResponse | ChatCompletionResponse:
    usage = tally.usage()
    indices = range(job.num_choices)
    if job.kind == "completion":
        ids = job.return_token_ids
        echo = [job.prompt_texts[i // job.n] if job.echo else "" for i in indices]
        return CompletionResponse(id=job.response_id, created=job.created, model=job.model, usage=usage, choices=[
            CompletionChoice(index=i, text=echo[i] + "".join(tally.texts[i]), finish_reason=tally.finish.get(i),
                             stop_reason=tally.stop_reason.get(i), logprobs=_echo_logprobs(job, tally, i),
                             token_ids=tally.token_ids[i] if ids else None,
                             prompt_token_ids=list(job.prompt_of(i)) if ids else None)
            for i in indices])
    return ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, usage=usage, choices=[
        ChatChoice(index=i, message=AssistantMessage(content="".join(tally.texts[i])),
                   logprobs=chat_logprobs(job, tally.logprobs[i]) if job.logprobs else None,
                   finish_reason=tally.finish.get(i), stop_reason=tally.stop_reason.get(i)) for i in indices])


class Chunks:
    """SSE chunk encoders for one streamed response."""

    def __init__(self, job: Job, tally: Tally | None = None) -> None:
        self.job = job
        self.tally = tally  # the usage so far, for continuous_usage_stats
        self._offsets: dict[int, int] = {}  # completion logprobs' text_offset per choice
        self._prompt_ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)

    def _ids(self, index: int, token_ids: tuple[int, ...]) -> dict[str, Any]:
        """The return_token_ids fields of a completion chunk's choice (none without the flag)."""
        if not self.job.return_token_ids:
            return {}
        out: dict[str, Any] = {"token_ids": list(token_ids)}
        if index not in self._prompt_ids_sent:
            self._prompt_ids_sent.add(index)
            out["prompt_token_ids"] = list(self.job.prompt_of(index))
        return out

    def wants(self, event: ChoiceText) -> bool:
        """Whether ``event`` makes a chunk: it has text, or ids or logprobs the client asked for."""
        return bool(event.text) or (self.job.return_token_ids and bool(event.token_ids)) or \
            (self.job.logprobs and bool(event.logprobs))

    def _chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> bytes:
        job = self.job
        cls = CompletionResponse if job.kind == "completion" else ChatCompletionChunk
        if usage is None and choices and self.tally is not None and job.continuous_usage:
            usage = self.tally.usage()
        return sse_event(cls(id=job.response_id, created=job.created, model=job.model, choices=choices,
                             usage=usage).model_dump_json())

    def echo(self, index: int, prompt_logprobs: Sequence[TokenLogprob]) -> bytes:
        """A completion choice's first chunk with echo: the prompt's text (and logprobs)."""
        job = self.job
        lps = completion_logprobs(job, prompt_logprobs, 0, job.prompt_of(index)) if job.logprobs else None
        self._offsets[index] = len(job.prompt_texts[index // job.n])
        return self._chunk([CompletionChoice(index=index, text=job.prompt_texts[index // job.n], logprobs=lps)])

    def start(self) -> list[bytes]:
        if self.job.kind == "completion":
            return []
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.job.num_choices)]

    def text(self, index: int, text: str, token_ids: tuple[int, ...] = (),
             logprobs: Sequence[TokenLogprob] = ()) -> bytes:
        job = self.job
        if job.kind == "completion":
            lps = None
            if job.logprobs:
                offset = self._offsets.get(index, 0)
                lps = completion_logprobs(job, logprobs, offset)
                self._offsets[index] = offset + len(text)
            return self._chunk([CompletionChoice(index=index, text=text, logprobs=lps,
                                                 **self._ids(index, token_ids))])
        return self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=text),
                                            logprobs=chat_logprobs(job, logprobs) if job.logprobs else None)])

    def finish(self, index: int, reason: str, stop_reason: int | str | None = None) -> bytes:
        if self.job.kind == "completion":
            return self._chunk([CompletionChoice(index=index, text="", finish_reason=reason, stop_reason=stop_reason,
                                                 **self._ids(index, ()))])
        return self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason,
                                            stop_reason=stop_reason)])

    def usage(self, usage: UsageInfo) -> bytes:
        return self._chunk([], usage)


async def sse_body(job: Job, events: AsyncIterator[ChoiceEvent], first: ChoiceEvent,
                   arrival: float) -> AsyncIterator[bytes]:
    """The SSE chunks of a streamed response: (chat: a role chunk per choice), text chunks, a finish chunk per
    choice, (a usage chunk), ``data: [DONE]``; an error becomes an error event before [DONE]."""
    tally = Tally(job)
    chunks = Chunks(job, tally)
    status = 200
    echoed: set[int] = set()
    try:
        for chunk in chunks.start():
            yield chunk
        event: ChoiceEvent | None = first
        while event is not None:
            tally.add(event)
            if isinstance(event, ChoiceStarted):
                if job.echo and job.kind == "completion" and event.index not in echoed:  # a retry echoes once
                    echoed.add(event.index)
                    yield chunks.echo(event.index, event.prompt_logprobs)
            elif isinstance(event, ChoiceText):
                if chunks.wants(event):
                    yield chunks.text(event.index, event.text, event.token_ids, event.logprobs)
            elif isinstance(event, ChoiceFinished):
                yield chunks.finish(event.index, event.finish_reason, event.stop_reason)
            event = await anext(events, None)
        if job.include_usage:
            yield chunks.usage(tally.usage())
    except OpenAIError as err:
        status = err.status
        yield sse_event(err.body())
    except (GeneratorExit, asyncio.CancelledError):
        status = 499  # the client went away
        raise
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        log_done(job, tally, arrival, status)
    yield SSE_DONE


def log_done(job: Job, tally: Tally, arrival: float, status: int) -> None:
    log.info("%s %s: %d choice(s), prompt_tokens=%d completion_tokens=%d cached=%d status=%d %.3fs",
             job.response_id, job.kind, job.num_choices, sum(len(p) for p in job.prompts),
             sum(tally.completion_tokens.values()), tally.usage().prompt_tokens_details.cached_tokens, status,
             time.perf_counter() - arrival)
