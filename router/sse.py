"""Server-sent events: framing and a streaming response that always cleans up.

Framing (what OpenAI clients parse): every event is ``data: <json>\\n\\n``; the stream ends with
``data: [DONE]\\n\\n``; an error after the first byte is an ``{"error": {...}}`` event followed by [DONE].
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.middleware import report_status

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: str | bytes | dict[str, Any]) -> bytes:
    """One ``data:`` event; ``payload`` is JSON text (or a dict to serialize) without newlines."""
    if isinstance(payload, dict):
        payload = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    data = payload.encode() if isinstance(payload, str) else payload
    if b"\n" in data or b"\r" in data:
        raise ValueError("an SSE data payload must be one line (serialize JSON without indentation)")
    return b"data: " + data + b"\n\n"


def parse_sse(body: bytes) -> list[str]:
    """The data payloads of an SSE body, [DONE] included (for tests and clients)."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = [line for line in block.split("\n") if not line.startswith(":")]  # ":" lines are comments
        if not lines:
            continue
        if not all(line.startswith("data: ") for line in lines):
            raise ValueError(f"malformed SSE event: {block!r}")
        events.append("\n".join(line[len("data: "):] for line in lines))
    return events


class SSEResponse(StreamingResponse):
    """Streams ``events`` as text/event-stream and stops as soon as the client disconnects.

    Unlike a plain StreamingResponse it also watches for the disconnect while the iterator waits for the
    next event (a decode worker may be silent for a while), and it closes the iterator and runs
    ``on_close`` on every exit path: finished, client gone, or cancelled before the first event. A client that
    leaves before the end is counted as 499 (its response had started as 200).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(events, status_code=200, headers={**SSE_HEADERS, **(headers or {})},
                         media_type=self.media_type)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_gone = complete = False
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    nonlocal complete
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                    async for chunk in self._events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    complete = True  # the server's receive() answers http.disconnect once the response is done
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    tg.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    nonlocal client_gone
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    client_gone = not complete
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch_disconnect)
        except OSError:
            client_gone = not complete  # the client went away mid-send
        finally:
            if client_gone:
                report_status(scope, 499)
            with anyio.CancelScope(shield=True):  # cleanup must run even when the server cancels us
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._on_close is not None:
                    await self._on_close()
