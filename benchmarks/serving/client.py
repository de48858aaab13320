"""Streamed /v1/completions requests, at most C in flight, timed chunk by chunk.

Every time is in seconds since the point's start (``t0``, a ``time.perf_counter()`` value). A *chunk* is an
SSE event whose choice carries generated token ids (requests ask for ``return_token_ids``; each chunk then
records how many tokens it carries) or, from a server that does not return ids, non-empty text (as
``sglang.bench_serving`` counts them: one chunk can then hold several tokens and a token can produce no chunk,
see ``config.Target.token_ids``). TTFT is taken at the first chunk. Token counts come from the final usage
event (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.serving.config import Target


@dataclass
class RequestResult:
    """One request as the client saw it. ``chunk_times[0]`` is the first chunk's arrival (TTFT = it - start);
    ``end`` is when the stream closed. ``error`` "" means success."""

    index: int
    start: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens of each chunk; empty when the ids were not sent
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive chunks (seconds)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (end - first chunk) / (completion_tokens - 1)."""
        if not self.chunk_times or self.completion_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        r6 = lambda x: round(x, 6)  # microseconds are plenty
        ttft = self.ttft
        return {"index": self.index, "start": r6(self.start), "ttft": r6(ttft) if ttft is not None else None,
                "end": r6(self.end), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason,
                "num_chunks": len(self.chunk_times), "chunk_tokens": self.chunk_tokens,
                "itl": [r6(x) for x in self.itl], "error": self.error}


def make_http_client(target: Target, max_connections: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections + 4, max_keepalive_connections=max_connections + 4)
    return httpx.AsyncClient(base_url=target.base_url, headers=target.headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=30.0))


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:300]
    return f"HTTP {status}: {message}"


async def send_completion(client: httpx.AsyncClient, model: str, prompt: Sequence[int] | np.ndarray,
                          max_tokens: int, ignore_eos: bool, index: int, t0: float,
                          token_ids: bool = True, output: list[int] | None = None) -> RequestResult:
    """POST one streamed greedy completion of ``prompt`` (token ids) and time it; errors are recorded, not
    raised. ``token_ids``: ask for ``return_token_ids`` and time chunks by the ids they carry; ``output``,
    when given, receives those ids."""
    ids = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_token_ids"] = True
    result = RequestResult(index, time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = _error_text(response.status_code, await response.aread())
            else:
                await read_stream(response, result, t0, output)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter() - t0
    if result.ok and not result.finish_reason:
        result.error = "the stream ended without a finish reason"
    return result


async def read_stream(response: httpx.Response, result: RequestResult, t0: float,
                      output: list[int] | None = None) -> None:
    """Fill ``result`` from an SSE completion stream. A choice with a ``token_ids`` field (``return_token_ids``
    requests) is a chunk when the ids are non-empty, and records their number; one without the field is a chunk
    when it carries text. ``output``, when given, receives the ids."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        now = time.perf_counter() - t0
        event = json.loads(payload)
        if "error" in event:
            result.error = f"stream error: {event['error'].get('message', event['error'])}"
            return
        for choice in event.get("choices") or ():
            if "token_ids" in choice:
                if ids := choice["token_ids"] or ():
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(len(ids))
                    if output is not None:
                        output.extend(ids)
            elif choice.get("text"):
                result.chunk_times.append(now)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.completion_tokens = usage.get("completion_tokens", 0)
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: 0 for inf, else exponential gaps (a Poisson process)."""
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng([seed, 2]).exponential(1.0 / request_rate, size=num)
    gaps[0] = 0.0
    return gaps.tolist()


async def run_requests(client: httpx.AsyncClient, model: str, prompts: Sequence[Sequence[int]] | np.ndarray,
                       max_tokens: int, concurrency: int, ignore_eos: bool, t0: float,
                       request_rate: float = math.inf, seed: int = 0,
                       on_done: Callable[[RequestResult], None] | None = None,
                       token_ids: bool = True) -> list[RequestResult]:
    """Send every prompt, at most ``concurrency`` in flight (FIFO), the i-th not before its arrival time.

    A request's ``start`` is when it got its slot and was sent, not its arrival."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: Sequence[int] | np.ndarray) -> RequestResult:
        async with slots:
            result = await send_completion(client, model, prompt, max_tokens, ignore_eos, i, t0, token_ids)
        if on_done is not None:
            on_done(result)
        return result

    tasks = []
    gaps = arrival_gaps(len(prompts), request_rate, seed)
    for i, (prompt, gap) in enumerate(zip(prompts, gaps, strict=True)):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(i, prompt)))
    return list(await asyncio.gather(*tasks))
