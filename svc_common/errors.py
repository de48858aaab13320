"""Service-level errors and the gRPC status each maps to (the engine itself never imports grpc)."""

from __future__ import annotations

MAX_REQUEST_ID_LEN = 256


class ServiceError(Exception):
    """Base: the message is what the client sees."""

    status_name = "INTERNAL"


class InvalidRequest(ServiceError):
    status_name = "INVALID_ARGUMENT"


class LayoutMismatch(ServiceError):
    """Prefill and decode disagree on the KV layout (dtype, page size, geometry, scales, model)."""

    status_name = "FAILED_PRECONDITION"


class UntrustedPeer(ServiceError):
    """A request names a peer (a prefill address) that this deployment does not list."""

    status_name = "PERMISSION_DENIED"


class Overloaded(ServiceError):
    status_name = "RESOURCE_EXHAUSTED"


class PrefillUnavailable(ServiceError):
    """The prefill stream failed or ended early; the decode side freed everything it held."""

    status_name = "UNAVAILABLE"


class TransferTimeout(ServiceError):
    status_name = "DEADLINE_EXCEEDED"


def check_request_id(rid: str) -> str:
    """A request id must be non-empty, at most MAX_REQUEST_ID_LEN characters and printable (it appears in
    log lines and error messages)."""
    if not rid:
        raise InvalidRequest("request_id is empty")
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"request_id has {len(rid)} characters, the limit is {MAX_REQUEST_ID_LEN}")
    if not rid.isprintable():
        raise InvalidRequest("request_id has non-printable characters")
    return rid


def engine_error(message: str) -> ServiceError:
    """The service error of a failure the engine loop reports as ``"<ExceptionType>: <message>"``
    (engine/engine_loop.py: a submit that fails on the loop thread reaches the caller only as text)."""
    kind, _, _ = message.partition(":")
    if kind == "OverflowError":  # the scheduler's waiting queue is full
        return Overloaded(f"overloaded: {message.partition(': ')[2]}; retry later")
    if kind == "RequestRejected":
        return InvalidRequest(message.partition(": ")[2])
    return ServiceError(message)
