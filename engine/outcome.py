"""How a request ends, as types: why it finished (``FinishReason``) and, when it failed, what kind of failure it
was (``Failure``). No torch, no grpc: the services map these to gRPC statuses through one table
(svc_common/errors.py), and nothing downstream reads a failure's message to tell what happened.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    """Why a request stopped producing tokens. The values are the names the APIs and metrics use."""

    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_tokens or the context
    ABORT = "abort"  # aborted or failed (a failed request's output also carries its ``Failure``)
    # A prefill-only request's prompt is computed and its first token sampled: it stays held, pages and all,
    # until its caller has exported the pages and aborts it (prefill_svc). Not the end of the request.
    PREFILLED = "prefilled"


class FailureKind(enum.Enum):
    OVERLOADED = "overloaded"  # the waiting queue is full: transient, another try (or another worker) may succeed
    NEVER_FITS = "never_fits"  # the request can never run with this configuration (context, workspace, pool)
    INVALID = "invalid"  # the engine found the input malformed (empty prompt, a request id already in use)
    INTERNAL = "internal"  # the engine failed while running the request (a step raised, a broken invariant)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str  # for people (logs, the client's error message); never parsed


class EngineRefusal(Exception):
    """An exception that carries its typed ``Failure`` (raised by submission; the message is the failure's)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RequestRejected(EngineRefusal, ValueError):
    """The request can never be served here (NEVER_FITS, the default) or is malformed (INVALID)."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.NEVER_FITS) -> None:
        super().__init__(Failure(kind, message))


class QueueFull(EngineRefusal, OverflowError):
    """The scheduler's waiting queue is full (OVERLOADED)."""

    def __init__(self, message: str) -> None:
        super().__init__(Failure(FailureKind.OVERLOADED, message))


class StepFailed(Exception):
    """A scheduler step raised (its cause is chained) after producing ``outputs``: tokens and ends of requests
    that happened before the failure, which must still reach their callers."""

    def __init__(self, outputs: list) -> None:
        super().__init__(f"engine step failed after {len(outputs)} outputs")
        self.outputs = outputs


def failure_of(exc: BaseException, prefix: str = "") -> Failure:
    """The typed failure an exception stands for: its own when it carries one, else INTERNAL with the exception's
    type and message (after ``prefix``)."""
    if isinstance(exc, EngineRefusal):
        return exc.failure
    return Failure(FailureKind.INTERNAL, f"{prefix}{type(exc).__name__}: {exc}")
