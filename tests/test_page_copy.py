"""The page copy (nvfp4_kernels/page_copy.py, its kernel nvfp4_kernels/triton/page_copy.py): one layer's pages of every part
moved by id, and a NaN/inf among the prompt's token slots flagged, exactly where the reference flags one.

The same cases run three ways: the pure-PyTorch reference on the CPU (here), the Triton kernel under Triton's
CPU interpreter (a subprocess: the interpreter is chosen before kernels are defined), and the kernel on a GPU.
Each case checks the bytes against plain indexing (pages not named stay as they were) and the flag against
where a planted NaN lies: page i of the call holds token slots [i*S, (i+1)*S), only those < num_tokens count.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.kv_pool import KVPool
from nvfp4_kernels.page_copy import copy_pages_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (kv_dtype, page size, KV heads, head_dim): small pools; 1-byte scale slots (a word holds 4 slots' scales);
# bf16 pages of 4096 words (the kernel loops over blocks of a page)
GEOMETRIES = [("nvfp4", 4, 2, 32), ("nvfp4", 16, 1, 16), ("fp8_e4m3", 4, 2, 32), ("bf16", 16, 4, 128)]
SERVED = [("nvfp4", 16, 8, 128), ("fp8_e4m3", 16, 8, 128), ("bf16", 16, 8, 128)]
_NAN = {torch.float8_e4m3fn: [0xFF], torch.bfloat16: [0x80, 0x7F]}  # E4M3 NaN; bf16 +inf (little-endian)


def _parts(kv_dtype: str, s: int, hk: int, d: int, pages: int, device: str, seed: int) -> list[torch.Tensor | None]:
    """A layer's parts with random bytes, every checked value finite (E2M1 codes: any byte, 0x7F/0xFF too)."""
    lkv = KVPool(kv_dtype, 1, pages, s, hk, d, device=device).layers[0]
    g = torch.Generator().manual_seed(seed)
    parts = [lkv.k, lkv.k_sf, lkv.v, lkv.v_sf]
    for t in parts:
        if t is None:
            continue
        raw = torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
        if t.dtype == torch.float8_e4m3fn:
            raw %= 0x7F
        elif t.dtype == torch.bfloat16:
            raw[..., 1::2] &= 0xBF  # high byte: exponent below all ones
        t.view(torch.uint8).copy_(raw.to(device))
    return parts


def _plant(part: torch.Tensor, page: int, slot: int, nan: list[int]) -> None:
    """``nan``'s bytes as the last bytes of token ``slot`` of ``page``."""
    row = part.view(torch.uint8)[page, slot].reshape(-1)
    row[row.numel() - len(nan):] = torch.tensor(nan, dtype=torch.uint8, device=row.device)


def _one_case(impl, src, src_ids, dst_ids, num_tokens, pages_dst, device, want_flag: bool) -> None:
    dst = [None if t is None else torch.zeros((pages_dst, *t.shape[1:]), dtype=t.dtype, device=device) for t in src]
    flag, ref_flag = torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    s_idx = torch.tensor(src_ids, dtype=torch.int64, device=device)
    d_idx = torch.tensor(dst_ids, dtype=torch.int64, device=device)
    impl(src, dst, s_idx, d_idx, num_tokens, flag)
    copy_pages_reference(src, [None if t is None else t.clone() for t in dst], s_idx, d_idx, num_tokens, ref_flag)
    untouched = [p for p in range(pages_dst) if p not in dst_ids]
    for s, d in zip(src, dst, strict=True):
        if s is not None:
            assert torch.equal(d.view(torch.uint8)[dst_ids], s.view(torch.uint8)[src_ids])
            assert not d.view(torch.uint8)[untouched].any()
    assert bool(flag.item()) == bool(ref_flag.item()) == want_flag, (num_tokens, flag.item(), ref_flag.item())
    check_flag = torch.zeros(1, dtype=torch.int32, device=device)
    before = [None if t is None else t.clone() for t in src]
    impl(src, src, s_idx, s_idx, num_tokens, check_flag, copy=False)  # check only: reads, flags the same
    assert bool(check_flag.item()) == want_flag
    assert all(a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, src, strict=True))


def check_cases(impl, device: str, geometries=GEOMETRIES, pages: int = 6, orders=(False, True)) -> int:
    """Every geometry x id orders (contiguous, shuffled ids) x NaN placements x prompt lengths either side of
    the NaN, ``pages`` pages a call (>= 3: a first, a middle and a last, partial page); returns the number of
    cases run."""
    rnd, cases, n = random.Random(0), 0, pages
    for kv_dtype, s, hk, d in geometries:
        for shuffled in orders:
            src_ids = rnd.sample(range(20), n) if shuffled else list(range(7, 7 + n))
            dst_ids = rnd.sample(range(24), n) if shuffled else list(range(11, 11 + n))
            base = _parts(kv_dtype, s, hk, d, 20, device, seed=cases)
            checked = [i for i, t in enumerate(base) if t is not None and t.dtype in _NAN]
            # (part, page of the call, slot): in a full page, and in the last (partial) page of the prompt
            for part, page, slot in [(checked[0], 1, 0), (checked[-1], n - 1, 2)]:
                src = [None if t is None else t.clone() for t in base]
                _plant(src[part], src_ids[page], slot, _NAN[src[part].dtype])
                at = page * s + slot  # the NaN's token position: counted iff at < num_tokens
                for num_tokens, want in ((at, False), (at + 1, True), (n * s, True), (0, False)):
                    _one_case(impl, src, src_ids, dst_ids, num_tokens, 24, device, want)
                    cases += 1
            if kv_dtype == "nvfp4":  # code bytes 0x7F / 0xFF are E2M1 pairs, never NaN
                src = [None if t is None else t.clone() for t in base]
                src[0].view(torch.uint8)[src_ids[0]] = 0x7F
                src[2].view(torch.uint8)[src_ids[1]] = 0xFF
                _one_case(impl, src, src_ids, dst_ids, n * s, 24, device, False)
                cases += 1
    return cases


