"""The typed failure path's two tables: every engine FailureKind becomes one service error (a gRPC status,
svc_common/errors.py), every gRPC status one HTTP answer (router/generation.py), and every engine FinishReason a
decode stream sends one proto enum value. Nothing on the way reads a message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from decode_svc.worker import FINISH_REASONS
from engine.outcome import (
    EngineRefusal,
    Failure,
    FailureKind,
    FinishReason,
    QueueFull,
    RequestRejected,
    failure_of,
)
from nvfp4_serve_proto import decode_pb2
from router.generation import GRPC_ANSWERS, OTHER_STATUS, map_grpc_error
from svc_common.errors import FAILURE_ERRORS, ServiceError, service_error
from svc_common.grpc_server import status_for

ROOT = Path(__file__).resolve().parents[1]


def _status(kind: FailureKind) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, service_error(Failure(kind, "m")).status_name)


def _http(code: grpc.StatusCode, details: str = "the worker's words"):
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    return map_grpc_error(exc, "127.0.0.1:5000")


def test_every_failure_kind_has_one_service_error_with_a_real_status():
    assert set(FAILURE_ERRORS) == set(FailureKind)
    for kind in FailureKind:
        err = service_error(Failure(kind, "why"))
        assert isinstance(err, ServiceError) and "why" in str(err)
        assert isinstance(_status(kind), grpc.StatusCode)


def test_the_failure_kinds_statuses():
    assert _status(FailureKind.OVERLOADED) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _status(FailureKind.NEVER_FITS) is grpc.StatusCode.INVALID_ARGUMENT  # not the transient overload
    assert _status(FailureKind.INVALID) is grpc.StatusCode.INVALID_ARGUMENT
    assert _status(FailureKind.INTERNAL) is grpc.StatusCode.INTERNAL
    assert str(service_error(Failure(FailureKind.OVERLOADED, "waiting queue is full (1 requests)"))) == \
        "overloaded: waiting queue is full (1 requests); retry later"


@pytest.mark.parametrize("kind, http_status, retryable", [
    (FailureKind.OVERLOADED, 429, True), (FailureKind.NEVER_FITS, 400, False), (FailureKind.INVALID, 400, False),
    (FailureKind.INTERNAL, 502, False)])
def test_each_failure_kind_reaches_the_client_as_its_http_status(kind, http_status, retryable):
    failed = _http(_status(kind))
    assert (failed.error.status, failed.retryable) == (http_status, retryable)


def test_every_grpc_status_maps_to_an_http_error_and_the_details_never_decide():
    assert OTHER_STATUS.http_status >= 500 and not OTHER_STATUS.retryable
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        answers = {(f.error.status, f.kind, f.retryable) for f in (_http(code, d) for d in (
            "", "prompt of 9000 tokens can never fit in the pool", "waiting queue is full", "RequestRejected: x"))}
        assert len(answers) == 1, (code, answers)
        (status, _, _), = answers
        assert 400 <= status < 600
        assert (code in GRPC_ANSWERS) or status == OTHER_STATUS.http_status


def test_engine_refusals_carry_their_failure_to_the_status():
    assert status_for(RequestRejected("prompt of 300 tokens does not fit"))[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(RequestRejected("the prompt is empty", FailureKind.INVALID))[0] is \
        grpc.StatusCode.INVALID_ARGUMENT
    code, msg = status_for(QueueFull("waiting queue is full (1 requests)"))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and msg.endswith("; retry later")
    assert failure_of(QueueFull("q")).kind is FailureKind.OVERLOADED
    boom = failure_of(KeyError("x"), "engine error: ")
    assert boom == Failure(FailureKind.INTERNAL, "engine error: KeyError: 'x'")
    assert isinstance(RequestRejected("x"), (EngineRefusal, ValueError))


def test_every_finish_reason_a_decode_streams_has_its_proto_value():
    assert set(FINISH_REASONS) == set(FinishReason) - {FinishReason.PREFILLED}  # a prefill's, never streamed
    values = list(FINISH_REASONS.values())
    assert len(set(values)) == len(values) and decode_pb2.FINISH_REASON_UNSPECIFIED not in values
    assert decode_pb2.FinishReason.Name(FINISH_REASONS[FinishReason.LENGTH]) == "FINISH_REASON_LENGTH"


def test_the_outcome_types_need_no_torch():
    code = "import sys, engine.outcome; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, timeout=60).returncode == 0
