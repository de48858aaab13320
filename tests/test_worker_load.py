"""GetLoad answers while the engine loop is inside a long step (a first-use JIT compile takes ~25 s), so the
router keeps a busy worker healthy; a loop stalled past the limit is reported as failing (svc_common/load.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc


@pytest.fixture(scope="module")
def loop(cpu_engine_loop):
    return cpu_engine_loop


def _reporter(loop, **kw):
    from svc_common.layout import layout_of
    from svc_common.load import LoadReporter
    from svc_common.metrics import ServiceMetrics

    return LoadReporter(loop, "decode", layout_of(loop.engine), ServiceMetrics("decode"), **kw)


def test_a_busy_loop_answers_the_last_snapshot_and_a_stalled_one_fails(loop):
    from svc_common.load import EngineStalled

    rep = _reporter(loop, fresh_wait_s=0.2, max_stall_s=1.5)
    fresh = asyncio.run(rep.load())
    assert fresh.pool_pages_total == 64 and fresh.role == "decode"
    gate = threading.Event()
    blocked = loop.call(gate.wait)  # the loop is now inside one long command
    try:
        time.sleep(0.1)
        t0 = time.perf_counter()
        again = asyncio.run(rep.load())
        assert time.perf_counter() - t0 < 1.0 and again == fresh  # the last snapshot, at once
        queued = rep._pending
        asyncio.run(rep.load())
        assert rep._pending is queued  # one snapshot command queued, however often the router asks
        time.sleep(1.5)
        with pytest.raises(EngineStalled, match="busy in one step for"):
            asyncio.run(rep.load())
    finally:
        gate.set()
        blocked.result(timeout=10)
    assert asyncio.run(rep.load()).pool_pages_total == 64  # fresh again once the loop moves on


def test_before_its_first_snapshot_a_busy_loop_is_waited_for(loop):
    rep = _reporter(loop, fresh_wait_s=0.1)
    gate = threading.Event()
    blocked = loop.call(gate.wait)
    threading.Timer(0.5, gate.set).start()
    t0 = time.perf_counter()
    load = asyncio.run(rep.load())
    assert time.perf_counter() - t0 >= 0.4 and load.pool_pages_total == 64
    blocked.result(timeout=10)


def test_get_load_answers_within_the_routers_deadline_while_the_decode_loop_stalls(tiny_model_dir):
    from tests.service_procs import start

    stall_s = 3.0
    proc = start("decode_svc", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--page-size", "4",
                 "--debug-token-delay-s", str(stall_s))

    async def scenario() -> tuple[float, common_pb2.WorkerLoad]:
        async with grpc.aio.insecure_channel(proc.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)  # a first snapshot while idle
            sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            call = stub.Generate(decode_pb2.GenerateRequest(request_id="stall", token_ids=[5, 6, 7, 8, 9], sampling=sp))
            first = await call.read()  # the loop sleeps stall_s after handing this token out
            assert list(first.token_ids)
            t0 = time.perf_counter()
            load = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=2.0)  # the router's default deadline
            took = time.perf_counter() - t0
            while await call.read() != grpc.aio.EOF:
                pass
            return took, load

    try:
        took, load = asyncio.run(scenario())
    finally:
        proc.stop()
    assert took < 1.5 and load.pool_pages_total > 0