def test_reference_copies_the_named_pages_and_flags_a_nan_only_inside_the_prompt():
    assert check_cases(copy_pages_reference, "cpu") == 4 * 2 * 8 + 2 * 2


# Under the interpreter every program costs ~10 ms, so the interpreted runs take 3 pages a call (a full first
# page, a middle page holding a NaN, a partial last page: every clamp of a page's prompt slots), shuffled ids
# only (contiguous ids take the same kernel path: the kernel loads an id per page whatever their order) and,
# for the layer kernel, 2 layers (a NaN in the first and in the last layer's segment). The GPU runs keep 6
# pages, both id orders and 3 layers.
def test_kernel_in_the_triton_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    from tests.triton_interpreter import run_interpreted
    res = run_interpreted("from nvfp4_kernels.page_copy_triton import copy_pages\n"
                          "from tests.test_page_copy import check_cases\n"
                          "print('cases', check_cases(copy_pages, 'cpu', pages=3, orders=(True,)))\n")
    assert res.returncode == 0 and "cases 34\n" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_the_launch_refuses_what_the_kernel_cannot_do():
    pytest.importorskip("triton")
    from nvfp4_kernels.page_copy_triton import copy_pages

    flag, ids = torch.zeros(1, dtype=torch.int32), torch.arange(2)
    odd = _parts("nvfp4", 1, 1, 16, 4, "cpu", 0)  # pages of 8 code bytes: no whole 16-byte words
    with pytest.raises(ValueError, match="16-byte words: a page of part k has 8 bytes"):
        copy_pages(odd, odd, ids, ids, 2, flag)
    src, dst = _parts("nvfp4", 4, 2, 32, 4, "cpu", 0), _parts("nvfp4", 4, 4, 32, 4, "cpu", 0)
    with pytest.raises(ValueError, match="source part k .* does not hold pages"):
        copy_pages(src, dst, ids, ids, 8, flag)
    with pytest.raises(ValueError, match="dst_ids must be 1-D int32/int64"):
        copy_pages(src, src, ids, ids.float(), 8, flag)
    with pytest.raises(ValueError, match="flag must be one int32"):
        copy_pages(src, src, ids, ids, 8, flag.bool())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_the_gpu_matches_the_reference_byte_for_byte():
    from nvfp4_kernels.page_copy_triton import copy_pages

    assert check_cases(copy_pages, "cuda", GEOMETRIES + SERVED) == 68 + 3 * 2 * 8 + 2


