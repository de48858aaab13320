"""Router streaming: SSE framing, OpenAI chunk shapes, cleanup on disconnect, stop strings over real tokens."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from router.generation import ChoiceFinished, ChoiceStarted, ChoiceText
from router.openai_protocol import OpenAIError, SamplingOptions
from router.responses import Job, sse_body
from router.sse import SSE_DONE, SSEResponse, parse_sse, sse_event
from router.stop_strings import StopStringMatcher

OPTS = SamplingOptions(max_tokens=8, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, stop=(),
                       stop_token_ids=(), ignore_eos=False)


def _job(kind: str, n: int = 1, include_usage: bool = True, prompts: int = 1) -> Job:
    return Job(kind, f"{kind}-id", "tiny", [tuple(range(5 + p)) for p in range(prompts)], [OPTS] * prompts, n,
               True, include_usage, created=1700000000)


async def _collect(job: Job, events: list, fail: OpenAIError | None = None) -> list[str]:
    async def gen():
        for e in events[1:]:
            yield e
        if fail is not None:
            raise fail

    body = b"".join([chunk async for chunk in sse_body(job, gen(), events[0], 0.0)])
    return parse_sse(body)


def test_sse_event_framing():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse_event('{"x":1}') == b'data: {"x":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError, match="one line"):
        sse_event('{"x":\n1}')
    assert parse_sse(b'data: {"x":1}\n\n: keep-alive\n\ndata: [DONE]\n\n') == ['{"x":1}', "[DONE]"]


def test_chat_stream_chunks_parse_as_openai_types_and_end_with_usage_then_done():
    events = [ChoiceStarted(0, 3), ChoiceText(0, "Hel"), ChoiceText(0, "lo"), ChoiceFinished(0, "stop", 2)]
    payloads = asyncio.run(_collect(_job("chat"), events))
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 2, 7)
    assert usage.prompt_tokens_details.cached_tokens == 3
    assert {c.id for c in chunks} == {"chat-id"} and {c.created for c in chunks} == {1700000000}


def test_completion_stream_with_n_and_two_prompts_counts_each_prompt_once():
    job = _job("completion", n=2, prompts=2)  # prompts of 5 and 6 tokens, choices 0..3
    events = [ChoiceStarted(0, 4), ChoiceStarted(1, 2), ChoiceStarted(2, 6), ChoiceStarted(3, 6),
              ChoiceText(1, "b"), ChoiceText(0, "a"), ChoiceText(3, "d"), ChoiceText(2, "c"),
              *(ChoiceFinished(i, "length", 1) for i in range(4))]
    payloads = asyncio.run(_collect(job, events))
    chunks = [json.loads(p) for p in payloads[:-1]]
    texts: dict[int, str] = {}
    for c in chunks[:-1]:  # streamed completion chunks carry finish_reason null until the end, as OpenAI's
        assert (c["object"], c["id"], c["model"]) == ("text_completion", "completion-id", "tiny")
        (choice,) = c["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "a", 1: "b", 2: "c", 3: "d"}
    usage = Completion.model_validate(chunks[-1]).usage
    # prompt tokens once per prompt (5 + 6); cached: the least any choice of a prompt reused (2 + 6)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (11, 4, 8)


def test_stream_without_include_usage_has_no_usage_chunk():
    payloads = asyncio.run(_collect(_job("completion", include_usage=False),
                                    [ChoiceStarted(0, 0), ChoiceText(0, "x"), ChoiceFinished(0, "length", 1)]))
    assert all(json.loads(p)["choices"] for p in payloads[:-1])
    assert payloads[-1] == "[DONE]"


def test_error_after_first_byte_becomes_an_error_event_then_done():
    err = OpenAIError(503, "decode worker 127.0.0.1:1 unavailable: socket closed")
    payloads = asyncio.run(_collect(_job("chat"), [ChoiceStarted(0, 0), ChoiceText(0, "par")], fail=err))
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2]) == {"error": {"message": err.message, "type": "server_error", "param": None,
                                                  "code": None}}


def _asgi_scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/",
            "headers": []}


def test_sse_response_closes_the_stream_when_the_client_disconnects_while_waiting():
    async def scenario() -> tuple[list[dict], list[str]]:
        log: list[str] = []
        first_sent = asyncio.Event()
        sent: list[dict] = []

        async def events():
            try:
                yield b"data: 1\n\n"
                await asyncio.Event().wait()  # a silent decode worker
                yield b"data: never\n\n"
            finally:
                log.append("events closed")

        async def receive() -> dict:
            await first_sent.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message.get("body"):
                first_sent.set()

        async def on_close() -> None:
            log.append("slot released")

        await asyncio.wait_for(SSEResponse(events(), on_close=on_close)(_asgi_scope(), receive, send), 5)
        return sent, log

    sent, log = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert b"content-length" not in dict(sent[0]["headers"])
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]
    assert log == ["events closed", "slot released"]


def test_sse_response_releases_even_when_the_client_left_before_the_first_event():
    async def scenario() -> list[str]:
        log: list[str] = []

        async def events():
            log.append("started")
            yield b"data: x\n\n"

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await asyncio.sleep(0.01)

        async def on_close() -> None:
            log.append("slot released")

        await asyncio.wait_for(SSEResponse(events(), on_close=on_close)(_asgi_scope(), receive, send), 5)
        return log

    assert asyncio.run(scenario())[-1] == "slot released"


def test_sse_response_finishes_normally_and_releases_once():
    async def scenario() -> tuple[list[dict], list[str]]:
        log: list[str] = []
        sent: list[dict] = []
        done = asyncio.Event()

        async def events():
            yield b"data: a\n\n"
            yield SSE_DONE

        async def receive() -> dict:
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        async def on_close() -> None:
            log.append("slot released")

        await asyncio.wait_for(SSEResponse(events(), on_close=on_close)(_asgi_scope(), receive, send), 5)
        return sent, log

    sent, log = asyncio.run(scenario())
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"data: a\n\n" + SSE_DONE
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert log == ["slot released"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from offline.tiny_model import make_tiny_model
    from tokenization.tokenizer import Tokenizer

    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("text, stop, expected", [
    ("The answer is 42. STOP here and more", " STOP", "The answer is 42."),
    ("Grüße aus 日本語 und Tschüß", "日本", "Grüße aus "),
    ("no stop string in here at all", "zzz", "no stop string in here at all"),
])
def test_stop_strings_across_token_boundaries_with_the_real_detokenizer(tokenizer, text, stop, expected):
    from tokenization.tokenizer import IncrementalDetokenizer

    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 8  # many tokens: stop strings and characters span token boundaries
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Q:"))
    matcher = StopStringMatcher([stop])
    out, stopped = [], False
    for token in ids:
        result = matcher.push(detok.push(token))
        out.append(result.text)
        if result.stopped:
            stopped = True
            break
    if not stopped:
        result = matcher.push(detok.flush())
        out.append(result.text if result.stopped else result.text + matcher.flush())
    assert "".join(out) == expected
    assert stopped == (stop in text)
