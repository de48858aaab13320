"""The cuda-ipc transfer protocol on the CPU: control messages, copies, release, cancellation, deadlines, fallbacks.

Prefill and decode services run in this process (real gRPC servers on free ports, real engines and engine
loops). Only two things are injected: both ends' endpoints claim one host and CUDA devices, and the decode
"opens" the prefill's share as a view of the prefill's pool tensors (no CUDA IPC handles on a CPU). Everything
else (handshake, path choice, page refs, device-to-device copy on the engine thread, fences, ReleaseTransfer,
holds) is the code the GPU path runs. The last test runs real CPU service processes: they keep to gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

import grpc
import pytest

from decode_svc.config import DecodeConfig
from decode_svc.kv_ipc import PrefillShares
from decode_svc.servicer import DecodeServicer
from decode_svc.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.engine_loop import EngineLoop
from engine.sampling import SamplingParams
from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prefill_svc.kv_share import KVShareSource
from prefill_svc.servicer import PrefillServicer, add_to_server
from prefill_svc.worker import PrefillWorker
from svc_common.fault_injection import FaultInjection
from svc_common.grpc_server import build_server
from svc_common.kv_transfer_ipc import check_share, describe_tensors, pool_view
from svc_common.metrics import ServiceMetrics
from tests.service_procs import start_many

PAGE = 4
PREFILL_EP = common_pb2.TransferEndpoint(hostname="box", boot_id="boot-1", device="cuda:GPU-a", kv_transfer="cuda-ipc")
DECODE_EP = common_pb2.TransferEndpoint(hostname="box", boot_id="boot-1", device="cuda:GPU-b", kv_transfer="cuda-ipc")


def engine(model_dir: str, kv_dtype: str = "nvfp4") -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                               cache=CacheConfig(kv_dtype=kv_dtype, page_size=PAGE, max_total_tokens=2048)))


def prompt(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % 400 + 3 for i in range(n)]


@dataclass
class Pair:
    prefill: PrefillWorker
    decode: DecodeWorker
    prefill_address: str
    decode_address: str
    opened: list[str]  # share ids the decode opened

    async def generate(self, rid: str, ids: list[int], max_tokens: int = 6) -> list[int]:
        sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req = decode_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling=sp,
                                         prefill_address=self.prefill_address)
        async with grpc.aio.insecure_channel(self.decode_address) as ch:
            return [t async for m in decode_pb2_grpc.DecodeStub(ch).Generate(req) for t in m.token_ids]

    async def prefill_load(self) -> common_pb2.WorkerLoad:
        async with grpc.aio.insecure_channel(self.prefill_address) as ch:
            return await prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest())

    async def prefill_idle(self) -> common_pb2.WorkerLoad:
        for _ in range(100):  # the abort is applied by the engine loop between steps
            load = await self.prefill_load()
            if load.pool_pages_in_use == 0:
                break
            await asyncio.sleep(0.05)
        return load

    async def decode_integrity(self) -> decode_pb2.IntegrityReport:
        """The decode's pool report once no page is in use, or the last one after 5 s (the decode frees a
        request's pages between its engine steps, after the request ended or was cancelled)."""
        async with grpc.aio.insecure_channel(self.decode_address) as ch:
            for _ in range(100):
                rep = await decode_pb2_grpc.DecodeStub(ch).CheckIntegrity(decode_pb2.CheckIntegrityRequest())
                if rep.num_in_use == 0:
                    break
                await asyncio.sleep(0.05)
        return rep

    def metric(self, role: str, name: str) -> float:
        text = (self.prefill if role == "prefill" else self.decode).metrics.text()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def restart_prefill_share(self) -> None:
        """What a decode sees when the prefill process behind the address restarted: a new share id."""
        old = self.prefill.share
        self.prefill.share = KVShareSource(old.pool, old.layout, old.mode, old.hold_timeout_s,
                                           self.prefill.transfer_metrics, PREFILL_EP, describe_tensors)


