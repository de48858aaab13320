"""ASGI middleware of the gateway: API-key check and per-request metrics (pure ASGI: streams pass through)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Collection

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.metrics import RouterMetrics
from router.openai_protocol import OpenAIError


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), else None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <api_key>`` on every HTTP path except ``open_paths``.

    The comparison is constant-time (hmac.compare_digest) so response timing reveals nothing of the key.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str]) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty api_key")
        self.app = app
        self._key = api_key.encode()
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        if token is not None and hmac.compare_digest(token, self._key):
            await self.app(scope, receive, send)
            return
        err = OpenAIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                          error_type="invalid_request_error", code="invalid_api_key")
        await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


OUTCOME_KEY = "nvfp4.outcome"  # scope key: a dict in which a response reports a status its start line cannot carry


def report_status(scope: Scope, status: int) -> None:
    """Count this request under ``status`` whatever status its response started with (a stream whose client
    left mid-way: 499)."""
    outcome = scope.get(OUTCOME_KEY)
    if outcome is not None:
        outcome["status"] = status


class RequestMetricsMiddleware:
    """Counts requests by endpoint and status and observes their latency (to the last byte sent).

    Paths that are not routes are counted as endpoint "other" (labels never carry raw URLs). A response may
    override the counted status with ``report_status`` (a stream the client left: 499, not its 200)."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, endpoints: Collection[str]) -> None:
        self.app = app
        self._metrics = metrics
        self._endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self._endpoints else "other"
        status = 500  # if the app dies before it starts a response
        start = time.perf_counter()
        outcome: dict[str, int] = {}
        scope[OUTCOME_KEY] = outcome

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            status = outcome.get("status", status)
            self._metrics.requests.labels(endpoint, str(status)).inc()
            self._metrics.request_latency.labels(endpoint).observe(time.perf_counter() - start)