# -- the same pages of several layers: copied and checked, or checked alone (move_pages) ----------------------
def check_layer_cases(device: str, kernel: bool, geometries=GEOMETRIES, pages: int = 6, layers: int = 3) -> int:
    """``move_pages`` (``kernel``) or its reference over ``layers`` (>= 2) layers, copying (shuffled ids into
    zeroed pages) and checking alone: a NaN planted in the first or the last layer is flagged exactly when its
    slot lies inside the prompt; E2M1 code bytes never are; the named pages arrive, no other byte changes.
    ``pages``: as in ``check_cases``. Returns the number of cases run."""
    from nvfp4_kernels.page_copy import move_pages_reference
    if kernel:
        from nvfp4_kernels.page_copy_triton import move_pages, page_tables
    rnd, cases, n = random.Random(1), 0, pages
    for kv_dtype, s, hk, d in geometries:
        base = [_parts(kv_dtype, s, hk, d, 20, device, seed=10 * cases + i) for i in range(layers)]
        src_ids, dst_ids = rnd.sample(range(20), n), rnd.sample(range(24), n)
        checked = [i for i, t in enumerate(base[0]) if t is not None and t.dtype in _NAN]
        for plant in ((0, checked[0], 1, 0), (layers - 1, checked[-1], n - 1, 2), None):
            src = [[None if t is None else t.clone() for t in parts] for parts in base]
            if plant is None:  # nothing planted; nvfp4 code bytes 0x7F / 0xFF are E2M1 pairs, never NaN
                if kv_dtype == "nvfp4":
                    src[1][0].view(torch.uint8)[src_ids[0]] = 0x7F
                    src[-1][2].view(torch.uint8)[src_ids[1]] = 0xFF
                lengths = [(n * s, False)]
            else:
                layer, part, page, slot = plant
                _plant(src[layer][part], src_ids[page], slot, _NAN[src[layer][part].dtype])
                at = page * s + slot
                lengths = [(at, False), (at + 1, True), (n * s, True), (0, False)]
            before = [[None if t is None else t.clone() for t in parts] for parts in src]
            s_idx = torch.tensor(src_ids, dtype=torch.int64, device=device)
            d_idx = torch.tensor(dst_ids, dtype=torch.int64, device=device)
            for num_tokens, want in lengths:
                dst = [[None if t is None else torch.zeros((24, *t.shape[1:]), dtype=t.dtype, device=device)
                        for t in parts] for parts in src]
                flags = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(3)]
                move_pages_reference(src, [[None if t is None else t.clone() for t in p] for p in dst], s_idx,
                                     d_idx, num_tokens, flags[0])
                if kernel:
                    move_pages(page_tables(src, dst), s_idx, d_idx, num_tokens, flags[1])
                    move_pages(page_tables(src, src), s_idx, s_idx, num_tokens, flags[2], copy=False)
                else:
                    move_pages_reference(src, dst, s_idx, d_idx, num_tokens, flags[1])
                    move_pages_reference(src, src, s_idx, s_idx, num_tokens, flags[2], copy=False)
                assert [bool(f.item()) for f in flags] == [want] * 3, (kv_dtype, plant, num_tokens)
                untouched = [p for p in range(24) if p not in dst_ids]
                for sp, dp in zip(src, dst, strict=True):
                    for a, b in zip(sp, dp, strict=True):
                        if a is not None:
                            assert torch.equal(b.view(torch.uint8)[dst_ids], a.view(torch.uint8)[src_ids])
                            assert not b.view(torch.uint8)[untouched].any()
                cases += 1
            for a_parts, b_parts in zip(before, src, strict=True):  # sources never change
                assert all(a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(a_parts, b_parts, strict=True))
    return cases


def test_the_pages_of_several_layers_move_and_a_nan_of_any_layer_is_flagged_only_inside_the_prompt():
    assert check_layer_cases("cpu", kernel=False) == 4 * 9


def test_the_layer_kernel_in_the_triton_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    from tests.triton_interpreter import run_interpreted
    res = run_interpreted("from tests.test_page_copy import check_layer_cases\n"
                          "print('cases', check_layer_cases('cpu', kernel=True, pages=3, layers=2))\n")
    assert res.returncode == 0 and "cases 36\n" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_the_layer_launch_refuses_layers_of_two_geometries_and_bad_ids():
    pytest.importorskip("triton")
    from nvfp4_kernels.page_copy_triton import move_pages, page_tables

    a, b = _parts("nvfp4", 4, 2, 32, 4, "cpu", 0), _parts("nvfp4", 4, 4, 32, 4, "cpu", 0)
    with pytest.raises(ValueError, match="every layer of one page geometry"):
        page_tables([a, b], [a, b])
    with pytest.raises(ValueError, match="as many source as destination layers"):
        page_tables([a], [a, a])
    with pytest.raises(ValueError, match="source part k .* does not hold pages"):
        page_tables([b], [a])
    tables, flag, ids = page_tables([a, a], [a, a]), torch.zeros(1, dtype=torch.int32), torch.arange(2)
    # values (k, v of each layer: E2M1, not checked), then scales (k_sf, v_sf: E4M3)
    assert [(t.addresses.shape, t.check) for t in tables.groups] == [((4, 2), 0), ((4, 2), 1)]
    with pytest.raises(ValueError, match="dst_ids must be 1-D int32/int64"):
        move_pages(tables, ids, torch.zeros(2, 2, dtype=torch.int64), 8, flag)
    with pytest.raises(ValueError, match="flag must be one int32"):
        move_pages(tables, ids, ids, 8, flag.bool())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_layer_kernel_on_the_gpu_matches_the_reference():
    assert check_layer_cases("cuda", kernel=True, geometries=GEOMETRIES + SERVED) == 7 * 9


def test_the_layer_kernel_compiles_for_sm90a_without_spills(tmp_path):
    pytest.importorskip("triton")
    from nvfp4_kernels.triton.page_copy import page_table_kernel
    from tests.test_fused_ops import _sm90a

    sig = {"TABLE": "*i64", "SRC_IDS": "*i64", "DST_IDS": "*i64", "FLAG": "*i32", "num_tokens": "i32"}
    # served pages: nvfp4 codes (copied) and scales, fp8 values, bf16 values; copied, and checked alone
    for words, kind, copy in ((2048, 0, True), (256, 1, True), (4096, 1, True), (8192, 2, True), (256, 1, False)):
        out = tmp_path / f"{words}_{kind}_{copy}"
        out.mkdir()
        consts = {"PAGE_SIZE": 16, "WORDS": words, "BLOCK": min(words, 2048), "CHECK": kind, "COPY": copy}
        regs, sass = _sm90a(page_table_kernel, sig, consts, 4, out)
        assert "STL" not in sass and "LDL" not in sass and regs <= 96, (words, kind, copy, regs)  # 4 warps
