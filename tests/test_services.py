"""Prefill and decode services as real processes on free ports, driven over gRPC."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc
from tests.service_procs import start, start_many, stop_all
from tests.test_timeouts import decode_is_idle

CPU = ("--device", "cpu", "--dtype", "float32")


def run(coro):
    return asyncio.run(coro)


def gen_request(rid: str, ids: list[int], prefill: str, max_tokens: int = 6) -> decode_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return decode_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling=sp, prefill_address=prefill)


async def generate(address: str, req: decode_pb2.GenerateRequest) -> tuple[list[int], list]:
    async with grpc.aio.insecure_channel(address) as ch:
        msgs = [m async for m in decode_pb2_grpc.DecodeStub(ch).Generate(req)]
    return [t for m in msgs for t in m.token_ids], msgs


async def integrity(address: str) -> decode_pb2.IntegrityReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).CheckIntegrity(decode_pb2.CheckIntegrityRequest())


async def metric(address: str, name: str) -> float:
    async with grpc.aio.insecure_channel(address) as ch:
        text = (await decode_pb2_grpc.DecodeStub(ch).GetMetrics(common_pb2.MetricsRequest())).prometheus_text
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.fixture
def procs():
    started = []

    def _start(module: str, *args: str):
        """A service; a decode may pull from every prefill started before it (its deployment)."""
        prefills = [q.address for q in started if q.name == "prefill_svc"]
        if module == "decode_svc" and prefills:
            args = (*args, "--prefill-addresses", *prefills)
        p = start(module, *CPU, *args)
        started.append(p)
        return p

    def _many(*specs: tuple[str, ...]):
        """Services started together, ``(module, *args)`` each (their start-ups overlap); a decode may pull from
        every prefill started before it or with it."""
        prefills = tuple(q.address for q in started if q.name == "prefill_svc")
        new = start_many([(module, *CPU, *args) for module, *args in specs], prefill_addresses=prefills)
        started.extend(new)
        return new

    _start.many = _many
    yield _start
    stop_all(started)


@pytest.fixture(scope="module")
def lone_decode(tiny_model_dir):
    """A decode service without a prefill, shared by the tests that only call it (none changes what the others
    see: bad requests are refused, one request extends locally, health and reflection are read)."""
    d = start("decode_svc", *CPU, "--model", tiny_model_dir)
    yield d
    d.stop()


def prompt(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % 900 + 3 for i in range(n)]


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3"])
def test_greedy_through_the_services_equals_the_in_process_engine(procs, tiny_model_dir, kv_dtype):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    args = ("--model", tiny_model_dir, "--kv-cache-dtype", kv_dtype, "--page-size", "4")
    p, d = procs.many(("prefill_svc", *args), ("decode_svc", *args))
    ids = prompt(37)
    tokens, msgs = run(generate(d.address, gen_request("a", ids, p.address, max_tokens=10)))
    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                              cache=CacheConfig(kv_dtype=kv_dtype, page_size=4, max_total_tokens=4096)))
    ref = eng.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert tokens == ref.token_ids
    assert msgs[0].prompt_tokens == 37 and msgs[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert run(integrity(d.address)).ok


def test_mismatched_kv_dtype_or_page_size_is_refused_naming_both_values(procs, tiny_model_dir):
    p, d = procs.many(("prefill_svc", "--model", tiny_model_dir, "--kv-cache-dtype", "fp8_e4m3", "--page-size", "16"),
                      ("decode_svc", "--model", tiny_model_dir, "--kv-cache-dtype", "nvfp4", "--page-size", "8"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(generate(d.address, gen_request("m", prompt(20), p.address)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = e.value.details()
    assert "'nvfp4'" in msg and "'fp8_e4m3'" in msg and "page_size" in msg and "8" in msg and "16" in msg
    rep = run(decode_is_idle(d.address))
    assert rep.ok and rep.num_in_use == 0


def test_killing_prefill_mid_stream_fails_the_request_and_leaks_no_page(procs, tiny_model_dir):
    args = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = procs.many(("prefill_svc", *args, "--debug-transfer-delay-s", "1.0"), ("decode_svc", *args))

    async def scenario():
        task = asyncio.ensure_future(generate(d.address, gen_request("k", prompt(40), p.address)))
        await asyncio.sleep(1.5)  # header and layer 0 sent; layer 1 due at 2.0 s
        p.stop(sig_kill=True)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await task
        return e.value

    err = run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "prefill" in err.details()
    rep = run(decode_is_idle(d.address))
    assert rep.ok and rep.num_in_use == 0 and rep.num_free + rep.num_cached == rep.num_total


def test_client_disconnect_mid_stream_frees_its_pages(procs, tiny_model_dir):
    args = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = procs.many(("prefill_svc", *args), ("decode_svc", *args))

    async def scenario():
        async with grpc.aio.insecure_channel(d.address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(gen_request("c", prompt(30), p.address, max_tokens=4000))
            got = 0
            async for m in call:
                got += len(m.token_ids)
                if got >= 3:
                    call.cancel()
                    break
        for _ in range(50):  # the abort is applied by the engine loop between steps
            rep = await integrity(d.address)
            if rep.num_in_use == 0:
                return rep
            await asyncio.sleep(0.1)
        return rep

    rep = run(scenario())
    assert rep.ok and rep.num_in_use == 0


def test_bad_input_is_invalid_argument_and_the_service_stays_up(lone_decode):
    d = lone_decode
    for req, needle in [
        (decode_pb2.GenerateRequest(request_id="x", token_ids=[]), "empty"),
        (decode_pb2.GenerateRequest(request_id="x", token_ids=[1, 10**6]), "vocabulary"),
        (decode_pb2.GenerateRequest(request_id="", token_ids=[1, 2]), "request_id"),
        (decode_pb2.GenerateRequest(request_id="x", token_ids=[1, 2],
                                    sampling=common_pb2.SamplingParams(temperature=-1)), "temperature"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            run(generate(d.address, req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    tokens, _ = run(generate(d.address, gen_request("ok", prompt(9), "")))  # no prefill: local extend
    assert len(tokens) == 6


def test_health_checking_and_reflection_are_served(lone_decode):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    d = lone_decode

    async def scenario():
        async with grpc.aio.insecure_channel(d.address) as ch:
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nvfp4serve.v1.Decode"))
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for r in stream for s in r.list_services_response.service]
            # reflection v1 (what newer grpcurl asks first): the same messages under grpc.reflection.v1
            v1 = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                  request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                  response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            call = v1(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="nvfp4serve.v1.Decode")]))
            v1_files = [len(f) async for r in call for f in r.file_descriptor_response.file_descriptor_proto]
            return h.status, names, v1_files

    status, names, v1_files = run(scenario())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "nvfp4serve.v1.Decode" in names and "grpc.health.v1.Health" in names
    assert "grpc.reflection.v1.ServerReflection" in names and v1_files and all(v1_files)


def test_prefill_is_pulled_only_for_pages_past_the_cached_prefix(procs, tiny_model_dir):
    # ratio 1.0: always pull, so the second request pulls only the pages after its cached prefix
    args = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = procs.many(("prefill_svc", *args), ("decode_svc", *args, "--local-extend-min-cached-ratio", "1.0"))
    shared = prompt(40)
    run(generate(d.address, gen_request("1", shared + [11, 12], p.address, max_tokens=2)))
    before = run(metric(d.address, "nvfp4_decode_kv_transfer_bytes_total"))
    _, msgs = run(generate(d.address, gen_request("2", shared + [13, 14, 15, 16, 17], p.address, max_tokens=2)))
    after = run(metric(d.address, "nvfp4_decode_kv_transfer_bytes_total"))
    assert msgs[0].cached_tokens == 40
    per_page_all_layers = before / 11  # first request: 42 tokens = 11 pages of 4
    assert after - before == pytest.approx(per_page_all_layers * 2)  # tokens 40..44 = 2 pages
    time.sleep(0)


def test_prefill_frees_its_transient_pages_when_the_decode_side_cancels(procs, tiny_model_dir):
    from nvfp4_serve_proto import prefill_pb2_grpc

    args = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = procs.many(("prefill_svc", *args, "--debug-transfer-delay-s", "1.0"), ("decode_svc", *args))

    async def scenario():
        async with grpc.aio.insecure_channel(d.address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(gen_request("x", prompt(40), p.address))
            await asyncio.sleep(1.5)  # mid-transfer: the prefill holds the prompt's pages
            call.cancel()
        # both sides free their pages once the cancel reaches them (between engine steps; the decode's pull first
        # settles the writes it started): poll both, bounded, as a loaded machine may take a while
        async with grpc.aio.insecure_channel(p.address) as ch:
            for _ in range(100):
                load = await prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest())
                rep = await integrity(d.address)
                if load.pool_pages_in_use == 0 and load.num_running == 0 and rep.num_in_use == 0:
                    break
                await asyncio.sleep(0.1)
            return load, rep

    load, rep = run(scenario())
    assert load.pool_pages_in_use == 0 and load.num_running == 0
    assert rep.ok and rep.num_in_use == 0
