"""What every gRPC service shares: error -> status mapping, health checking, reflection, TLS, metrics RPC."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.scheduler import RequestRejected
from nvfp4_serve.errors import ServiceError

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a handler's exception becomes."""
    if isinstance(exc, ServiceError):
        return getattr(grpc.StatusCode, exc.status_name), str(exc)
    if isinstance(exc, RequestRejected):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OverflowError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by (thin) servicers into gRPC statuses with a clear message."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except Exception as e:  # noqa: BLE001
                    await _abort(context, method, e)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for msg in inner_stream(request, context):
                        yield msg
                except Exception as e:  # noqa: BLE001
                    await _abort(context, method, e)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer)
        return handler


async def _abort(context, method: str, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, msg = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.info("%s -> %s: %s", method, code.name, msg)
    await context.abort(code, msg)


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def build_server(max_message_bytes: int) -> grpc.aio.Server:
    return grpc.aio.server(interceptors=[ErrorMappingInterceptor()], options=server_options(max_message_bytes))


async def add_health_and_reflection(server: grpc.aio.Server,
                                    service_names: Sequence[str]) -> health_aio.HealthServicer:
    """Register grpc.health.v1 (SERVING for each service and for "") and server reflection."""
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    return servicer


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind an insecure port (0 picks a free one); returns the bound port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC server to {host}:{port}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s:%d (not loopback): anyone who can reach it can use it", host, bound)
    return bound


async def start_and_wait(server: grpc.aio.Server, service_names: Sequence[str], role: str, host: str,
                         port: int, metrics=None, metrics_port: int | None = None) -> int:
    """Register health + reflection, bind, start, print the "ready on HOST:PORT" line the launcher and
    tests wait for, then block until SIGINT/SIGTERM and stop the server gracefully. Returns the port."""
    if metrics is not None and metrics_port is not None:
        metrics.serve_http(metrics_port, host)
    await add_health_and_reflection(server, service_names)
    bound = bind(server, host, port)
    await server.start()
    print(f"{role} service ready on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    return bound
