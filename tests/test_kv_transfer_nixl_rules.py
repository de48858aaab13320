"""The nixl path's rules that need no NIXL library: the path rule (nixl only when both ends ask for it), the
checks a decode applies to a prefill's nixl share before it addresses any remote byte, and the NaN/inf check
of pages a NIXL read wrote. They run everywhere, CI included; the transfers themselves are in
tests/test_kv_transfer_nixl.py (skipped where nixl cannot start)."""

from __future__ import annotations

import re

import pytest
import torch

from engine.kv_pool import KVPool
from nvfp4_serve_proto import common_pb2, prefill_pb2
from svc_common.kv_transfer import FALLBACK_REASONS, PATH_NIXL, select_path
from svc_common.kv_transfer_ipc import describe_tensors
from svc_common.kv_transfer_nixl import check_nixl_share
from svc_common.page_import import PageImporter


# -- path rule -----------------------------------------------------------------------------------------------
def ep(mode: str, boot: str = "boot-a", device: str = "cuda:GPU-1", host: str = "h1"):
    return common_pb2.TransferEndpoint(hostname=host, boot_id=boot, device=device, kv_transfer=mode)


@pytest.mark.parametrize("theirs", [ep("nixl"), ep("nixl", boot="boot-b", host="h2"), ep("nixl", device="cpu"),
                                    ep("nixl", boot="")])
def test_nixl_on_both_ends_selects_nixl_on_any_host_and_device(theirs):
    for mine in (ep("nixl"), ep("nixl", device="cpu", boot="boot-c")):
        assert select_path(mine, theirs, "decode", "prefill") == (PATH_NIXL, "", "")
        assert select_path(theirs, mine, "prefill", "decode").path == PATH_NIXL  # symmetric


@pytest.mark.parametrize("other", ["auto", "grpc", "cuda-ipc"])
@pytest.mark.parametrize("theirs", [ep("?"), ep("?", boot="boot-b"), ep("?", device="cpu")])
def test_nixl_on_one_end_only_keeps_the_rule_of_auto(other, theirs):
    theirs.kv_transfer = other
    for mine_mode in ("nixl", "auto"):
        assert select_path(ep(mine_mode), theirs, "decode", "prefill")[:2] == \
            select_path(ep("auto"), theirs, "decode", "prefill")[:2]
    assert select_path(ep("nixl"), ep("grpc"), "decode", "prefill").reason == "kv_transfer_grpc"
    assert "nixl_unavailable" in FALLBACK_REASONS


