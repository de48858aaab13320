"""The deployment's service token on every gRPC link: ``nvfp4-serve up --api-key KEY`` (plaintext gRPC) serves
the API with the key, every internal call carries it, and a caller on the same host without it gets
UNAUTHENTICATED from every RPC of the decode and prefill services but the standard health check."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.service_procs import Launched

API_KEY = "sk-token-test-91a7"


@pytest.fixture(scope="module")
def deployment(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--page-size", "4", "--api-key", API_KEY)
    yield d
    d.stop()


def _decode_calls(stub: decode_pb2_grpc.DecodeStub) -> dict:
    gen = decode_pb2.GenerateRequest(request_id="intruder", token_ids=[1, 2, 3, 4, 5],
                                     sampling=common_pb2.SamplingParams(max_tokens=4))
    return {
        "Generate": lambda md: _drain(stub.Generate(gen, metadata=md, timeout=10)),
        "GetLoad": lambda md: stub.GetLoad(common_pb2.GetLoadRequest(), metadata=md, timeout=10),
        "FlushCache": lambda md: stub.FlushCache(decode_pb2.FlushCacheRequest(), metadata=md, timeout=10),
        "CheckIntegrity": lambda md: stub.CheckIntegrity(decode_pb2.CheckIntegrityRequest(), metadata=md,
                                                         timeout=10),
        "GetMetrics": lambda md: stub.GetMetrics(common_pb2.MetricsRequest(), metadata=md, timeout=10),
    }


def _prefill_calls(stub: prefill_pb2_grpc.PrefillStub) -> dict:
    req = prefill_pb2.PrefillRequest(request_id="intruder", token_ids=[1, 2, 3, 4, 5],
                                     sampling=common_pb2.SamplingParams(max_tokens=1))
    return {
        "Prefill": lambda md: _drain(stub.Prefill(req, metadata=md, timeout=10)),
        "GetLoad": lambda md: stub.GetLoad(common_pb2.GetLoadRequest(), metadata=md, timeout=10),
        "GetMetrics": lambda md: stub.GetMetrics(common_pb2.MetricsRequest(), metadata=md, timeout=10),
        "GetKVShare": lambda md: stub.GetKVShare(prefill_pb2.KVShareRequest(), metadata=md, timeout=10),
        "ReleaseTransfer": lambda md: stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(transfer_id="x"),
                                                           metadata=md, timeout=10),
    }


async def _drain(call) -> list:
    return [m async for m in call]


async def _outcomes(address: str, stub_cls, calls, metadata) -> dict[str, grpc.StatusCode]:
    async with grpc.aio.insecure_channel(address) as channel:
        out = {}
        for name, call in calls(stub_cls(channel)).items():
            try:
                await call(metadata)
                out[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                out[name] = e.code()
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    assert "service token" in e.details()
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        out["Health.Check"] = health.status
        return out


def test_the_api_works_with_the_key_through_token_guarded_links(deployment):
    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model="model", prompt="def f(x):", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5  # router -> decode -> prefill, each call carrying the token
    assert "service token required" in deployment.output  # each service logs how its port is guarded


@pytest.mark.parametrize("role, stub_cls, calls", [("decode-0", decode_pb2_grpc.DecodeStub, _decode_calls),
                                                   ("prefill", prefill_pb2_grpc.PrefillStub, _prefill_calls)])
def test_a_caller_without_the_token_gets_unauthenticated_from_every_rpc_but_health(deployment, role, stub_cls,
                                                                                   calls):
    address = deployment.address(role)
    serving = health_pb2.HealthCheckResponse.SERVING
    for metadata in (None, (("authorization", "Bearer sk-token-test-91a8"),), (("authorization", API_KEY),)):
        out = asyncio.run(_outcomes(address, stub_cls, calls, metadata))
        assert out.pop("Health.Check") == serving  # open, as the router's /health
        assert set(out.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (metadata, out)
    good = asyncio.run(_outcomes(address, stub_cls, calls, (("authorization", f"Bearer {API_KEY}"),)))
    assert good["GetLoad"] == grpc.StatusCode.OK and good["GetMetrics"] == grpc.StatusCode.OK


def test_metrics_need_the_key_when_one_is_set(deployment):
    with httpx.Client(base_url=deployment.url, timeout=30) as c:
        assert c.get("/metrics").status_code == 401  # it names the services' gRPC addresses
        r = c.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and "nvfp4_router_worker_healthy" in r.text
        assert c.get("/health").status_code == 200
        info = c.get("/server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert info["config"]["service_token"] == "<set>" and API_KEY not in str(info)
