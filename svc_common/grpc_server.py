"""What every gRPC service shares: the service-token check, error -> status mapping, health checking,
reflection, TLS, metrics RPC."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.outcome import EngineRefusal
from engine.startup_error import StartupError
from svc_common.errors import ServiceError, service_error
from svc_common.service_auth import server_interceptors
from svc_common.tls import TLSConfig

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a handler's exception becomes (an engine refusal's through its typed failure)."""
    if isinstance(exc, EngineRefusal):
        exc = service_error(exc.failure)
    if isinstance(exc, ServiceError):
        return getattr(grpc.StatusCode, exc.status_name), str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class _Undecodable:
    """Stands in for a request whose bytes do not parse (gRPC would answer INTERNAL; it is the caller's fault)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, invalid UTF-8 in a string field, ...
            return _Undecodable(e)

    return deserialize


def _undecodable_status(method: str, request: _Undecodable) -> tuple[grpc.StatusCode, str]:
    why = f"{type(request.error).__name__}: {request.error}"
    return grpc.StatusCode.INVALID_ARGUMENT, f"the request to {method} is not a valid protobuf message ({why})"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by (thin) servicers into gRPC statuses with a clear message, and requests
    that do not parse into INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(*_undecodable_status(method, request))
                try:
                    return await inner(request, context)
                except Exception as e:  # noqa: BLE001
                    await _abort(context, method, e)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, _lenient(handler.request_deserializer), handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(*_undecodable_status(method, request))
                try:
                    async for msg in inner_stream(request, context):
                        yield msg
                except Exception as e:  # noqa: BLE001
                    await _abort(context, method, e)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, _lenient(handler.request_deserializer), handler.response_serializer)
        return handler


async def _abort(context, method: str, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, msg = status_for(exc)
    # Messages of expected errors are ours and carry no request content; an unexpected exception's text
    # might, so above debug level only its type is logged.
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed with %s (traceback at debug level)", method, type(exc).__name__)
        log.debug("%s failed", method, exc_info=exc)
    else:
        log.info("%s -> %s: %s", method, code.name, msg)
    await context.abort(code, msg)


# The largest HTTP/2 frame this end accepts (the protocol's maximum, 2^24 - 1; gRPC's default is 16 KiB). A
# sender frames each message in frames up to the size its peer announced: a 4 MiB KV page message is then one
# frame instead of 256, and raw grpcio's single stream on one H200 host carries 3.4 GB/s instead of 2.6
# (docs/benchmarks/transfer.md's anchors). Only the receiver's memory per frame grows, within the message bound.
HTTP2_MAX_FRAME_BYTES = (1 << 24) - 1


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The options of every server of the services, and of the decode's channels to its prefills."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.http2.max_frame_size", HTTP2_MAX_FRAME_BYTES)]


def build_server(max_message_bytes: int, tls: TLSConfig | None = None) -> grpc.aio.Server:
    """A grpc.aio server that requires ``tls.service_token`` on every call but the health check (when set) and
    maps handler exceptions to statuses."""
    token = tls.service_token if tls is not None else ""
    # so_reuseport off: a second service started on a taken port fails to bind instead of silently taking
    # half of the first one's connections.
    return grpc.aio.server(interceptors=[*server_interceptors(token), ErrorMappingInterceptor()],
                           options=[*server_options(max_message_bytes), ("grpc.so_reuseport", 0)])


async def add_health_and_reflection(server: grpc.aio.Server,
                                    service_names: Sequence[str]) -> health_aio.HealthServicer:
    """Register grpc.health.v1 (SERVING for each service and for "") and server reflection."""
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
             REFLECTION_V1)
    reflection.enable_server_reflection(names, server)
    _add_reflection_v1(server, names)
    return servicer


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection_v1(server: grpc.aio.Server, names: Sequence[str]) -> None:
    """grpc.reflection.v1 beside v1alpha (grpcio-reflection serves only v1alpha; newer grpcurl and Postman ask
    v1 first). The two protocols' messages are field for field the same, so v1alpha's servicer answers v1
    calls through a handler registered under the v1 name."""
    from grpc_reflection.v1alpha import _async, reflection_pb2

    impl = _async.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        impl.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1,
                                                                           {"ServerReflectionInfo": handler}),))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_port(host: str, port: int) -> None:
    """StartupError (one line naming the flag) where ``host:port`` cannot be listened on: checked with a plain
    socket before gRPC binds, so a taken port is one clear line rather than gRPC's own log of the failed bind.
    Port 0 (any free one) passes."""
    taken = _taken(host, port)
    if taken:
        raise StartupError(f"cannot listen on {host}:{port}: {taken}; pass another --port (0 picks a free one)")


def _taken(host: str, port: int) -> str:
    if port == 0:
        return ""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no owner
            probe.bind(addr)
    except OSError as e:
        return "the port is taken (another service on it?)" if e.errno == errno.EADDRINUSE else str(e)
    return ""


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSConfig | None = None) -> int:
    """Bind a port (0 picks a free one), secure when ``tls`` is enabled; returns the bound port."""
    tls = tls or TLSConfig()
    address = f"{host}:{port}"
    check_port(host, port)
    try:
        bound = server.add_secure_port(address, tls.server_credentials()) if tls.enabled else \
            server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise StartupError(f"cannot listen on {address}: the port is taken (another service on it?) or the address "
                           "is not this host's; pass another --port (0 picks a free one) or --host")
    if host in LOOPBACK:
        log.info("gRPC on %s:%d (%s), loopback only: pass --host 0.0.0.0 to serve other hosts", host, bound,
                 tls.describe())
    else:
        open_to_all = not tls.mutual and not tls.service_token
        log.warning("gRPC on %s:%d (%s), NOT loopback%s", host, bound, tls.describe(),
                    ": anyone who can reach it can use it (--service-token or --tls-cert/--tls-key/--tls-ca "
                    "authenticate callers)" if open_to_all else "")
    return bound


async def start_and_wait(server: grpc.aio.Server, service_names: Sequence[str], role: str, host: str,
                         port: int, metrics=None, metrics_port: int | None = None,
                         tls: TLSConfig | None = None, alive: Callable[[], bool] | None = None, *,
                         unix_path: str | None = None, dead: Callable[[], str] | None = None,
                         on_started: Callable[[], None] | None = None) -> int:
    """Register health + reflection, bind, start, print the "ready on HOST:PORT" line the launcher and
    tests wait for, then block until SIGINT/SIGTERM and stop the server gracefully. Returns the port.

    ``unix_path``: listen on that Unix socket instead (plaintext, no ready line: a link inside one service,
    reachable by its user only through the socket's directory); returns 0. ``on_started`` runs once the
    server accepts calls, before ``alive`` is first polled.

    ``alive`` (the engine loop's liveness) is polled: when it turns False the service reports NOT_SERVING,
    drops its streams and raises, so the process exits non-zero instead of hanging every request; ``dead``
    says what died (default: the engine loop thread)."""
    if metrics is not None and metrics_port is not None:
        metrics.serve_http(metrics_port, host)
    health = await add_health_and_reflection(server, service_names)
    if unix_path is not None:
        if server.add_insecure_port(f"unix:{unix_path}") == 0:
            raise RuntimeError(f"cannot bind gRPC server to unix:{unix_path}")
        bound = 0
        await server.start()
    else:
        bound = bind(server, host, port, tls)
        await server.start()
        print(f"{role} service ready on {host}:{bound}", flush=True)
    if on_started is not None:
        on_started()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    watchdog = asyncio.ensure_future(_watch(alive, stop)) if alive is not None else None
    await stop.wait()
    if watchdog is not None and watchdog.done() and watchdog.result():
        what = dead() if dead is not None else "engine loop thread died (its traceback is above)"
        log.critical("%s service: %s; exiting so that it can be restarted", role, what)
        await health.enter_graceful_shutdown()
        await server.stop(grace=0)
        raise RuntimeError(f"{role} service: {what}")
    if watchdog is not None:
        watchdog.cancel()
    await health.enter_graceful_shutdown()
    await server.stop(grace=2)
    return bound


async def _watch(alive: Callable[[], bool], stop: asyncio.Event, interval_s: float = 0.5) -> bool:
    """Set ``stop`` and return True as soon as ``alive()`` is False."""
    while not stop.is_set():
        if not alive():
            stop.set()
            return True
        await asyncio.sleep(interval_s)
    return False
