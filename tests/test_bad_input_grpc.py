"""Malformed and hostile gRPC requests (the HTTP side is tests/test_router_http.py): each gets the right status
and a message that says what is wrong, and the service then serves the next valid request.

The services run a model with a 256-token context; the decode pool holds 128 tokens (32 pages of 4, so the
extend workspace is 128 tokens) and both services accept messages up to 1 MiB.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.service_procs import start_many

MAX_MESSAGE = 1 << 20
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
GENERATE, PREFILL = "/nvfp4serve.v1.Decode/Generate", "/nvfp4serve.v1.Prefill/Prefill"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    from offline.tiny_model import make_tiny_model

    model = str(make_tiny_model(tmp_path_factory.mktemp("ctx256") / "model", max_position_embeddings=256))
    common = ("--model", model, "--device", "cpu", "--dtype", "float32", "--page-size", "4",
              "--max-message-bytes", str(MAX_MESSAGE))
    from nvfp4_serve.launcher import free_port

    # The decode's deployment names, besides its real prefill, an address nobody listens on and the decode's
    # own: misconfigured peers it must survive.
    pport, dport, closed = free_port(), free_port(), f"127.0.0.1:{free_port()}"
    prefill, decode = start_many([
        ("prefill_svc", *common, "--port", str(pport)),
        ("decode_svc", *common, "--max-total-tokens", "128", "--port", str(dport), "--prefill-addresses",
         f"127.0.0.1:{pport}", closed, f"127.0.0.1:{dport}")])
    yield {"prefill": prefill, "decode": decode, "closed": closed}
    prefill.stop()
    decode.stop()


def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 2, **kw})


def gen(ids=(5, 6, 7, 8, 9), rid: str = "r", prefill: str = "", **sp) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(request_id=rid, token_ids=list(ids), sampling=sampling(**sp),
                                      prefill_address=prefill)


def pre(ids=(5, 6, 7, 8, 9), rid: str = "p", prefix_len: int = 0, layout=None, **sp) -> prefill_pb2.PrefillRequest:
    req = prefill_pb2.PrefillRequest(request_id=rid, token_ids=list(ids), prefix_len=prefix_len,
                                     sampling=sampling(**sp))
    if layout is not None:
        req.expected_layout.CopyFrom(layout)
    return req


def other_layout(ctx: dict, **changes) -> common_pb2.KVLayout:
    layout = common_pb2.KVLayout()
    layout.CopyFrom(ctx["layout"])
    for k, v in changes.items():
        setattr(layout, k, v)
    return layout


@dataclass(frozen=True)
class Case:
    name: str
    method: str  # full gRPC method path
    build: Callable[[dict], Any]  # ctx -> a message or raw bytes
    code: grpc.StatusCode
    fragment: str
    stream: bool = True


CASES = [
    # Decode.Generate: ids, request ids, sampling, sizes
    Case("empty prompt", GENERATE, lambda c: gen(ids=[]), INVALID, "token_ids is empty"),
    Case("token id = vocab size", GENERATE, lambda c: gen(ids=[5, 512]), INVALID, "outside the vocabulary [0, 512)"),
    Case("token id 2**31-1", GENERATE, lambda c: gen(ids=[2**31 - 1]), INVALID, "outside the vocabulary"),
    Case("negative token id", GENERATE, lambda c: gen(ids=[5, -1]), INVALID, "e.g. -1"),
    Case("empty request id", GENERATE, lambda c: gen(rid=""), INVALID, "request_id is empty"),
    Case("10k-character request id", GENERATE, lambda c: gen(rid="x" * 10_000), INVALID,
         "request_id has 10000 characters, the limit is 256"),
    Case("request id with a newline", GENERATE, lambda c: gen(rid="a\nfake log line"), INVALID, "non-printable"),
    Case("negative temperature", GENERATE, lambda c: gen(temperature=-1.0), INVALID, "temperature must be in [0, 2]"),
    Case("temperature 5", GENERATE, lambda c: gen(temperature=5.0), INVALID, "temperature must be in [0, 2]"),
    Case("NaN temperature", GENERATE, lambda c: gen(temperature=float("nan")), INVALID, "finite number"),
    Case("top_p 1.5", GENERATE, lambda c: gen(top_p=1.5), INVALID, "top_p must be in (0, 1]"),
    Case("negative min_p", GENERATE, lambda c: gen(min_p=-0.5), INVALID, "min_p must be in [0, 1]"),
    Case("negative max_tokens", GENERATE, lambda c: gen(max_tokens=-5), INVALID, "max_tokens must be >= 0 (0: the rest of the context)"),
    Case("negative stop token", GENERATE, lambda c: gen(stop_token_ids=[-3]), INVALID, "non-negative"),
    Case("stop token out of vocabulary", GENERATE, lambda c: gen(stop_token_ids=[100_000]), INVALID,
         "stop_token_ids has ids outside the vocabulary"),
    Case("prompt longer than the context", GENERATE, lambda c: gen(ids=[7] * 300), INVALID,
         "does not fit the model context of 256 tokens"),
    Case("prompt longer than the workspace", GENERATE, lambda c: gen(ids=[7] * 200), INVALID,
         "exceeds the extend workspace of 128 tokens"),
    Case("prompt as large as the pool", GENERATE, lambda c: gen(ids=[7] * 128), INVALID,
         "needs 33 pages, the KV pool holds 32 pages"),
    Case("prefill address not host:port", GENERATE, lambda c: gen(prefill="not an address"), INVALID,
         "is not host:port"),
    # (prompts nothing else sends: a cached prompt runs locally and would never reach the prefill address)
    Case("prefill address outside the deployment", GENERATE, lambda c: gen(prefill=c["stranger"]),
         grpc.StatusCode.PERMISSION_DENIED, "is not a prefill service of this deployment"),
    Case("prefill port out of range", GENERATE, lambda c: gen(prefill="127.0.0.1:99999"), INVALID,
         "with a port in 1..65535"),
    Case("prefill address nobody listens on", GENERATE, lambda c: gen(ids=[40, 41, 42, 43, 44], prefill=c["closed"]),
         grpc.StatusCode.UNAVAILABLE, "failed: UNAVAILABLE"),
    Case("prefill address of a decode service", GENERATE,
         lambda c: gen(ids=[50, 51, 52, 53, 54], prefill=c["decode"]),
         grpc.StatusCode.UNAVAILABLE, "UNIMPLEMENTED"),
    Case("bytes that are no protobuf", GENERATE, lambda c: b"\xff\xff\xff\xff garbage", INVALID,
         "not a valid protobuf message"),
    Case("request id that is invalid UTF-8", GENERATE, lambda c: b"\x0a\x02\xff\xfe\x12\x01\x05", INVALID,
         "not a valid protobuf message"),
    Case("message over the size limit", GENERATE, lambda c: gen(ids=[300] * 600_000), EXHAUSTED,
         "larger than max"),
    Case("GetLoad with garbage", "/nvfp4serve.v1.Decode/GetLoad", lambda c: b"\x08", INVALID,
         "not a valid protobuf message", stream=False),
    Case("CheckIntegrity with garbage", "/nvfp4serve.v1.Decode/CheckIntegrity", lambda c: b"\xff", INVALID,
         "not a valid protobuf message", stream=False),
    Case("unknown method", "/nvfp4serve.v1.Decode/DropAllTables", lambda c: b"", grpc.StatusCode.UNIMPLEMENTED,
         "", stream=False),
    # Prefill.Prefill: what a broken or hostile decode service could send
    Case("prefill: empty request id", PREFILL, lambda c: pre(rid=""), INVALID, "request_id is empty"),
    Case("prefill: token out of vocabulary", PREFILL, lambda c: pre(ids=[5, 9999]), INVALID, "outside the vocabulary"),
    Case("prefill: prefix_len not page aligned", PREFILL, lambda c: pre(prefix_len=3), INVALID,
         "prefix_len 3 must be a multiple of the page size 4"),
    Case("prefill: prefix_len past the prompt", PREFILL, lambda c: pre(prefix_len=40), INVALID,
         "within the prompt of 5 tokens"),
    Case("prefill: negative prefix_len", PREFILL, lambda c: pre(prefix_len=-4), INVALID, "prefix_len -4"),
    Case("prefill: other kv dtype", PREFILL, lambda c: pre(layout=other_layout(c, kv_dtype="fp8_e4m3")),
         grpc.StatusCode.FAILED_PRECONDITION, "kv_dtype: prefill has 'nvfp4', decode has 'fp8_e4m3'"),
    Case("prefill: other model", PREFILL, lambda c: pre(layout=other_layout(c, model_fingerprint="other")),
         grpc.StatusCode.FAILED_PRECONDITION, "model_fingerprint"),
    Case("prefill: prompt longer than the context", PREFILL, lambda c: pre(ids=[7] * 300), INVALID,
         "does not fit the model context"),
    Case("prefill: NaN temperature", PREFILL, lambda c: pre(temperature=float("nan")), INVALID, "finite number"),
    Case("prefill: message over the size limit", PREFILL, lambda c: pre(ids=[300] * 600_000), EXHAUSTED,
         "larger than max"),
    Case("prefill: bytes that are no protobuf", PREFILL, lambda c: b"\x12\xff\xff\xff", INVALID,
         "not a valid protobuf message"),
]


def _raw(x: Any) -> bytes:
    return x if isinstance(x, bytes) else x.SerializeToString()


async def call(address: str, case: Case, ctx: dict) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            if case.stream:
                rpc = ch.unary_stream(case.method, request_serializer=_raw, response_deserializer=lambda b: b)
                async for _ in rpc(case.build(ctx), timeout=30):
                    pass
            else:
                rpc = ch.unary_unary(case.method, request_serializer=_raw, response_deserializer=lambda b: b)
                await rpc(case.build(ctx), timeout=30)
        except grpc.aio.AioRpcError as e:
            return e
    return None


async def still_serves(services) -> None:
    async with grpc.aio.insecure_channel(services["decode"].address) as ch:
        msgs = [m async for m in decode_pb2_grpc.DecodeStub(ch).Generate(gen(rid="valid", ignore_eos=True), timeout=30)]
    assert sum(len(m.token_ids) for m in msgs) == 2 and msgs[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH
    async with grpc.aio.insecure_channel(services["prefill"].address) as ch:
        kinds = [m.WhichOneof("payload") async for m in prefill_pb2_grpc.PrefillStub(ch).Prefill(pre(rid="ok"))]
    assert kinds[0] == "header" and kinds[-1] == "done"


@pytest.fixture(scope="module")
def ctx(services):
    from nvfp4_serve.launcher import free_port

    async def layout():
        async with grpc.aio.insecure_channel(services["prefill"].address) as ch:
            return (await prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest())).layout

    return {"layout": asyncio.run(layout()), "closed": services["closed"], "decode": services["decode"].address,
            "stranger": f"127.0.0.1:{free_port()}"}


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_gets_the_right_status_and_the_service_stays_up(services, ctx, case):
    address = services["prefill" if case.method.startswith("/nvfp4serve.v1.Prefill/") else "decode"].address
    err = asyncio.run(call(address, case, ctx))
    assert err is not None, f"{case.name}: accepted"
    assert err.code() == case.code, (case.name, err.code(), err.details())
    assert case.fragment in (err.details() or ""), (case.name, err.details())
    asyncio.run(still_serves(services))


def test_huge_max_tokens_is_clamped_to_the_pool_and_ends_with_length(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            return [m async for m in decode_pb2_grpc.DecodeStub(ch).Generate(
                gen(ids=[7] * 100, rid="huge", max_tokens=2**31 - 1, ignore_eos=True), timeout=60)]

    msgs = asyncio.run(scenario())
    assert msgs[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH and msgs[-1].completion_tokens == 128 - 100


def test_a_request_id_already_in_flight_is_refused_and_the_first_is_untouched(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            first = stub.Generate(gen(ids=[9] * 10, rid="twin", max_tokens=30, ignore_eos=True))
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(gen(rid="twin")):
                    pass
            rest = []
            while (m := await first.read()) is not grpc.aio.EOF:
                rest.append(m)
            return e.value, rest

    err, rest = asyncio.run(scenario())
    assert err.code() == INVALID and "already in flight" in err.details()
    assert rest[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH and rest[-1].completion_tokens == 30


def test_after_all_bad_requests_the_decode_pool_is_intact(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services["decode"].address) as ch:
            return await decode_pb2_grpc.DecodeStub(ch).CheckIntegrity(decode_pb2.CheckIntegrityRequest())

    rep = asyncio.run(scenario())
    assert rep.ok and rep.num_in_use == 0
