"""The KV transfer path choice (gRPC bytes or CUDA IPC), the handshake's endpoint fields, the device-to-device
page copy (on CPU tensors: the same code), the share checks and the prefill's holds on source pages."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.kv_pool import KVPool
from nvfp4_serve_proto import common_pb2, prefill_pb2
from prefill_svc.kv_share import TransferHolds
from svc_common.errors import TransferTimeout
from svc_common.kv_transfer import (
    FALLBACK_REASONS,
    PATH_GRPC,
    PATH_IPC,
    TransferMetrics,
    boot_id,
    check_mode,
    local_endpoint,
    select_path,
)
from svc_common.kv_transfer_ipc import Fence, check_share, describe_tensors, pool_view
from svc_common.metrics import ServiceMetrics
from svc_common.page_import import PageImporter


def ep(boot: str = "boot-a", device: str = "cuda:GPU-1", mode: str = "auto", host: str = "h1"):
    return common_pb2.TransferEndpoint(hostname=host, boot_id=boot, device=device, kv_transfer=mode)


# -- path selection ------------------------------------------------------------------------------------------
def test_same_host_and_both_cuda_selects_cuda_ipc_whatever_the_gpus_and_hostnames():
    assert select_path(ep(), ep(device="cuda:GPU-2", host="container-2"), "decode", "prefill").path == PATH_IPC
    assert select_path(ep(mode="cuda-ipc"), ep(mode="auto"), "decode", "prefill") == (PATH_IPC, "", "")


@pytest.mark.parametrize("mine, theirs, reason, words", [
    (ep(mode="grpc"), ep(), "kv_transfer_grpc", "decode has --kv-transfer grpc"),
    (ep(), ep(mode="grpc"), "kv_transfer_grpc", "prefill has --kv-transfer grpc"),
    (ep(mode="cuda-ipc"), ep(mode="grpc"), "kv_transfer_grpc", "prefill"),
    (ep(), ep(mode=""), "no_mode", "prefill states no transfer mode"),
    (ep(), ep(boot="boot-b", host="h2"), "different_hosts", "h1 and prefill on h2"),
    (ep(boot=""), ep(boot=""), "host_unknown", "boot id"),
    (ep(device="cpu"), ep(), "not_cuda", "decode pool is on cpu"),
    (ep(), ep(device="cpu"), "not_cuda", "prefill pool is on cpu"),
    (ep(), ep(device=""), "not_cuda", "unknown device"),
])
def test_anything_else_selects_grpc_and_says_why(mine, theirs, reason, words):
    choice = select_path(mine, theirs, "decode", "prefill")
    assert choice.path == PATH_GRPC and choice.reason == reason and words in choice.detail
    assert reason in FALLBACK_REASONS
    assert select_path(theirs, mine, "prefill", "decode").path == PATH_GRPC  # symmetric


def test_this_processs_endpoint_states_host_identity_device_and_mode():
    e = local_endpoint("cpu", "cuda-ipc")
    assert e.device == "cpu" and e.kv_transfer == "cuda-ipc" and e.hostname
    assert e.boot_id == boot_id()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert e.boot_id == f.read().strip() and len(e.boot_id) == 36
    back = common_pb2.TransferEndpoint.FromString(e.SerializeToString())
    assert back == e


def test_handshake_messages_carry_the_endpoints():
    offer = prefill_pb2.TransferOffer(endpoint=ep(), ipc_share_id="s1")
    req = prefill_pb2.PrefillRequest.FromString(prefill_pb2.PrefillRequest(transfer=offer).SerializeToString())
    assert req.HasField("transfer") and req.transfer.endpoint.boot_id == "boot-a" and req.transfer.ipc_share_id == "s1"
    h = prefill_pb2.TransferHeader(path=PATH_IPC, endpoint=ep(device="cuda:GPU-2"), share_id="s1", transfer_id="t",
                                   hold_timeout_s=2.5)
    h = prefill_pb2.TransferHeader.FromString(h.SerializeToString())
    assert (h.path, h.endpoint.device, h.share_id, h.transfer_id, h.hold_timeout_s) == (
        PATH_IPC, "cuda:GPU-2", "s1", "t", 2.5)
    assert not prefill_pb2.PrefillRequest().HasField("transfer")  # older decodes: gRPC bytes


def test_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="auto, grpc, cuda-ipc"):
        check_mode("rdma")


def test_metrics_count_each_path_and_why_grpc_and_warn_once_when_ipc_was_asked_for(caplog):
    m = ServiceMetrics("decode")
    tm = TransferMetrics(m)
    ipc = select_path(ep(), ep(), "decode", "prefill")
    far = select_path(ep(mode="cuda-ipc"), ep(boot="other"), "decode", "prefill")
    with caplog.at_level("WARNING"):
        tm.count("prefill a:1", ipc, wanted=PATH_IPC)
        for _ in range(3):
            tm.count("prefill a:1", far, wanted=PATH_IPC)
        tm.count("prefill b:1", select_path(ep(device="cpu"), ep(), "decode", "prefill"), wanted="")
    text = m.text()
    assert 'nvfp4_decode_kv_transfer_path_total{path="cuda-ipc"} 1.0' in text
    assert 'nvfp4_decode_kv_transfer_path_total{path="grpc"} 4.0' in text
    assert 'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="different_hosts"} 3.0' in text
    assert 'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="not_cuda"} 1.0' in text
    warnings = [r for r in caplog.records if "falls back to gRPC" in r.getMessage()]
    assert len(warnings) == 1 and "different hosts" in warnings[0].getMessage()


# -- page copy ---------------------------------------------------------------------------------------------------
def make_pool(kv_dtype: str, num_pages: int = 12, seed: int = 0) -> KVPool:
    pool = KVPool(kv_dtype, num_layers=2, num_pages=num_pages, page_size=4, num_kv_heads=2, head_dim=32)
    g = torch.Generator().manual_seed(seed)
    for lkv in pool.layers:
        for t in (lkv.k, lkv.v, lkv.k_sf, lkv.v_sf):
            if t is not None:
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return pool


SCATTERED = ([29, 3, 17, 8, 40, 12, 33, 1, 22, 45, 6, 38, 14, 27, 19, 0, 31, 10, 43, 25],
             [4, 36, 11, 47, 20, 2, 30, 15, 42, 7, 26, 34, 9, 18, 44, 13, 39, 23, 5, 28])


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("src_pages, dst_pages", [([3, 4, 5], [7, 8, 9]), ([9, 10, 2, 6, 7], [1, 2, 3, 40, 41]),
                                                  SCATTERED], ids=["one-run", "three-runs", "scattered-gather"])
def test_copy_from_makes_destination_pages_byte_equal_to_the_source_pages(kv_dtype, src_pages, dst_pages):
    src, dst = make_pool(kv_dtype, num_pages=48, seed=1), make_pool(kv_dtype, num_pages=48, seed=2)
    untouched = [p for p in range(dst.num_pages) if p not in dst_pages]
    before = dst.export_pages(1, untouched)
    importer = PageImporter(dst)
    view = pool_view(src)
    importer.copy_from([view.layers[1].get(k) for k in ("k", "k_sf", "v", "v_sf")], 1, src_pages, dst_pages,
                       len(dst_pages) * dst.page_size)
    importer.settle()  # random bytes include NaN scales: finish() would (rightly) refuse them
    assert dst.export_pages(1, dst_pages) == src.export_pages(1, src_pages)
    assert dst.export_pages(1, untouched) == before  # and nothing else, in no other layer
    assert dst.export_pages(0, range(48)) == make_pool(kv_dtype, num_pages=48, seed=2).export_pages(0, range(48))


def test_page_runs_split_where_either_side_jumps():
    from svc_common.kv_transfer_ipc import page_runs as _runs

    assert _runs([9, 10, 2, 6, 7], [1, 2, 3, 40, 41]) == [(9, 1, 2), (2, 3, 1), (6, 40, 2)]
    assert _runs([3, 4, 5], [7, 8, 9]) == [(3, 7, 3)] and len(_runs(*SCATTERED)) == 20


def test_a_cpu_fence_is_complete_at_once():
    Fence("cpu").wait()


# -- share description -----------------------------------------------------------------------------------------
def share_of(pool: KVPool, **kw) -> prefill_pb2.KVShare:
    return prefill_pb2.KVShare(share_id="s", num_pages=kw.pop("num_pages", pool.num_pages),
                               tensors=kw.pop("tensors", describe_tensors(pool)))


def test_a_share_of_a_pool_with_the_same_page_shape_passes_whatever_its_page_count():
    mine = make_pool("nvfp4", num_pages=5)
    other = make_pool("nvfp4", num_pages=30)
    check_share(share_of(other), mine)
    assert {(t.layer, t.part) for t in share_of(other).tensors} == {
        (i, p) for i in range(2) for p in ("k", "k_sf", "v", "v_sf")}


def test_a_share_that_does_not_fit_this_pool_is_refused():
    mine = make_pool("nvfp4")
    with pytest.raises(ValueError, match="pool needs 8"):
        check_share(share_of(make_pool("fp8_e4m3")), mine)
    with pytest.raises(ValueError, match="expected uint8"):
        check_share(share_of(KVPool("nvfp4", 2, 12, 8, 2, 32)), mine)
    bad = describe_tensors(mine)
    bad[0].dtype = "float32"
    with pytest.raises(ValueError, match="float32"):
        check_share(share_of(mine, tensors=bad), mine)
    with pytest.raises(ValueError, match="0 pages"):
        check_share(share_of(mine, num_pages=0), mine)


# -- holds ---------------------------------------------------------------------------------------------------------
def test_a_hold_ends_when_released_and_its_id_works_once():
    async def scenario():
        holds = TransferHolds()
        hold = holds.open(5.0)
        waiter = asyncio.ensure_future(hold.wait_released())
        await asyncio.sleep(0)
        assert not waiter.done() and not holds.release("unknown")
        assert holds.release(hold.transfer_id)
        await waiter
        assert holds.close(hold) == "released" and len(holds) == 0
        assert not holds.release(hold.transfer_id)

    asyncio.run(scenario())


def test_a_hold_expires_at_its_deadline_and_a_closed_unreleased_hold_is_a_stream_end():
    async def scenario():
        holds = TransferHolds()
        hold = holds.open(0.05)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="within 0.05 s"):
            await hold.wait_released()
        assert time.monotonic() - t0 >= 0.04 and holds.close(hold) == "expired"
        other = holds.open(5.0)
        assert holds.close(other) == "stream_ended"
        assert len(holds.open(1.0).transfer_id) == 32 and len(holds) == 1

    asyncio.run(scenario())
