"""Service-level errors and the gRPC status each maps to (the engine itself never imports grpc), and the one table
from the engine's typed failures (engine/outcome.py) to them."""

from __future__ import annotations

from engine.outcome import Failure, FailureKind

MAX_REQUEST_ID_LEN = 256


class ServiceError(Exception):
    """Base: the message is what the client sees."""

    status_name = "INTERNAL"


class InvalidRequest(ServiceError):
    status_name = "INVALID_ARGUMENT"


class NeverFits(InvalidRequest):
    """The request can never run with this service's configuration (context, extend workspace, pool): a client
    error, never retried, unlike Overloaded."""


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


class UnknownTransfer(ServiceError):
    """A PrefillLane request names no open transfer with lanes."""

    status_name = "NOT_FOUND"


class LaneInUse(ServiceError):
    """A PrefillLane request for a lane of a transfer that was already opened."""

    status_name = "FAILED_PRECONDITION"


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


# Every kind of engine failure -> (the service error it becomes, its message from the engine's). One entry per
# FailureKind (tests/test_failure_tables.py checks it).
FAILURE_ERRORS: dict[FailureKind, tuple[type[ServiceError], str]] = {
    FailureKind.OVERLOADED: (Overloaded, "overloaded: {}; retry later"),  # RESOURCE_EXHAUSTED: retry, elsewhere
    FailureKind.NEVER_FITS: (NeverFits, "{}"),  # INVALID_ARGUMENT: distinct from the transient overload
    FailureKind.INVALID: (InvalidRequest, "{}"),  # INVALID_ARGUMENT
    FailureKind.INTERNAL: (ServiceError, "{}"),  # INTERNAL
}


def service_error(failure: Failure) -> ServiceError:
    """The service error (and so the gRPC status) of an engine failure."""
    cls, template = FAILURE_ERRORS[failure.kind]
    return cls(template.format(failure.message))
