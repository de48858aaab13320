"""A grpc transfer spread over lanes (``--kv-grpc-lanes``): the layers of lane k on PrefillLane streams beside
the Prefill stream. Real prefill and decode services in this process (tests/pd_harness.py) on a 4-layer tiny
model; raw gRPC clients play a decode that opens lanes wrongly, late or never, or drops one midway."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, prefill_pb2
from tests.pd_harness import engine, services

PAGE, CHUNK = 4, 8


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory):
    from offline.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("lanes") / "model", seed=1, num_layers=4))


def prompt(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % 400 + 3 for i in range(n)]


def reference(model_dir: str, kv_dtype: str, ids: list[int], max_tokens: int) -> list[int]:
    from engine.sampling import SamplingParams

    eng = engine(model_dir, kv_dtype, PAGE, CHUNK)
    return eng.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("kv_dtype,lanes", [("nvfp4", 3), ("fp8_e4m3", 8)])
def test_pages_over_lanes_give_the_engine_greedy_tokens_and_free_everything(four_layer_model, kv_dtype, lanes):
    ids = prompt(45)  # 12 pages, 6 chunks: each lane gets page messages after every chunk

    async def scenario():
        async with services(four_layer_model, kv_dtype, PAGE, CHUNK, grpc_lanes=lanes) as pd:
            pd.prefill.pages_per_message = 1  # many messages per lane and chunk
            got = await pd.generate("lanes-1", ids, max_tokens=6)
            again = await pd.generate("lanes-2", prompt(45, offset=11), max_tokens=3)
            load, rep = await pd.idle()
            peer = pd.decode.receiver.channels._peers[pd.prefill_address]
            received = pd.decode.metrics.transfer_bytes._value.get()
            sent = pd.prefill.metrics.transfer_bytes._value.get()
            page = pd.decode.engine.pool.page_bytes_per_layer * 4  # every layer of one page
            return got, again, load, rep, len(peer.lanes), len(pd.prefill.lanes), received, sent, page

    got, again, load, rep, lane_channels, open_transfers, received, sent, page = asyncio.run(scenario())
    assert received == 2 * 12 * page  # every lane's page bytes counted (2 prompts of 12 pages)
    assert sent > received  # the prefill counts whole messages, framing included
    assert got == reference(four_layer_model, kv_dtype, ids, 6)
    assert again == reference(four_layer_model, kv_dtype, prompt(45, offset=11), 3)
    assert lane_channels == min(lanes, 4) - 1  # the prefill caps the lanes at the layer count; channels reused
    assert open_transfers == 0
    assert load.pool_pages_in_use == 0 and rep.num_in_use == 0 and rep.ok, rep.problems


async def _header(stub_call) -> tuple[prefill_pb2.TransferHeader, object]:
    it = stub_call.__aiter__()
    first = await it.__anext__()
    assert first.WhichOneof("payload") == "header"
    return first.header, it


async def _drain(it) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in it:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _raw_calls(ch: grpc.aio.Channel):
    """Prefill and PrefillLane as a raw client (a decode that may misbehave) calls them."""
    return (ch.unary_stream("/nvfp4serve.v1.Prefill/Prefill",
                            request_serializer=prefill_pb2.PrefillRequest.SerializeToString,
                            response_deserializer=prefill_pb2.PrefillMessage.FromString),
            ch.unary_stream("/nvfp4serve.v1.Prefill/PrefillLane",
                            request_serializer=prefill_pb2.PrefillLaneRequest.SerializeToString,
                            response_deserializer=prefill_pb2.PrefillMessage.FromString))


def _request(pd, rid: str, ids: list[int], lanes: int) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id=rid, token_ids=ids, expected_layout=pd.prefill.layout,
                                      sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
                                      transfer=prefill_pb2.TransferOffer(
                                          endpoint=common_pb2.TransferEndpoint(kv_transfer="grpc"), grpc_lanes=lanes))


def test_lane_requests_are_checked_and_a_lane_opens_once(four_layer_model):
    async def scenario():
        async with services(four_layer_model, "nvfp4", PAGE, CHUNK) as pd:
            pd.prefill.pages_per_message = 1  # more messages for lane 1 than its queue holds
            async with grpc.aio.insecure_channel(pd.prefill_address) as ch:
                prefill, lane = _raw_calls(ch)
                codes = {}
                for name, tid, k in [("unknown", "ab" * 16, 1), ("not an id", "../x", 1), ("empty", "", 1)]:
                    codes[name] = await _drain(lane(prefill_pb2.PrefillLaneRequest(transfer_id=tid, lane=k)))
                main = prefill(_request(pd, "hostile-lanes", prompt(30), 2))
                header, it = await _header(main)
                tid = header.transfer_id
                codes["lane 0"] = await _drain(lane(prefill_pb2.PrefillLaneRequest(transfer_id=tid, lane=0)))
                codes["lane 2 of 2"] = await _drain(lane(prefill_pb2.PrefillLaneRequest(transfer_id=tid, lane=2)))
                first = lane(prefill_pb2.PrefillLaneRequest(transfer_id=tid, lane=1)).__aiter__()
                await first.__anext__()  # lane 1 is open (and, unread, holds the transfer open)
                codes["lane 1 again"] = await _drain(lane(prefill_pb2.PrefillLaneRequest(transfer_id=tid, lane=1)))
                lane_task = asyncio.ensure_future(_drain(first))
                codes["main"] = await _drain(it)
                codes["lane 1"] = await lane_task
            load, rep = await pd.idle()
            return header, codes, load, rep, len(pd.prefill.lanes)

    header, codes, load, rep, open_transfers = asyncio.run(scenario())
    assert header.lanes == 2 and header.transfer_id
    assert codes["unknown"][0] is grpc.StatusCode.NOT_FOUND
    assert codes["not an id"][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes["empty"][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes["lane 0"][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes["lane 2 of 2"][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes["lane 1 again"][0] is grpc.StatusCode.FAILED_PRECONDITION
    assert codes["main"][0] is grpc.StatusCode.OK and codes["lane 1"][0] is grpc.StatusCode.OK  # the rest ran on
    assert open_transfers == 0 and load.pool_pages_in_use == 0 and rep.num_in_use == 0


@pytest.mark.parametrize("how", ["never opened", "cancelled midway", "main cancelled"])
def test_a_lane_that_fails_ends_the_whole_transfer_and_frees_the_pages(four_layer_model, how):
    async def scenario():
        async with services(four_layer_model, "nvfp4", PAGE, CHUNK, lane_timeout_s=0.5) as pd:
            pd.prefill.pages_per_message = 1
            async with grpc.aio.insecure_channel(pd.prefill_address) as ch:
                prefill, lane = _raw_calls(ch)
                main = prefill(_request(pd, f"lane-{how}", prompt(60), 3))
                header, it = await _header(main)
                lane_codes = []
                if how == "never opened":
                    main_code = await _drain(it)
                else:
                    calls = [lane(prefill_pb2.PrefillLaneRequest(transfer_id=header.transfer_id, lane=k))
                             for k in (1, 2)]
                    await calls[0].__aiter__().__anext__()  # one page message on lane 1
                    if how == "cancelled midway":
                        calls[0].cancel()
                        main_code = await _drain(it)
                    else:
                        main.cancel()
                        main_code = (grpc.StatusCode.CANCELLED, "")
                    lane_codes = [await _drain(c) for c in calls[1:]]
            load, _ = await pd.idle()
            return main_code, lane_codes, load, len(pd.prefill.lanes)

    main_code, lane_codes, load, open_transfers = asyncio.run(scenario())
    if how == "never opened":
        assert main_code[0] is grpc.StatusCode.DEADLINE_EXCEEDED and "never opened" in main_code[1]
    elif how == "cancelled midway":
        assert main_code[0] is grpc.StatusCode.UNAVAILABLE and "lane 1" in main_code[1]
    for code, details in lane_codes:  # the other lane learns of the failure too, with an error
        # (a lane whose call reaches the prefill only after the transfer ended finds no transfer to join)
        assert code is grpc.StatusCode.UNAVAILABLE or (
            code is grpc.StatusCode.NOT_FOUND and "no open transfer" in details), (code, details)
    assert open_transfers == 0
    assert load.pool_pages_in_use == 0


HOSTILE_LANES = {  # case -> (the fake prefill's Prefill stream, a fragment of the decode's error)
    "more lanes than offered": (lambda w: [w.header(lanes=4, transfer_id="ab" * 16)], "4 lanes"),
    "lanes without a transfer id": (lambda w: [w.header(lanes=2)], "without a transfer id"),
    "a layer on the wrong lane": (lambda w: [w.header(lanes=2, transfer_id="ab" * 16), w.pages(1, 0, 2)],
                                  "layer 1 on lane 0 of 2"),
}


@pytest.mark.parametrize("case", list(HOSTILE_LANES))
def test_a_decode_refuses_lanes_it_did_not_offer_or_pages_off_their_lane(four_layer_model, case):
    """The decode's side: each case fails its request with UNAVAILABLE and frees its pages."""
    from nvfp4_serve_proto import decode_pb2_grpc
    from svc_common.pool_parts import part_page_bytes
    from tests.test_hostile_prefill import fake_prefill

    messages, fragment = HOSTILE_LANES[case]

    async def scenario():
        wire: dict = {}
        fake, address = await fake_prefill(messages, wire, idle_lanes=True)
        try:
            async with services(four_layer_model, "nvfp4", PAGE, CHUNK, also_allowed=(address,),
                                grpc_lanes=2) as pd:
                wire.update(layout=pd.decode.layout, page_bytes=part_page_bytes(pd.decode.engine.pool))
                req = pd.request(f"hostile-{len(case)}", prompt(20), 2)
                req.prefill_address = address
                async with grpc.aio.insecure_channel(pd.decode_address) as dch:
                    code = await _drain(decode_pb2_grpc.DecodeStub(dch).Generate(req))
                await fake.stop(None)  # its idle lanes end before the pools are checked
                _, rep = await pd.idle()
        finally:
            await fake.stop(None)
        return code, rep

    (code, details), rep = asyncio.run(scenario())
    assert code is grpc.StatusCode.UNAVAILABLE and fragment in details, details
    assert rep.num_in_use == 0 and rep.ok


def test_lane_flags_and_offers_out_of_range_are_refused(four_layer_model):
    from decode_svc.config import DecodeConfig
    from engine.config import EngineConfig
    from prefill_svc.config import PrefillConfig

    for bad in (0, 9):
        with pytest.raises(ValueError, match="--kv-grpc-lanes must be in"):
            DecodeConfig(engine=EngineConfig(model_dir=four_layer_model), kv_grpc_lanes=bad)
    with pytest.raises(ValueError, match="--kv-lane-timeout must be > 0"):
        PrefillConfig(engine=EngineConfig(model_dir=four_layer_model), kv_lane_timeout_s=0)

    async def scenario():
        async with services(four_layer_model, "nvfp4", PAGE, CHUNK) as pd, \
                grpc.aio.insecure_channel(pd.prefill_address) as ch:
            prefill, _ = _raw_calls(ch)
            return await _drain(prefill(_request(pd, "negative-lanes", prompt(8), -1)))

    code, details = asyncio.run(scenario())
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "grpc_lanes must be >= 0" in details