@contextlib.asynccontextmanager
async def services(model_dir: str, kv_dtype: str = "nvfp4", hold_timeout_s: float = 60.0,
                   transfer_delay_s: float = 0.0, opener=None):
    pe, de = engine(model_dir, kv_dtype), engine(model_dir, kv_dtype)
    ploop, dloop = EngineLoop(pe).start(), EngineLoop(de).start()
    prefill = PrefillWorker(ploop, 16 << 20, ServiceMetrics("prefill"),
                            FaultInjection(transfer_delay_s=transfer_delay_s), "cuda-ipc", hold_timeout_s)
    prefill.share = KVShareSource(pe.pool, prefill.layout, "cuda-ipc", hold_timeout_s, prefill.transfer_metrics,
                                  PREFILL_EP, describe_tensors)  # metadata only: no handles on a CPU
    ps, ds = build_server(16 << 20), build_server(16 << 20)
    add_to_server(PrefillServicer(prefill), ps)
    pport = ps.add_insecure_port("127.0.0.1:0")
    decode = DecodeWorker(dloop, DecodeConfig(engine=de.config, kv_transfer="cuda-ipc",
                                              prefill_addresses=(f"127.0.0.1:{pport}",)), ServiceMetrics("decode"))
    opened: list[str] = []

    def open_view(share: prefill_pb2.KVShare, pool):
        check_share(share, pool)
        opened.append(share.share_id)
        return pool_view(pe.pool)  # the prefill's own tensors: what open_share maps on a GPU

    decode.receiver.shares = PrefillShares(de.pool, decode.layout, "cuda-ipc", DECODE_EP, opener or open_view)
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), ds)
    dport = ds.add_insecure_port("127.0.0.1:0")
    await ps.start()
    await ds.start()
    try:
        yield Pair(prefill, decode, f"127.0.0.1:{pport}", f"127.0.0.1:{dport}", opened)
    finally:
        await ds.stop(0)
        await ps.stop(0)
        await decode.receiver.close()
        ploop.stop()
        dloop.stop()


def reference(model_dir: str, kv_dtype: str, ids: list[int], max_tokens: int = 6) -> list[int]:
    eng = engine(model_dir, kv_dtype)
    return eng.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3"])
def test_ipc_path_greedy_equals_the_engine_and_both_sides_end_with_no_page_held(tiny_model_dir, kv_dtype):
    ids = prompt(37)

    async def scenario():
        async with services(tiny_model_dir, kv_dtype) as s:
            tokens = await s.generate("a", ids)
            tokens2 = await s.generate("b", prompt(21, offset=9))
            return s, tokens, tokens2, await s.prefill_idle(), await s.decode_integrity()

    s, tokens, tokens2, load, rep = asyncio.run(scenario())
    assert tokens == reference(tiny_model_dir, kv_dtype, ids)
    assert tokens2 == reference(tiny_model_dir, kv_dtype, prompt(21, offset=9))
    assert s.opened == [s.prefill.share.share_id]  # opened once per prefill, used by both requests
    for role in ("prefill", "decode"):
        assert s.metric(role, f'nvfp4_{role}_kv_transfer_path_total{{path="cuda-ipc"}}') == 2
        assert s.metric(role, f'nvfp4_{role}_kv_transfer_path_total{{path="grpc"}}') == 0
    assert s.metric("prefill", 'nvfp4_prefill_kv_holds_total{outcome="released"}') == 2
    assert s.metric("prefill", 'nvfp4_prefill_requests_total{outcome="ok"}') == 2
    pages = 10 + 6  # ceil(37 / 4) + ceil(21 / 4)
    expected_bytes = pages * s.decode.layout.num_layers * s.decode.engine.pool.page_bytes_per_layer
    assert s.metric("decode", "nvfp4_decode_kv_transfer_bytes_total") == expected_bytes
    assert load.pool_pages_in_use == 0 and len(s.prefill.share.holds) == 0
    assert rep.ok and rep.num_in_use == 0


def test_cancelling_mid_transfer_frees_the_prefill_pages_held_for_the_copy(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir, transfer_delay_s=0.4) as s:
            task = asyncio.ensure_future(s.generate("c", prompt(30)))
            for _ in range(100):  # wait until the header went out: the hold is open
                if len(s.prefill.share.holds):
                    break
                await asyncio.sleep(0.02)
            held = (await s.prefill_load()).pool_pages_in_use
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return s, held, await s.prefill_idle(), await s.decode_integrity()

    s, held, load, rep = asyncio.run(scenario())
    assert held > 0 and load.pool_pages_in_use == 0 and len(s.prefill.share.holds) == 0
    assert s.metric("prefill", 'nvfp4_prefill_kv_holds_total{outcome="stream_ended"}') == 1
    assert rep.ok and rep.num_in_use == 0


