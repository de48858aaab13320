"""Every wait has a deadline: each one trips with a clear error and frees everything the request held.

    decode: admission -> prefill first message (header) -> between KV page messages -> between tokens
    router: first token (admission + prefill) -> between tokens      (the router's queue: test_overload.py)

Faults come from the services' test-only knobs: the prefill sleeps before its transfer header
(--debug-header-delay-s) or before each KV page message (--debug-transfer-delay-s); the decode stalls its
engine loop after each token it produces (--debug-token-delay-s). Deadlines are a fraction of the delays.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.service_procs import start_many, start_router

CPU = ("--device", "cpu", "--dtype", "float32", "--page-size", "4")
STALL_S = 2.0  # decode: engine loop stall after each token
FAULT_S = 3.0  # prefill: delay before the header / before each page message
ROUTER_HEALTH = ("--health-check-timeout-s", "5")  # a stalled engine loop answers GetLoad late, not never


@pytest.fixture(scope="module")
def services(tiny_model_dir):
    args = ("--model", tiny_model_dir, *CPU)
    procs = start_many([
        ("prefill_svc", *args, "--debug-header-delay-s", str(FAULT_S)),
        ("prefill_svc", *args, "--debug-transfer-delay-s", str(FAULT_S)),
        ("decode_svc", *args, "--admission-timeout", "0.5", "--prefill-first-message-timeout", "1",
         "--between-pages-timeout", "1", "--between-tokens-timeout", "1", "--debug-token-delay-s", str(STALL_S),
         "--max-running-requests", "1"),
    ])
    yield dict(zip(("slow_header", "slow_pages", "decode"), procs, strict=True))
    for p in procs:
        p.stop()


def prompt(first: int) -> list[int]:
    """Each test its own prompt: a prompt the decode already cached would run locally, never pulling."""
    return list(range(first, first + 25))


def request(rid: str, first: int, prefill: str = "", max_tokens: int = 50) -> decode_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return decode_pb2.GenerateRequest(request_id=rid, token_ids=prompt(first), sampling=sp, prefill_address=prefill)


async def expect_deadline(call) -> tuple[str, float, int]:
    """Read a Generate stream to its end: (details of its DEADLINE_EXCEEDED, seconds after the last message,
    messages before it)."""
    last, num = time.perf_counter(), 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            last, num = time.perf_counter(), num + 1
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
    return e.value.details(), time.perf_counter() - last, num


async def decode_is_idle(address: str) -> decode_pb2.IntegrityReport:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for _ in range(100):  # aborts are applied by the engine loop, after any stall
            rep = await stub.CheckIntegrity(decode_pb2.CheckIntegrityRequest())
            if rep.num_in_use == 0:
                break
            await asyncio.sleep(0.1)
    return rep


async def prefill_is_idle(address: str) -> common_pb2.WorkerLoad:
    async with grpc.aio.insecure_channel(address) as ch:
        for _ in range(100):
            load = await prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest())
            if load.pool_pages_in_use == 0 and load.num_running == 0:
                break
            await asyncio.sleep(0.1)
    return load


def assert_all_freed(services, *prefills: str) -> None:
    rep = asyncio.run(decode_is_idle(services["decode"].address))
    assert rep.ok and rep.num_in_use == 0 and rep.num_free + rep.num_cached == rep.num_total, rep
    for name in prefills:
        load = asyncio.run(prefill_is_idle(services[name].address))
        assert load.pool_pages_in_use == 0 and load.num_running == 0, load


def test_decode_between_tokens_deadline_fails_the_stream_and_frees_its_pages(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            return await expect_deadline(decode_pb2_grpc.DecodeStub(ch).Generate(request("tok", 5)))

    details, waited, num = asyncio.run(scenario())
    assert num == 1 and "waited more than 1 s for the next token" in details
    assert 0.9 < waited < STALL_S
    assert_all_freed(services)


def test_decode_admission_deadline_fails_a_queued_request(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            running = stub.Generate(request("holder", 40))
            await running.read()  # admitted and decoding: the only running slot is taken
            t0 = time.perf_counter()
            queued = await expect_deadline(stub.Generate(request("queued", 70)))
            elapsed = time.perf_counter() - t0
            running.cancel()
            return queued, elapsed

    (details, _, num), elapsed = asyncio.run(scenario())
    # no prefill address: the prompt would run here, so the deadline is admission (0.5) + first message (1)
    assert num == 0 and "waited more than 1.5 s for admission and the local prefill" in details
    assert 1.4 < elapsed < 2.5
    assert_all_freed(services)


def test_decode_first_message_deadline_cancels_the_prefill_which_frees_its_pages(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(request("hdr", 100, services["slow_header"].address))
            return await expect_deadline(call)

    details, waited, num = asyncio.run(scenario())
    assert num == 0 and f"prefill {services['slow_header'].address} sent no transfer header within 1 s" in details
    assert waited < FAULT_S
    assert_all_freed(services, "slow_header")


def test_decode_between_pages_deadline_cancels_the_prefill_which_frees_its_pages(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(request("pages", 130, services["slow_pages"].address))
            return await expect_deadline(call)

    details, waited, num = asyncio.run(scenario())
    assert num == 0 and "sent no next KV page message within 1 s" in details
    assert waited < FAULT_S
    assert_all_freed(services, "slow_pages")


def _assert_504(resp: httpx.Response, fragment: str) -> None:
    assert resp.status_code == 504, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert fragment in err["message"], err


def test_router_first_token_deadline_is_504_and_frees_decode_and_prefill(services, tiny_model_dir):
    router = start_router(tiny_model_dir, [services["decode"].address], [services["slow_header"].address],
                          "--served-model-name", "tiny", "--first-token-timeout-s", "0.4", *ROUTER_HEALTH)
    body = {"model": "tiny", "prompt": prompt(160), "max_tokens": 4}
    try:
        with httpx.Client(base_url=f"http://{router.address}", timeout=30) as c:
            for stream in (False, True):  # a stream fails before its first byte: the status is still 504
                t0 = time.perf_counter()
                resp = c.post("/v1/completions", json={**body, "stream": stream})
                _assert_504(resp, "sent nothing for 0.4s while waiting for the first token")
                assert time.perf_counter() - t0 < 1.0  # the router's deadline, not the decode's (1 s)
                assert_all_freed(services, "slow_header")
            metrics = c.get("/metrics").text
    finally:
        router.stop()
    assert 'nvfp4_router_failures_total{kind="timeout"} 2.0' in metrics


def test_router_inter_token_deadline_is_504_or_an_sse_error_and_frees_the_decode(services, tiny_model_dir):
    router = start_router(tiny_model_dir, [services["decode"].address], [], "--served-model-name", "tiny",
                          "--inter-token-timeout-s", "0.4", *ROUTER_HEALTH)
    body = {"model": "tiny", "prompt": prompt(200), "max_tokens": 8, "ignore_eos": True}
    try:
        with httpx.Client(base_url=f"http://{router.address}", timeout=30) as c:
            _assert_504(c.post("/v1/completions", json=body), "sent nothing for 0.4s while waiting for the next token")
            assert_all_freed(services)
            resp = c.post("/v1/completions", json={**body, "stream": True})
            assert resp.status_code == 200  # the first token was streamed: the error comes as an event
            events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert "sent nothing for 0.4s while waiting for the next token" in err["message"]
            assert_all_freed(services)
    finally:
        router.stop()