# -- share checks --------------------------------------------------------------------------------------------
def cpu_pool(kv_dtype: str = "nvfp4", num_pages: int = 12) -> KVPool:
    return KVPool(kv_dtype, num_layers=2, num_pages=num_pages, page_size=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def exported():
    """A nixl share of a CPU pool as a prefill exports it (NIXL's own fields stand-ins: only checked here)."""
    pool = cpu_pool()
    tensors = describe_tensors(pool)
    for st in tensors:
        t = getattr(pool.layers[st.layer], st.part)
        st.address, st.num_bytes = t.data_ptr(), t.numel() * t.element_size()
    return pool, None, prefill_pb2.KVShare(num_pages=12, tensors=tensors, nixl_metadata=b"metadata",
                                           nixl_agent="prefill-x", nixl_mem_type="DRAM")


def bent(share: prefill_pb2.KVShare, tensor: int = 0, **fields) -> prefill_pb2.KVShare:
    out = prefill_pb2.KVShare()
    out.CopyFrom(share)
    for k, v in fields.items():
        if k in ("num_pages", "nixl_mem_type", "nixl_metadata"):
            setattr(out, k, v)
        elif k == "shape":
            del out.tensors[tensor].shape[:]
            out.tensors[tensor].shape.extend(v)
        else:
            setattr(out.tensors[tensor], k, v)
    return out


def test_a_share_of_this_pools_geometry_is_accepted_with_one_region_per_tensor(exported):
    pool, _, share = exported
    layers = check_nixl_share(share, cpu_pool())
    assert len(share.tensors) == 2 * 4
    assert layers[1]["v_sf"].address == pool.layers[1].v_sf.data_ptr()
    assert layers[0]["k"].page_bytes == pool.layers[0].k[0].numel()


@pytest.mark.parametrize("change, words", [
    ({"shape": [12, 4, 2, 8]}, "expected uint8 [12, 4, 2, 16]"),  # another head_dim
    ({"num_bytes": 12 * 4 * 2 * 16 + 1}, "12 pages need"),
    ({"address": 0}, "outside the address space"),
    ({"address": (1 << 63) - 100}, "outside the address space"),
    ({"tensor": 1, "address": None}, "overlap"),  # tensor 1 starts inside tensor 0
    ({"nixl_mem_type": "HBM"}, "not DRAM or VRAM"),
    ({"nixl_metadata": b""}, "no NIXL agent metadata"),
])
def test_a_share_with_wrong_geometry_or_addresses_is_refused(exported, change, words):
    _, _, share = exported
    if change.get("address", 1) is None:
        change = {"tensor": 1, "address": share.tensors[0].address + 16}
    with pytest.raises(ValueError, match=re.escape(words)):
        check_nixl_share(bent(share, **change), cpu_pool())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_pages_written_by_a_nixl_read_are_checked_like_copies_a_nan_scale_fails_the_transfer(device):
    """On the CPU the reference check per layer; on a GPU one check launch for every layer of a run."""
    pool = KVPool("nvfp4", num_layers=2, num_pages=12, page_size=16, num_kv_heads=2, head_dim=32, device=device)
    for lkv in pool.layers:
        lkv.k_sf.view(torch.uint8).fill_(0x38)  # 1.0
        lkv.v_sf.view(torch.uint8).fill_(0x38)
    pool.layers[1].k_sf.view(torch.uint8)[5, 0] = 0x7F  # an E4M3 NaN scale in token slot 0 of page 5
    pool.layers[0].v_sf.view(torch.uint8)[7, 3] = 0xFF  # a NaN in slot 3 of page 7: past the prompt's 3 tokens
    clean = PageImporter(pool)
    assert clean._batched == (device == "cuda")  # the one-launch check where it runs
    clean.check_written([1], [3, 4], 32)
    clean.check_written([0, 1], [7], 3)
    clean.finish()  # nothing flagged
    poisoned = PageImporter(pool)
    poisoned.check_written([0, 1], [4, 5], 17)  # page 5 holds the prompt's 17th token
    with pytest.raises(ValueError, match="NaN or inf"):
        poisoned.finish()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_reads_left_to_finish_are_checked_there_in_one_check_and_only_inside_the_prompt(device, monkeypatch):
    """NIXL's reads of a transfer: their checks wait for ``finish`` and join into one (full pages and the last,
    partial one of every layer); a NaN past the prompt is never read, one inside it fails the transfer."""
    pool = KVPool("nvfp4", num_layers=2, num_pages=12, page_size=16, num_kv_heads=2, head_dim=32, device=device)
    for lkv in pool.layers:
        lkv.k_sf.view(torch.uint8).fill_(0x38)
        lkv.v_sf.view(torch.uint8).fill_(0x38)
    pool.layers[0].v_sf.view(torch.uint8)[7, 3] = 0xFF  # past the prompt: page 7 holds tokens 32..34
    calls = []

    def counting(importer):
        real = importer.check_written
        monkeypatch.setattr(importer, "check_written", lambda *a: (calls.append(a), real(*a)))
        return importer

    clean = counting(PageImporter(pool))
    clean.check_at_finish([0, 1], [3, 4], 32)  # two batches of reads, as two writer threads return them
    clean.check_at_finish([0, 1], [7], 3)
    assert calls == []  # nothing checked while the reads run
    clean.finish()
    assert [(tuple(c[0]), tuple(c[1]), c[2]) for c in calls] == [((0, 1), (3, 4, 7), 35)]  # one check, in order
    pool.layers[1].k_sf.view(torch.uint8)[7, 2] = 0x7F  # the prompt's 35th token
    poisoned = PageImporter(pool)
    poisoned.check_at_finish([0, 1], [3, 4], 32)
    poisoned.check_at_finish([0, 1], [7], 3)
    with pytest.raises(ValueError, match="NaN or inf"):
        poisoned.finish()