async def raw_ipc_prefill(s: Pair, rid: str, ids: list[int], refs_all_layers: bool = True):
    """A client that speaks the cuda-ipc protocol itself: share, offer, read up to PrefillDone
    (``refs_all_layers`` False: a decode from before KVPageRefs.num_layers)."""
    ch = grpc.aio.insecure_channel(s.prefill_address)
    stub = prefill_pb2_grpc.PrefillStub(ch)
    share = await stub.GetKVShare(prefill_pb2.KVShareRequest(endpoint=DECODE_EP))
    call = stub.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=ids, sampling=common_pb2.SamplingParams(max_tokens=1),
        transfer=prefill_pb2.TransferOffer(endpoint=DECODE_EP, ipc_share_id=share.share_id,
                                           refs_all_layers=refs_all_layers)))
    stream = call.__aiter__()
    msgs = []
    while not msgs or msgs[-1].WhichOneof("payload") != "done":
        msgs.append(await stream.__anext__())
    return ch, stub, call, stream, msgs


def test_release_frees_the_source_pages_and_ends_the_stream_ok_and_works_once(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir) as s:
            ch, stub, call, stream, msgs = await raw_ipc_prefill(s, "r", prompt(18))
            header = msgs[0].header
            kinds = [m.WhichOneof("payload") for m in msgs]
            held = (await s.prefill_load()).pool_pages_in_use
            first = await stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(transfer_id=header.transfer_id))
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            status = await call.code()
            again = await stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(transfer_id=header.transfer_id))
            load = await s.prefill_idle()
            await ch.close()
            return s, header, kinds, msgs[1].page_refs, held, first.released, status, again.released, load

    s, header, kinds, refs, held, first, status, again, load = asyncio.run(scenario())
    assert header.path == "cuda-ipc" and header.share_id and header.hold_timeout_s == 60.0
    assert kinds == ["header", "page_refs", "done"]  # one control message for every layer's pages, no bytes
    assert (refs.layer, refs.num_layers, refs.first_page, len(refs.src_page_ids)) == (0, 2, 0, 5)
    assert held == 5 and first and status == grpc.StatusCode.OK and not again  # ceil(18 / 4) pages
    assert load.pool_pages_in_use == 0
    assert s.metric("prefill", 'nvfp4_prefill_kv_holds_total{outcome="released"}') == 1


def test_an_unreleased_transfer_expires_at_the_hold_deadline_and_frees_its_pages(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir, hold_timeout_s=0.5) as s:
            ch, stub, _call, stream, msgs = await raw_ipc_prefill(s, "x", prompt(18))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stream.__anext__()
            late = await stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(
                transfer_id=msgs[0].header.transfer_id))
            load = await s.prefill_idle()
            await ch.close()
            return s, e.value, late.released, load

    s, err, late, load = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "release" in err.details()
    assert not late and load.pool_pages_in_use == 0
    assert s.metric("prefill", 'nvfp4_prefill_kv_holds_total{outcome="expired"}') == 1


def test_failure_to_open_the_share_falls_back_to_grpc_with_a_warning(tiny_model_dir, caplog):
    def broken(share, pool):
        raise RuntimeError("cudaIpcOpenMemHandle: invalid argument")

    ids = prompt(26)

    async def scenario():
        async with services(tiny_model_dir, opener=broken) as s:
            return s, await s.generate("f", ids), await s.generate("g", prompt(11, offset=9)), await s.prefill_idle()

    with caplog.at_level("WARNING"):
        s, tokens, _, load = asyncio.run(scenario())
    assert tokens == reference(tiny_model_dir, "nvfp4", ids)
    assert s.metric("decode", 'nvfp4_decode_kv_transfer_path_total{path="grpc"}') == 2
    assert s.metric("decode", 'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="open_failed"}') == 2
    assert s.metric("prefill", 'nvfp4_prefill_kv_transfer_grpc_reasons_total{reason="no_share"}') == 2
    text = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "cudaIpcOpenMemHandle: invalid argument" in text and "use gRPC" in text
    assert load.pool_pages_in_use == 0


