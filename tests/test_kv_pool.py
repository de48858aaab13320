"""KVPool: storage layout per dtype, capacity (nvfp4 = 16/9 x fp8), slots, bit-exact page transfer."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from engine.kv_pool import KVPool, PagePayload, PoolCapacity, slots_for
from nvfp4_kernels.kv_layout import LayerKV

DTYPES = ("bf16", "fp8_e4m3", "nvfp4")
GEOM = {"num_layers": 2, "num_pages": 8, "page_size": 4, "num_kv_heads": 2, "head_dim": 32}


def pool(kv_dtype: str, **kw) -> KVPool:
    return KVPool(kv_dtype, **{**GEOM, **kw})


def fill_random(p: KVPool, seed: int, outliers: bool = False) -> None:
    """Random bytes everywhere (any bit pattern, NaN included, must survive transfer unchanged)."""
    g = torch.Generator().manual_seed(seed)
    for lkv in p.layers:
        for t in (lkv.k, lkv.v, lkv.k_sf, lkv.v_sf):
            if t is None:
                continue
            raw = t.view(torch.uint8)
            if outliers:  # mostly zero with rare extreme bytes (max-magnitude codes, NaN scales)
                vals = torch.tensor([0x00, 0x7F, 0xFF, 0x77, 0x7E], dtype=torch.uint8)
                idx = torch.randint(0, 100, raw.shape, generator=g).clamp(max=len(vals) - 1)
                raw.copy_(vals[idx])
            else:
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


# -- layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kv_dtype, dtype, last, sf",
    [("bf16", torch.bfloat16, 32, False), ("fp8_e4m3", torch.float8_e4m3fn, 32, False),
     ("nvfp4", torch.uint8, 16, True)],
)
def test_layer_storage_shapes_and_dtypes(kv_dtype, dtype, last, sf):
    p = pool(kv_dtype)
    assert len(p.layers) == 2
    for lkv in p.layers:
        assert isinstance(lkv, LayerKV)
        assert lkv.kv_dtype == kv_dtype and lkv.page_size == 4 and lkv.num_pages == 8
        for t in (lkv.k, lkv.v):
            assert t.shape == (8, 4, 2, last) and t.dtype == dtype and t.is_contiguous()
        if sf:
            for t in (lkv.k_sf, lkv.v_sf):
                assert t.shape == (8, 4, 2, 2) and t.dtype == torch.float8_e4m3fn
        else:
            assert lkv.k_sf is None and lkv.v_sf is None
    assert p.layers[0].k.data_ptr() != p.layers[1].k.data_ptr()


def test_scales_default_and_per_layer_values():
    p = pool("nvfp4", k_scales=[0.5, 2.0], v_scales=[1.5, 3.0])
    assert [(lk.k_scale, lk.v_scale, lk.ws_k_scale, lk.ws_v_scale) for lk in p.layers] == [
        (0.5, 1.5, 1.0, 1.0), (2.0, 3.0, 1.0, 1.0)]
    f = pool("fp8_e4m3", k_scales=[0.5, 2.0], v_scales=[1.5, 3.0])
    assert [(lk.ws_k_scale, lk.ws_v_scale) for lk in f.layers] == [(0.5, 1.5), (2.0, 3.0)]
    n = pool("nvfp4", ws_k_scales=[0.25, 0.25], ws_v_scales=[4.0, 4.0])
    assert [(lk.k_scale, lk.ws_k_scale, lk.ws_v_scale) for lk in n.layers] == [(1.0, 0.25, 4.0)] * 2
    b = pool("bf16")
    assert all((lk.k_scale, lk.v_scale) == (1.0, 1.0) for lk in b.layers)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_dtype": "int4"}, "unknown --kv-cache-dtype 'int4'; choose one of bf16, fp8_e4m3, nvfp4"),
        ({"kv_dtype": "nvfp4", "head_dim": 72}, "nvfp4 needs head_dim divisible by 16 \\(model has 72\\)"),
        ({"kv_dtype": "nvfp4", "page_size": 0}, "page_size must be >= 1 \\(got 0\\)"),
        ({"kv_dtype": "nvfp4", "num_pages": 0}, "at least 1 page \\(got 0\\).*--max-total-tokens"),
        ({"kv_dtype": "bf16", "num_kv_heads": 0}, "num_kv_heads"),
        ({"kv_dtype": "nvfp4", "k_scales": [1.0]}, "k_scales has 1 entries but the model has 2 layers"),
        ({"kv_dtype": "nvfp4", "v_scales": [1.0, 0.0]}, "v_scales must be finite and > 0; layer 1"),
        ({"kv_dtype": "fp8_e4m3", "k_scales": [2.0, 2.0], "ws_k_scales": [1.0, 1.0]}, "must equal"),
    ],
)
def test_invalid_configuration_says_what_to_change(kwargs, message):
    kv_dtype = kwargs.pop("kv_dtype")
    with pytest.raises(ValueError, match=message):
        pool(kv_dtype, **kwargs)


def test_bf16_and_fp8_accept_head_dims_nvfp4_rejects():
    assert pool("bf16", head_dim=72).layers[0].k.shape[-1] == 72
    assert pool("fp8_e4m3", head_dim=72).layers[0].k.shape[-1] == 72


# -- sizes and capacity -----------------------------------------------------------------------------

def test_bytes_per_token_and_page_bytes():
    # Per token per layer: bf16 2*Hk*D*2, fp8 2*Hk*D, nvfp4 2*Hk*(D/2 + D/16).
    assert pool("bf16").bytes_per_token == 2 * (2 * 2 * 32 * 2)
    assert pool("fp8_e4m3").bytes_per_token == 2 * (2 * 2 * 32)
    assert pool("nvfp4").bytes_per_token == 2 * (2 * 2 * (16 + 2))
    assert pool("nvfp4").page_bytes_per_layer == 4 * 2 * 2 * 18
    for d in DTYPES:
        p = pool(d)
        actual = sum(t.numel() * t.element_size() for t in (p.layers[0].k, p.layers[0].v,
                                                             p.layers[0].k_sf, p.layers[0].v_sf) if t is not None)
        assert actual == p.num_pages * p.page_bytes_per_layer
        assert p.capacity().total_bytes == p.num_layers * actual


def test_capacity_reports_what_the_pool_holds():
    assert pool("nvfp4").capacity() == PoolCapacity(
        kv_dtype="nvfp4", num_pages=8, page_size=4, max_tokens=32, total_bytes=32 * 144, bytes_per_token=144)


def test_nvfp4_holds_16_over_9_times_the_tokens_of_fp8_in_the_same_budget():
    geom = {"num_layers": 28, "page_size": 16, "num_kv_heads": 8, "head_dim": 128}  # Qwen3-8B-like
    # fp8 page (all layers) = 16 units, nvfp4 page = 9 units: a budget of 144*k units has no remainder.
    unit = geom["num_layers"] * geom["page_size"] * 2 * geom["num_kv_heads"] * geom["head_dim"] // 16
    caps = {}
    for budget in (144 * unit * 100, 9 * 2**30):
        for d in ("fp8_e4m3", "nvfp4", "bf16"):
            n = KVPool.num_pages_for_budget(budget, d, **geom)
            p = KVPool(d, num_pages=n, device="meta", **geom)
            caps[d] = p.capacity()
            assert caps[d].total_bytes <= budget
            assert caps[d].total_bytes > budget - geom["num_layers"] * p.page_bytes_per_layer  # < 1 page unused
        ratio = Fraction(caps["nvfp4"].max_tokens, caps["fp8_e4m3"].max_tokens)
        if budget % (144 * unit) == 0:
            assert ratio == Fraction(16, 9)
            assert Fraction(caps["fp8_e4m3"].max_tokens, caps["bf16"].max_tokens) == 2
        else:  # whole pages only: within one page of 16/9
            assert abs(ratio - Fraction(16, 9)) < Fraction(2, caps["fp8_e4m3"].num_pages)


def test_num_pages_for_budget_rounds_down_and_may_be_zero():
    page = 2 * 4 * 2 * 2 * 18  # layers * page_size * 2(K,V) * Hk * (D/2 + D/16) for nvfp4
    kw = {"kv_dtype": "nvfp4", "num_layers": 2, "page_size": 4, "num_kv_heads": 2, "head_dim": 32}
    assert KVPool.num_pages_for_budget(page * 5 + page - 1, **kw) == 5
    assert KVPool.num_pages_for_budget(page - 1, **kw) == 0
    with pytest.raises(ValueError, match="divisible by 16"):
        KVPool.num_pages_for_budget(10**9, "nvfp4", 2, 4, 2, 40)


# -- slots ------------------------------------------------------------------------------------------

def test_slots_follow_the_page_table():
    # Page table [5, 2, 7] with pages of 4: position 0 -> slot 20, position 4 -> slot 8, ...
    assert slots_for([5, 2, 7], 0, 12, 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert slots_for([5, 2, 7], 3, 6, 4).tolist() == [23, 8, 9]
    assert slots_for([5, 2, 7], 6, 6, 4).tolist() == []
    s = slots_for(torch.tensor([5, 2, 7], dtype=torch.int32), 9, 10, 4)
    assert s.dtype == torch.int64 and s.tolist() == [29]
    assert pool("nvfp4").slots_for([1, 0], 2, 6).tolist() == [6, 7, 0, 1]


def test_slots_outside_the_page_table_raise():
    with pytest.raises(ValueError, match="not covered by a page table of 2 pages"):
        slots_for([5, 2], 0, 9, 4)
    with pytest.raises(ValueError, match="not covered"):
        slots_for([5, 2], 3, 2, 4)


# -- transfer -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("outliers", [False, True])
def test_export_import_round_trip_is_bit_exact(kv_dtype, outliers):
    src, dst = pool(kv_dtype), pool(kv_dtype)
    fill_random(src, seed=3, outliers=outliers)
    dst.poison()
    src_pages, dst_pages = [6, 1, 3], [0, 7, 2]
    for layer in range(2):
        payload = src.export_pages(layer, src_pages)
        assert payload.num_bytes == 3 * src.page_bytes_per_layer
        dst.import_pages(layer, dst_pages, payload)
        assert dst.export_pages(layer, dst_pages) == payload
    for ls, ld in zip(src.layers, dst.layers):
        for ts, td in ((ls.k, ld.k), (ls.v, ld.v), (ls.k_sf, ld.k_sf), (ls.v_sf, ld.v_sf)):
            if ts is None:
                continue
            rs, rd = ts.view(torch.uint8), td.view(torch.uint8)
            assert torch.equal(rd[dst_pages], rs[src_pages])
            untouched = [p for p in range(8) if p not in dst_pages]
            assert bool((rd[untouched] == 0xFF).all())  # other pages not written


def test_export_is_in_page_table_order_and_matches_storage_bytes():
    p = pool("nvfp4")
    fill_random(p, seed=4)
    lkv = p.layers[1]
    payload = p.export_pages(1, [4, 2])
    assert payload.k == lkv.k[[4, 2]].contiguous().numpy().tobytes()
    assert payload.v_sf == lkv.v_sf.view(torch.uint8)[[4, 2]].contiguous().numpy().tobytes()
    assert p.export_pages(1, []) == PagePayload(b"", b"", b"", b"")
    assert pool("fp8_e4m3").export_pages(0, [0]).k_sf == b""


def test_nvfp4_payload_is_0_5625_of_fp8():
    nv = pool("nvfp4").export_pages(0, [0, 1, 2])
    f8 = pool("fp8_e4m3").export_pages(0, [0, 1, 2])
    assert Fraction(nv.num_bytes, f8.num_bytes) == Fraction(9, 16)
    assert len(nv.k_sf) == len(nv.k) // 8


def test_import_validates_sizes_before_writing():
    p = pool("nvfp4")
    p.poison(0x11)
    good = p.export_pages(0, [0, 1])
    bad = good._replace(v_sf=good.v_sf[:-1])
    with pytest.raises(ValueError, match=r"'v_sf' for 2 nvfp4 pages: expected 32 bytes, got 31"):
        p.import_pages(0, [3, 4], bad._replace(k=bytes(len(good.k))))
    assert bool((p.layers[0].k.view(torch.uint8)[[3, 4]] == 0x11).all())  # nothing written
    with pytest.raises(ValueError, match="'k_sf' .* expected 0 bytes, got 3"):
        pool("bf16").import_pages(0, [0], pool("bf16").export_pages(0, [0])._replace(k_sf=b"abc"))
    with pytest.raises(ValueError, match="outside the pool"):
        p.import_pages(0, [8], good)
    with pytest.raises(ValueError, match="repeated page ids"):
        p.import_pages(0, [3, 3], good)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        p.export_pages(2, [0])


def test_pool_allocates_uninitialized_storage_on_the_requested_device():
    p = KVPool("nvfp4", num_layers=1, num_pages=4, page_size=16, num_kv_heads=1, head_dim=16, device="meta")
    assert p.layers[0].k.device.type == "meta"
    assert p.capacity().max_tokens == 64


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_round_trip_on_gpu(kv_dtype):
    src = pool(kv_dtype)
    fill_random(src, seed=5)
    dst = pool(kv_dtype, device="cuda")
    dst.poison()
    dst.import_pages(0, [2, 5], src.export_pages(0, [1, 7]))
    assert dst.export_pages(0, [2, 5]) == src.export_pages(0, [1, 7])
    assert dst.slots_for([2, 5], 0, 8, device="cuda").tolist() == [8, 9, 10, 11, 20, 21, 22, 23]
