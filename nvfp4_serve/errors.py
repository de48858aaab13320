"""Service-level errors and the gRPC status each maps to (the engine itself never imports grpc)."""

from __future__ import annotations


class ServiceError(Exception):
    """Base: the message is what the client sees."""

    status_name = "INTERNAL"


class InvalidRequest(ServiceError):
    status_name = "INVALID_ARGUMENT"


class LayoutMismatch(ServiceError):
    """Prefill and decode disagree on the KV layout (dtype, page size, geometry, scales, model)."""

    status_name = "FAILED_PRECONDITION"


class Overloaded(ServiceError):
    status_name = "RESOURCE_EXHAUSTED"


class PrefillUnavailable(ServiceError):
    """The prefill stream failed or ended early; the decode side freed everything it held."""

    status_name = "UNAVAILABLE"


class TransferTimeout(ServiceError):
    status_name = "DEADLINE_EXCEEDED"
