"""One streamed turn: POST /v1/completions with the prompt as token ids and ``return_token_ids``.

The answer's ids are what the next turn's prompt is built from, so they come from the server (the vLLM
``return_token_ids`` extension, which the nvfp4-serve router implements): detokenizing and re-tokenizing the
text would not give the same ids back. A *chunk* here is an SSE event that carries at least one new token id,
so TTFT is at the first generated token and every chunk is a known number of tokens. Times are seconds
since the point's start ``t0`` (as ``benchmarks.serving.client``).
"""

from __future__ import annotations

import time

import httpx

from benchmarks.serving.client import RequestResult, _error_text, read_stream


async def send_turn(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, index: int,
                    t0: float) -> tuple[RequestResult, list[int]]:
    """Stream one greedy completion of exactly ``max_tokens`` tokens (ignore_eos); (timings, output ids).

    Errors are recorded in the result, not raised; the ids are then whatever arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    result = RequestResult(index, time.perf_counter() - t0)
    output: list[int] = []
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
    if result.ok and len(output) != result.completion_tokens:
        result.error = (f"the server streamed {len(output)} token ids for {result.completion_tokens} "
                        "completion tokens: it does not implement return_token_ids (the nvfp4-serve router "
                        "does)")
    return result, output


