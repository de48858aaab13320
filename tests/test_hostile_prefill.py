"""A hostile or broken prefill harms only its own request: a real fake-Prefill gRPC server sends crafted
transfers to a real decode service while a legitimate request on the same decode (through the real prefill,
held mid-transfer by a gate) completes with exactly the tokens it would have produced; afterwards both pools
are whole. And a decode pulls only from the prefill services its deployment names."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2_grpc, prefill_pb2
from svc_common.kv_wire import encode_page_run
from svc_common.pool_parts import part_page_bytes
from tests.pd_harness import ChunkGate, services

PAGE, CHUNK = 4, 8


def prompt(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % 400 + 3 for i in range(n)]


def reference(model_dir: str, ids: list[int], max_tokens: int) -> list[int]:
    from engine.sampling import SamplingParams
    from tests.pd_harness import engine

    eng = engine(model_dir, page_size=PAGE, chunk_size=CHUNK)
    return eng.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


@dataclass
class Wire:
    """What a transfer of ``request`` looks like to this decode, for the cases to bend."""

    request: prefill_pb2.PrefillRequest
    layout: common_pb2.KVLayout
    page_bytes: list[int]

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def num_pages(self) -> int:
        return math.ceil(len(self.request.token_ids) / PAGE)

    def header(self, **changes) -> bytes:
        h = prefill_pb2.TransferHeader(layout=self.layout, num_tokens=len(self.request.token_ids),
                                       first_page=0, num_pages=self.num_pages, path="grpc")
        for k, v in changes.items():
            if k == "layout":
                h.layout.CopyFrom(v)
            else:
                setattr(h, k, v)
        return prefill_pb2.PrefillMessage(request_id=self.rid, header=h).SerializeToString()

    def pages(self, layer: int, first: int, n: int, fill: int = 0, rid: str | None = None,
              sizes: list[int] | None = None) -> bytes:
        sizes = sizes or [n * b for b in self.page_bytes]
        return encode_page_run(self.rid if rid is None else rid, layer, first, n,
                               [[bytes([fill]) * size] for size in sizes])

    def all_pages(self, fill: int = 0) -> list[bytes]:
        return [self.pages(layer, 0, self.num_pages, fill) for layer in range(self.layout.num_layers)]

    def done(self, first_token: int = 7) -> bytes:
        return prefill_pb2.PrefillMessage(request_id=self.rid, done=prefill_pb2.PrefillDone(
            first_token_id=first_token)).SerializeToString()


def _other_dtype(layout: common_pb2.KVLayout) -> common_pb2.KVLayout:
    other = common_pb2.KVLayout()
    other.CopyFrom(layout)
    other.kv_dtype = "fp8_e4m3"
    return other


CASES: dict[str, tuple[Callable[[Wire], list[bytes]], grpc.StatusCode, str]] = {
    "first token 99999": (lambda w: [w.header(), *w.all_pages(), w.done(99999)], grpc.StatusCode.UNAVAILABLE,
                          "outside the vocabulary"),
    "first token -1": (lambda w: [w.header(), *w.all_pages(), w.done(-1)], grpc.StatusCode.UNAVAILABLE,
                       "outside the vocabulary"),
    "every page byte 0xFF (NaN scales)": (lambda w: [w.header(), *w.all_pages(0xFF), w.done()],
                                          grpc.StatusCode.UNAVAILABLE, "NaN"),
    "a run claiming 5,000,000 pages": (lambda w: [w.header(), w.pages(0, 0, 5_000_000, sizes=[0, 0, 0, 0])],
                                       grpc.StatusCode.UNAVAILABLE, "expected the next run"),
    "a run past the announced pages": (lambda w: [w.header(), w.pages(0, 0, w.num_pages + 1)],
                                       grpc.StatusCode.UNAVAILABLE, "end by page"),
    "pages out of order": (lambda w: [w.header(), w.pages(0, 1, 2)], grpc.StatusCode.UNAVAILABLE,
                           "to start at page 0"),
    "the same pages twice": (lambda w: [w.header(), w.pages(0, 0, 2), w.pages(0, 0, 2)],
                             grpc.StatusCode.UNAVAILABLE, "to start at page 2"),
    "a layer outside the layout": (lambda w: [w.header(), w.pages(9, 0, 1)], grpc.StatusCode.UNAVAILABLE,
                                   "layer 9"),
    "pages of another request": (lambda w: [w.header(), w.pages(0, 0, 1, rid="someone-else")],
                                 grpc.StatusCode.UNAVAILABLE, "someone-else"),
    "parts of the wrong size": (lambda w: [w.header(), w.pages(0, 0, 2, sizes=[5, 5, 5, 5])],
                                grpc.StatusCode.UNAVAILABLE, "bytes"),
    "bytes that are no protobuf": (lambda w: [w.header(), b"\xff\xff\xff\xff garbage"],
                                   grpc.StatusCode.UNAVAILABLE, "undecodable"),
    "a header of another KV dtype": (lambda w: [w.header(layout=_other_dtype(w.layout))],
                                     grpc.StatusCode.FAILED_PRECONDITION, "kv_dtype"),
    "a header announcing other pages": (lambda w: [w.header(num_pages=3)], grpc.StatusCode.UNAVAILABLE,
                                        "announces"),
    "the stream ends before done": (lambda w: [w.header(), *w.all_pages()], grpc.StatusCode.UNAVAILABLE,
                                    "ended the stream"),
}


async def fake_prefill(case: Callable[[Wire], list[bytes]], wire: dict,
                       idle_lanes: bool = False) -> tuple[grpc.aio.Server, str]:
    """A Prefill server on a port of its own answering every Prefill call with ``case``'s messages (``wire`` may
    be filled in after the start, before the first call); with ``idle_lanes``, PrefillLane calls are accepted and
    send nothing (until the server stops). Returns the server and its address. It binds port 0 itself and
    refuses to share it: a port picked ahead with free_port can be handed to a real service started in between,
    and the kernel would then spread one address's connections over both servers."""

    async def prefill(request: prefill_pb2.PrefillRequest, context):
        for msg in case(Wire(request, wire["layout"], wire["page_bytes"])):
            yield msg

    async def lane(request: prefill_pb2.PrefillLaneRequest, context):
        await asyncio.sleep(60)
        yield b""

    handlers = {"Prefill": grpc.unary_stream_rpc_method_handler(
        prefill, request_deserializer=prefill_pb2.PrefillRequest.FromString, response_serializer=None)}
    if idle_lanes:
        handlers["PrefillLane"] = grpc.unary_stream_rpc_method_handler(
            lane, request_deserializer=prefill_pb2.PrefillLaneRequest.FromString, response_serializer=None)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("nvfp4serve.v1.Prefill", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _status(call) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.perf_counter()
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), time.perf_counter() - t0
    return grpc.StatusCode.OK, "", time.perf_counter() - t0


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_transfer_fails_alone_while_a_legitimate_one_completes(tiny_model_dir, name):
    case, code, fragment = CASES[name]
    legit_ids = prompt(40, offset=3)

    async def scenario():
        wire: dict = {}
        server, fake = await fake_prefill(case, wire)
        try:
            async with services(tiny_model_dir, page_size=PAGE, chunk_size=CHUNK, also_allowed=(fake,)) as s:
                wire.update(layout=s.decode.layout, page_bytes=part_page_bytes(s.decode.engine.pool))
                gate = ChunkGate(s.prefill.engine.runner, 2)  # the legitimate transfer waits mid-stream
                async with grpc.aio.insecure_channel(s.decode_address) as ch:
                    stub = decode_pb2_grpc.DecodeStub(ch)
                    legit = asyncio.ensure_future(s.generate("legit", legit_ids, 5))
                    assert await asyncio.to_thread(gate.reached.wait, 30)
                    hostile = s.request("hostile", prompt(13, offset=8), 4)
                    hostile.prefill_address = fake
                    result = await _status(stub.Generate(hostile))
                    gate.release()
                    tokens = await legit
                load, rep = await s.idle()
        finally:
            await server.stop(None)
        return result, tokens, load, rep

    (got_code, details, seconds), tokens, load, rep = asyncio.run(scenario())
    assert got_code == code and fragment in details, (got_code, details)
    assert seconds < 10  # refused as soon as the bad message arrives, nothing allocated for its claims
    assert tokens == reference(tiny_model_dir, legit_ids, 5)
    assert load.pool_pages_in_use == 0 and rep.ok and rep.num_in_use == 0


