"""One streamed turn: POST /v1/completions with the prompt as token ids and ``return_token_ids``.

The answer's ids are what the next turn's prompt is built from, so they come from the server (the vLLM
``return_token_ids`` extension, which the nvfp4-serve router implements): detokenizing and re-tokenizing the
text would not give the same ids back. A *chunk* here is an SSE event that carries at least one new token id,
so TTFT is at the first generated token and every chunk is a known number of tokens. Times are seconds
since the point's start ``t0`` (as ``benchmarks.serving.client``).
"""

from __future__ import annotations

import httpx

from benchmarks.serving.client import RequestResult, send_completion


async def send_turn(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, index: int,
                    t0: float) -> tuple[RequestResult, list[int]]:
    """Stream one greedy completion of exactly ``max_tokens`` tokens (ignore_eos); (timings, output ids).

    Errors are recorded in the result, not raised; the ids are then whatever arrived."""
    output: list[int] = []
    result = await send_completion(client, model, prompt, max_tokens, True, index, t0, True, output)
    if result.ok and len(output) != result.completion_tokens:
        result.error = (f"the server streamed {len(output)} token ids for {result.completion_tokens} "
                        "completion tokens: it does not implement return_token_ids (the nvfp4-serve router "
                        "does)")
    return result, output