def test_a_restarted_prefill_is_served_over_grpc_once_then_its_new_share_is_opened(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir) as s:
            await s.generate("1", prompt(13, offset=1))
            s.restart_prefill_share()
            await s.generate("2", prompt(13, offset=2))
            await s.generate("3", prompt(13, offset=3))
            return s

    s = asyncio.run(scenario())
    assert len(s.opened) == 2 and s.opened[1] == s.prefill.share.share_id != s.opened[0]
    assert s.metric("decode", 'nvfp4_decode_kv_transfer_path_total{path="cuda-ipc"}') == 2
    assert s.metric("decode", 'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="share_changed"}') == 1


def test_a_bad_transfer_mode_in_the_offer_is_invalid_argument(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir) as s, grpc.aio.insecure_channel(s.prefill_address) as ch:
            bad = prefill_pb2.TransferOffer(endpoint=common_pb2.TransferEndpoint(kv_transfer="rdma"))
            call = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="b", token_ids=[5, 6, 7], transfer=bad))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in call]
            return e.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "auto, grpc, cuda-ipc" in err.details()


def test_cpu_service_processes_asked_for_cuda_ipc_keep_to_grpc_and_say_why(tiny_model_dir):
    args = ("--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--page-size", "4",
            "--kv-transfer", "cuda-ipc")
    # started together; the decode may pull from this prefill (start_many names it in --prefill-addresses)
    p, d = start_many([("prefill_svc", *args), ("decode_svc", *args)])
    try:
        sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def scenario():
            async with grpc.aio.insecure_channel(d.address) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                req = decode_pb2.GenerateRequest(request_id="p", token_ids=prompt(22), sampling=sp,
                                                 prefill_address=p.address)
                tokens = [t async for m in stub.Generate(req) for t in m.token_ids]
                return tokens, (await stub.GetMetrics(common_pb2.MetricsRequest())).prometheus_text

        tokens, text = asyncio.run(scenario())
    finally:
        p.stop()
        d.stop()
    assert tokens == reference(tiny_model_dir, "nvfp4", prompt(22), max_tokens=4)
    assert 'nvfp4_decode_kv_transfer_path_total{path="grpc"} 1.0' in text
    assert 'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="not_cuda"} 1.0' in text
    assert "falls back to gRPC: the decode pool is on cpu" in d.output
    assert "KV transfer endpoint of this prefill" in p.output and "cpu (--kv-transfer cuda-ipc)" in p.output


def test_the_pool_is_shared_only_with_a_caller_the_path_rule_allows(tiny_model_dir):
    far_ep = common_pb2.TransferEndpoint(hostname="other", boot_id="boot-2", device="cuda:GPU-c", kv_transfer="auto")

    async def scenario():
        async with services(tiny_model_dir) as s, grpc.aio.insecure_channel(s.prefill_address) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            far = await stub.GetKVShare(prefill_pb2.KVShareRequest(endpoint=far_ep))
            anonymous = await stub.GetKVShare(prefill_pb2.KVShareRequest())
            near = await stub.GetKVShare(prefill_pb2.KVShareRequest(endpoint=DECODE_EP))
            return s, far, anonymous, near

    s, far, anonymous, near = asyncio.run(scenario())
    assert "different hosts" in far.error and not far.tensors and not far.share_id
    assert "states no transfer mode" in anonymous.error and not anonymous.tensors
    assert not near.error and near.share_id == s.prefill.share.share_id and near.endpoint == PREFILL_EP
    assert len(near.tensors) == 2 * 4 and near.num_pages == s.prefill.engine.pool.layers[0].k.shape[0]


def test_a_decode_that_does_not_read_num_layers_gets_one_refs_message_per_layer(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir) as s:
            ch, _stub, call, _stream, msgs = await raw_ipc_prefill(s, "old", prompt(18), refs_all_layers=False)
            call.cancel()
            load = await s.prefill_idle()
            await ch.close()
            return msgs, load

    msgs, load = asyncio.run(scenario())
    assert [m.WhichOneof("payload") for m in msgs] == ["header", "page_refs", "page_refs", "done"]
    refs = [m.page_refs for m in msgs[1:3]]
    assert [(r.layer, r.num_layers, r.first_page, len(r.src_page_ids)) for r in refs] == [(0, 1, 0, 5), (1, 1, 0, 5)]
    assert load.pool_pages_in_use == 0  # the cancelled stream freed its held pages