def test_a_prefill_the_deployment_does_not_name_is_never_dialled_and_cannot_poison_the_cache(tiny_model_dir):
    """The poisoning seen before: a fake prefill replaying prompt Q's pages under a Generate for prompt P. The
    decode refuses the address outright (no channel opened, even for 200 different ones), and P then gets its
    own continuation."""
    p_ids, q_ids = prompt(24, offset=1), prompt(24, offset=2)

    async def scenario():
        async with services(tiny_model_dir, page_size=PAGE, chunk_size=CHUNK) as s:
            replay = {"layout": s.decode.layout, "page_bytes": part_page_bytes(s.decode.engine.pool)}
            server, fake = await fake_prefill(lambda w: [w.header(), *w.all_pages(0x11), w.done(q_ids[3])], replay)
            try:
                async with grpc.aio.insecure_channel(s.decode_address) as ch:
                    stub = decode_pb2_grpc.DecodeStub(ch)
                    statuses = []
                    for i in range(200):
                        req = s.request(f"p{i}", p_ids, 4)
                        req.prefill_address = fake if i == 0 else f"127.0.0.1:{20000 + i}"
                        statuses.append(await _status(stub.Generate(req)))
                channels = len(s.decode.receiver.channels)
                tokens = await s.generate("p", p_ids, 6)
            finally:
                await server.stop(None)
            return statuses, channels, tokens

    statuses, channels, tokens = asyncio.run(scenario())
    assert {c for c, _, _ in statuses} == {grpc.StatusCode.PERMISSION_DENIED}
    assert "is not a prefill service of this deployment" in statuses[0][1]
    assert channels == 0
    assert tokens == reference(tiny_model_dir, p_ids, 6)
