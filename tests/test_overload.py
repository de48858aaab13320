"""Overload never means an unbounded wait or a crash: every queue is bounded and beyond it the answer is
immediate (gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After) or comes at the queue deadline (HTTP 503 with
Retry-After); afterwards nothing is leaked and the next request is served.

    router: max_concurrent_requests slots + max_queued_requests waiters (queue_timeout_s) -> 429 / 503
    decode: max_running_requests admitted + max_waiting_requests queued -> RESOURCE_EXHAUSTED -> router 429

The decode runs one request at a time with a queue of one, and stalls its engine loop 0.3 s after each token
(--debug-token-delay-s) so that requests stay in flight while the test fills the queues.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc
from tests.service_procs import start_many, start_router


@pytest.fixture(scope="module")
def decode(tiny_model_dir):
    (proc,) = start_many([("decode_svc", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32",
                           "--page-size", "4", "--max-running-requests", "1", "--max-waiting-requests", "1",
                           "--debug-token-delay-s", "0.3")])
    yield proc
    proc.stop()


def gen(rid: str) -> decode_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    return decode_pb2.GenerateRequest(request_id=rid, token_ids=[5, 6, 7, 8, 9, 10], sampling=sp)


async def wait_load(stub, num_running: int, num_waiting: int) -> None:
    for _ in range(200):
        load = await stub.GetLoad(common_pb2.GetLoadRequest())
        if (load.num_running, load.num_waiting) == (num_running, num_waiting):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"load never reached {num_running} running / {num_waiting} waiting: {load}")


async def wait_idle(address: str) -> decode_pb2.IntegrityReport:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for _ in range(100):
            rep = await stub.CheckIntegrity(decode_pb2.CheckIntegrityRequest())
            if rep.num_in_use == 0 and (await stub.GetLoad(common_pb2.GetLoadRequest())).num_waiting == 0:
                return rep
            await asyncio.sleep(0.1)
    return rep


def test_decode_queue_is_bounded_beyond_it_resource_exhausted_at_once(decode):
    async def scenario():
        async with grpc.aio.insecure_channel(decode.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            running = stub.Generate(gen("running"))
            await running.read()
            queued = stub.Generate(gen("queued"))
            await wait_load(stub, 1, 1)
            t0 = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(gen("one-too-many")):
                    pass
            elapsed = time.perf_counter() - t0
            running.cancel()
            queued.cancel()
        return e.value, elapsed, await wait_idle(decode.address)

    err, elapsed, rep = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting queue is full (1 requests); retry later" in err.details()
    assert elapsed < 1.0
    assert rep.ok and rep.num_in_use == 0


def _assert_overloaded(resp: httpx.Response, status: int, fragment: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["retry-after"] == "2"
    err = resp.json()["error"]
    assert err["code"] == "overloaded" and fragment in err["message"], err


async def _hold(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> None:
    """A streamed request that holds its slot until cancelled."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        started.set()
        async for _ in resp.aiter_lines():
            pass


def test_router_queue_is_bounded_429_beyond_it_503_after_its_deadline(decode, tiny_model_dir):
    router = start_router(tiny_model_dir, [decode.address], [], "--served-model-name", "tiny",
                          "--max-concurrent-requests", "2", "--max-queued-requests", "1", "--queue-timeout-s", "1",
                          "--retry-after-s", "2")
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 500, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=f"http://{router.address}", timeout=30) as c:
            first = asyncio.Event()
            holders = [asyncio.ensure_future(_hold(c, body, first))]  # slot 1: decoding
            await first.wait()
            holders.append(asyncio.ensure_future(c.post("/v1/completions", json=body)))  # slot 2: decode's queue
            await _until_metric(c, "nvfp4_router_in_flight_requests", 2)
            queued = asyncio.ensure_future(c.post("/v1/completions", json=body))  # the router's queue of one
            await _until_metric(c, "nvfp4_router_queued_requests", 1)
            t0 = time.perf_counter()
            rejected = await c.post("/v1/completions", json=body)
            rejected_after = time.perf_counter() - t0
            timed_out = await queued
            timed_out_after = time.perf_counter() - t0
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            rep = await wait_idle(decode.address)
            after = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            metrics = (await c.get("/metrics")).text
        return rejected, rejected_after, timed_out, timed_out_after, rep, after, metrics

    try:
        rejected, rejected_after, timed_out, timed_out_after, rep, after, metrics = asyncio.run(scenario())
    finally:
        router.stop()
    _assert_overloaded(rejected, 429, "2 requests running and 1 queued (limits 2 and 1)")
    assert rejected_after < 0.5
    _assert_overloaded(timed_out, 503, "timed out after 1s waiting for a free generation slot")
    assert timed_out_after < 2.0
    assert rep.ok and rep.num_in_use == 0
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
    assert 'nvfp4_router_requests_total{endpoint="/v1/completions",status="429"} 1.0' in metrics
    assert 'nvfp4_router_requests_total{endpoint="/v1/completions",status="503"} 1.0' in metrics


def test_decode_queue_full_reaches_the_client_as_429(decode, tiny_model_dir):
    router = start_router(tiny_model_dir, [decode.address], [], "--served-model-name", "tiny",
                          "--max-concurrent-requests", "8", "--retry-after-s", "2")
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 500, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=f"http://{router.address}", timeout=30) as c, \
                grpc.aio.insecure_channel(decode.address) as ch:
            first = asyncio.Event()
            holders = [asyncio.ensure_future(_hold(c, body, first))]
            await first.wait()
            holders.append(asyncio.ensure_future(c.post("/v1/completions", json=body)))
            await wait_load(decode_pb2_grpc.DecodeStub(ch), 1, 1)
            t0 = time.perf_counter()
            rejected = await c.post("/v1/completions", json=body)
            elapsed = time.perf_counter() - t0
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return rejected, elapsed, await wait_idle(decode.address), (await c.get("/metrics")).text

    try:
        rejected, elapsed, rep, metrics = asyncio.run(scenario())
    finally:
        router.stop()
    assert rejected.status_code == 429, rejected.text
    err = rejected.json()["error"]
    assert err["code"] == "overloaded" and "waiting queue is full" in err["message"]
    assert rejected.headers["retry-after"]
    assert elapsed < 1.0
    assert rep.ok and rep.num_in_use == 0
    assert 'nvfp4_router_failures_total{kind="resource_exhausted"} 1.0' in metrics


async def _until_metric(c: httpx.AsyncClient, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for ln in (await c.get("/metrics")).text.splitlines() if ln.startswith(name + " ")]
        if lines and float(lines[0].split()[1]) == value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never reached {value}: {lines}")
        await asyncio.sleep(0.05)
