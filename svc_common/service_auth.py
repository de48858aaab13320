"""The deployment's service token on every gRPC link: checked by one server interceptor, sent by every channel.

    client (router, decode)  --  metadata  authorization: Bearer <token>  -->  server (decode, prefill)

The token comes from ``--service-token``, else ``$NVFP4_SERVE_SERVICE_TOKEN``, else the API key
(``--api-key`` / ``$NVFP4_SERVE_API_KEY``), so ``nvfp4-serve up --api-key K`` guards every internal link
with ``K``. No token: the services accept any caller (the loopback default). The standard health check
(``grpc.health.v1.Health``) stays open, as the router's HTTP ``/health`` does, so that orchestrators can probe
a service without the token; everything else, reflection included, needs it. mTLS (``--tls-ca``) is the
stronger option and combines with the token.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

import grpc

SERVICE_TOKEN_ENV = "NVFP4_SERVE_SERVICE_TOKEN"
API_KEY_ENV = "NVFP4_SERVE_API_KEY"  # read when --api-key is absent (keeps the key out of `ps`)
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
_HEADER = "authorization"
UNAUTHENTICATED_MESSAGE = ("missing or wrong service token: this service accepts only callers of its deployment; "
                           "send 'authorization: Bearer <token>' metadata with the token the services were started "
                           f"with (--service-token or ${SERVICE_TOKEN_ENV}, else the API key)")


def resolve_service_token(flag: str | None, api_key: str | None = None,
                          environ: Mapping[str, str] | None = None) -> str:
    """The token of this process: the flag, else $NVFP4_SERVE_SERVICE_TOKEN, else the API key (flag or env)."""
    env = os.environ if environ is None else environ
    return flag or env.get(SERVICE_TOKEN_ENV, "") or api_key or env.get(API_KEY_ENV, "")


def _bearer(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key.lower() == _HEADER:
            raw = value.encode() if isinstance(value, str) else value
            scheme, _, token = raw.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


class ServiceTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to any call but the health check whose metadata lacks the token.

    The comparison is constant-time (hmac.compare_digest): its timing reveals nothing of the token."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("ServiceTokenInterceptor needs a non-empty token")
        self._token = token.encode()

    def accepts(self, method: str, metadata) -> bool:
        if method in OPEN_METHODS:
            return True
        got = _bearer(metadata)
        return got is not None and hmac.compare_digest(got, self._token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self.accepts(handler_call_details.method, handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED without reading the request."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, des, ser)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, des, ser)


class _WithToken:
    """Adds ``authorization: Bearer <token>`` to the metadata of a call."""

    def __init__(self, token: str) -> None:
        self._entry = (_HEADER, f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files a channel's interceptor under ONE kind (the first base class it matches): one class per kind.
class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """What a channel needs to send ``token`` on every call (nothing without one)."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if token else []


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """What a server needs to check ``token`` on every call (nothing without one)."""
    return [ServiceTokenInterceptor(token)] if token else []
