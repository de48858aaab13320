"""CPU checks of the Triton kernels: they compile for Hopper and Blackwell, and compute the right thing.

* Cross-compile (no GPU): the decode kernel for sm_90a with the software E2M1 decode (tensor-core HMMA in
  the SASS, no local-memory spills), for sm_100a / sm_120a with the hardware ``cvt.rn.f16x2.e2m1x2``
  path (and that path is rejected on sm_90a); the quantize, workspace, page-copy and fp8/bf16 pool-write kernels for sm_90a.
* Triton's CPU interpreter runs the backend (in a subprocess, since the interpreter must be chosen
  before the kernels are defined): quantize and workspace bytes equal the reference, decode matches it.

Skipped only when triton is not importable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.triton_interpreter import PRELUDE

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

_DECODE_SIG = {"Q": "*bf16", "K16": "*i16", "KSF": "*u8", "V16": "*i16", "VSF": "*u8", "PAGE_TABLE": "*i32",
               "SEQ_LENS": "*i32", "O_PART": "*fp32", "LSE_PART": "*fp32", "qk_scale": "fp32", "out_scale": "fp32",
               **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_ptb", "stride_pb", "stride_ph", "stride_ps",
                                     "stride_lb", "stride_lh", "chunk_tokens")}}


def _compile(fn, signature: dict, constexprs: dict, arch: int, num_warps: int = 4, divisible: tuple = (),
             **options):
    """``fn`` compiled for sm_``arch``, its pointers and the ints named in ``divisible`` taken as multiples of 16
    (as Triton specializes a launch's arguments that are)."""
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(signature)
               if signature[k].startswith("*") or k in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": 2, **options})


def _sass(kernel, tmp_path) -> str:
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.asm["cubin"])
    return subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-sass", str(path)], capture_output=True,
                          text=True, check=True).stdout


def _instructions(sass: str) -> int:
    """SASS instructions in a kernel's listing (each line of code carries its address as /*xxxx*/)."""
    return len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))


# A decode step's write launch has a few programs on ~132 SMs, so its time is one program's instruction stream,
# run once per thread (straight-line code). At head_dim 128 the launched blocks (1024 values a program) give ~450
# instructions (fp8 write) and ~600 (nvfp4 quantize), where 16-row K+V programs and 32-row blocks gave ~1400 and
# ~1800: these caps keep a block change from lengthening it again.
_FP8_WRITE_MAX_INSTRUCTIONS = 700
_QUANTIZE_MAX_INSTRUCTIONS = 900


def _decode_constexprs(mode: int, d: int = 128, group: int = 4) -> dict:
    return {"HK": 8, "G": group, "GP": 16, "D": d, "PAGE": 16, "NW": 4, "BW": 16 if d > 128 else 32, "MODE": mode}


def test_decode_kernel_compiles_for_sm90a_with_tensor_cores_and_no_spills(tmp_path):
    from nvfp4_kernels.triton.nvfp4_decode import nvfp4_decode_kernel

    k = _compile(nvfp4_decode_kernel, _DECODE_SIG, _decode_constexprs(mode=1), arch=90)
    assert k.metadata.name == "nvfp4_decode_kernel"
    sass = _sass(k, tmp_path)
    assert "HMMA" in sass  # QK and PV on tensor cores
    assert "PRMT" in sass and "LOP3" in sass  # the software E2M1 decode on packed words
    assert "STL" not in sass and "LDL" not in sass  # no register spills to local memory
    assert "cvt.rn.f16x2.e2m1x2" not in k.asm["ptx"]


@pytest.mark.parametrize("arch", [100, 120])
def test_decode_kernel_blackwell_path_uses_hardware_e2m1_conversion(arch):
    from nvfp4_kernels.triton.nvfp4_decode import nvfp4_decode_kernel

    k = _compile(nvfp4_decode_kernel, _DECODE_SIG, _decode_constexprs(mode=2), arch=arch)
    assert "cvt.rn.f16x2.e2m1x2" in k.asm["ptx"]
    assert len(k.asm["cubin"]) > 0


def test_hardware_e2m1_conversion_is_rejected_on_hopper():
    from nvfp4_kernels.triton.nvfp4_decode import nvfp4_decode_kernel

    with pytest.raises(Exception):  # noqa: B017 - ptxas refuses the instruction for sm_90a
        _compile(nvfp4_decode_kernel, _DECODE_SIG, _decode_constexprs(mode=2), arch=90)


_QUANT_SIG = {"K": "*bf16", "V": "*bf16", "SLOTS": "*i64", "K_DATA": "*u8", "K_SCALES": "*u8", "V_DATA": "*u8",
              "V_SCALES": "*u8", "num_rows": "i32", "k_scale": "fp32", "v_scale": "fp32",
              **{n: "i32" for n in ("stride_kt", "stride_kh", "stride_vt", "stride_vh")}}


@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantize_kernel_compiles_for_sm90a_as_launched_without_spills(tmp_path, d):
    from nvfp4_kernels.backends.triton_nvfp4 import quant_block_rows
    from nvfp4_kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel

    strides = ("stride_kt", "stride_kh", "stride_vt", "stride_vh")  # multiples of head_dim
    q = _compile(nvfp4_quantize_kernel, _QUANT_SIG, {"HK": 8, "D": d, "BLOCK_R": quant_block_rows(d, False)},
                 arch=90, divisible=strides)
    ptx = q.asm["ptx"]
    assert "div.rn.f32" in ptx  # correctly rounded divisions, as the spec requires
    assert "ld.global.v4.b32" in ptx  # K or V picked per program: the rows still load 16 bytes at a time
    sass = _sass(q, tmp_path)
    assert "STL" not in sass and "LDL" not in sass, d
    print(f"nvfp4_quantize_kernel D={d}: {_instructions(sass)} SASS instructions")
    if d == 128:
        assert _instructions(sass) <= _QUANTIZE_MAX_INSTRUCTIONS


def test_workspace_kernel_compiles_for_sm90a():
    from nvfp4_kernels.triton.nvfp4_quantize import nvfp4_to_fp8_kernel

    w = _compile(nvfp4_to_fp8_kernel, {"DATA": "*u8", "SCALES": "*u8", "SLOTS": "*i64", "OUT": "*u8",
                                       "num_rows": "i32", "global_scale": "fp32", "ws_scale": "fp32"},
                 {"HK": 8, "D": 128, "BLOCK_R": 32}, arch=90)
    assert "div.rn.f32" in w.asm["ptx"]


def test_block_select_quantize_kernel_compiles_for_sm90a_without_fused_multiply_adds(tmp_path):
    from nvfp4_kernels.backends.triton_nvfp4 import quant_block_rows
    from nvfp4_kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel

    q = _compile(nvfp4_quantize_kernel, _QUANT_SIG, {"HK": 8, "D": 128, "BLOCK_R": 32, "BLOCK_SELECT": True},
                 arch=90, enable_fp_fusion=False)
    ptx = q.asm["ptx"]
    assert "div.rn.f32" in ptx and "fma.rn.f32" not in ptx  # the error sums keep the reference's fp32 order
    # the shape the backend launches (nvfp4_kernels/backends/triton_nvfp4.py): its scale search spills nothing
    for d in (64, 128, 256):
        k = _compile(nvfp4_quantize_kernel, _QUANT_SIG,
                     {"HK": 8, "D": d, "BLOCK_R": quant_block_rows(d, True), "BLOCK_SELECT": True}, arch=90,
                     enable_fp_fusion=False)
        sass = _sass(k, tmp_path)
        assert "STL" not in sass and "LDL" not in sass, d


@pytest.mark.parametrize("fp8, rows", [(True, "*bf16"), (False, "*bf16"), (False, "*fp16")],
                         ids=["fp8", "bf16", "fp16-to-bf16"])
def test_dense_pool_write_kernel_compiles_for_sm90a(tmp_path, fp8, rows):
    from nvfp4_kernels.backends.triton_kv_write import block_rows
    from nvfp4_kernels.triton.kv_write import kv_write_kernel

    pool = "*u8" if fp8 else "*bf16"
    k = _compile(kv_write_kernel, {"K": rows, "V": rows, "SLOTS": "*i64", "POOL_K": pool, "POOL_V": pool,
                                   "num_rows": "i32", "k_scale": "fp32", "v_scale": "fp32",
                                   **{n: "i32" for n in ("stride_kt", "stride_kh", "stride_vt", "stride_vh")}},
                 {"HK": 8, "D": 128, "BLOCK_R": block_rows(128), "FP8": fp8, "X_IS_BF16": rows == "*bf16"}, arch=90)
    ptx = k.asm["ptx"]
    assert ("div.rn.f32" in ptx) == fp8  # the scale's correctly rounded division (fp8 only)
    sass = _sass(k, tmp_path)
    assert "STL" not in sass and "LDL" not in sass
    assert _instructions(sass) <= _FP8_WRITE_MAX_INSTRUCTIONS, _instructions(sass)


_PAGE_COPY_PARTS = ("K_SRC", "K_DST", "V_SRC", "V_DST", "KSF_SRC", "KSF_DST", "VSF_SRC", "VSF_DST")


@pytest.mark.parametrize("val_words, val_check, sf_words, copy", [(2048, 0, 256, True), (4096, 1, 0, True),
                                                                  (8192, 2, 0, True), (4096, 1, 0, False)],
                         ids=["nvfp4", "fp8", "bf16", "fp8-check-only"])
def test_page_copy_kernel_compiles_for_sm90a_with_16_byte_accesses(tmp_path, val_words, val_check, sf_words, copy):
    from nvfp4_kernels.page_copy_triton import _block
    from nvfp4_kernels.triton.page_copy import page_copy_kernel

    values = {0: "*u8", 1: "*fp8e4nv", 2: "*bf16"}[val_check]
    sig = {n: values if n[0] in "KV" and "SF" not in n else "*fp8e4nv" for n in _PAGE_COPY_PARTS}
    sig.update({"SRC_IDS": "*i64", "DST_IDS": "*i64", "FLAG": "*i32", "num_tokens": "i32"})
    k = _compile(page_copy_kernel, sig, {
        "PAGE_SIZE": 16, "VAL_WORDS": val_words, "VAL_BLOCK": _block(val_words), "VAL_CHECK": val_check,
        "SF_WORDS": sf_words, "SF_BLOCK": _block(sf_words), "COPY": copy}, arch=90)
    ptx = k.asm["ptx"]
    assert "ld.global.v4.b32" in ptx  # the pages' words read 16 bytes at a time (1 KiB scale pages: 8)
    assert ("st.global.v4.b32" in ptx) == copy  # and written so, unless only checked
    assert "atom." not in ptx  # the flag is a plain store of 1 (an OR), never an atomic
    sass = _sass(k, tmp_path)
    assert "STL" not in sass and "LDL" not in sass

@pytest.mark.parametrize("val_words, val_check, sf_words", [(2048, 0, 256), (4096, 1, 0), (8192, 2, 0)],
                         ids=["nvfp4", "fp8", "bf16"])
def test_the_staged_copy_kernel_reads_a_message_16_bytes_at_a_time_from_aligned_offsets(tmp_path, val_words,
                                                                                       val_check, sf_words):
    from nvfp4_kernels.page_copy_triton import _block
    from nvfp4_kernels.triton.page_copy import staged_copy_kernel

    values = {0: "*u8", 1: "*fp8e4nv", 2: "*bf16"}[val_check]
    sig = {"STAGED": "*u8", "K_DST": values, "V_DST": values, "KSF_DST": "*fp8e4nv", "VSF_DST": "*fp8e4nv",
           "FLAG": "*i32", "num_tokens": "i32", **{n: "i64" for n in ("k_at", "v_at", "ksf_at", "vsf_at")}}
    k = _compile(staged_copy_kernel, sig, {
        "PAGE_SIZE": 16, "VAL_WORDS": val_words, "VAL_BLOCK": _block(val_words), "VAL_CHECK": val_check,
        "SF_WORDS": sf_words, "SF_BLOCK": _block(sf_words)}, arch=90,
        divisible=("k_at", "v_at", "ksf_at", "vsf_at"))  # multiples of 16: the aligned framing's offsets
    ptx = k.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and "atom." not in ptx
    sass = _sass(k, tmp_path)
    assert "STL" not in sass and "LDL" not in sass


_INTERPRETED = textwrap.dedent("""
    import math, os, sys
    import torch
    from nvfp4_kernels import nvfp4
    from nvfp4_kernels.backends.reference import ReferenceBackend
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, TritonBackend
    from nvfp4_kernels.kv_layout import LayerKV

    torch.manual_seed(0)
    P, S, HK, G = 12, 16, 2, 4
    # 37 tokens: 74 rows, a partial last program of the quantize (16 / 8 rows a program at D 64 / 128) and of
    # the gather (32 rows); the interpreter's cost grows with the programs (byte-exact writes of every shape and
    # dtype: tests/test_nvfp4_write.py)
    N = 37
    for D in (64, 128):
        def layer():
            z = lambda last, dt: torch.zeros(P, S, HK, last, dtype=dt)
            return LayerKV("nvfp4", S, HK, D, z(D // 2, torch.uint8), z(D // 2, torch.uint8),
                           z(D // 16, torch.float8_e4m3fn), z(D // 16, torch.float8_e4m3fn), 0.05, 0.02, 0.01, 0.005)
        ours, ref = layer(), layer()
        tb, rb = TritonBackend(DecodeConfig(2, 16, 2)), ReferenceBackend()
        slots = torch.randperm(P * S)[:N]
        k = torch.randn(N, HK, D) * torch.exp(torch.randn(N, HK, D) * 2)
        k[0] = 0
        v = torch.randn(N, HK, D).to(torch.bfloat16)
        tb.write_kv(ours, slots, k, v)
        rb.write_kv(ref, slots, k, v)
        for n in ("k", "v", "k_sf", "v_sf"):
            assert torch.equal(getattr(ours, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)), n
        from nvfp4_kernels.backends.block_select import BlockSelectBackend
        from nvfp4_kernels.backends.triton_backend import TritonBlockSelectBackend
        sel, sel_ref = layer(), layer()
        few = slice(0, 13)  # the scale search is 9 encodes a block: 13 tokens (26 rows, a partial last program)
        TritonBlockSelectBackend(DecodeConfig(2, 16, 2)).write_kv(sel, slots[few], k[few], v[few])
        BlockSelectBackend().write_kv(sel_ref, slots[few], k[few], v[few])
        for n in ("k", "v", "k_sf", "v_sf"):
            assert torch.equal(getattr(sel, n).view(torch.uint8), getattr(sel_ref, n).view(torch.uint8)), "sel " + n
        rows = lambda t: t.view(torch.uint8).view(P * S, HK, -1)[slots[few]]
        assert not torch.equal(rows(sel.k_sf), rows(ours.k_sf))  # some blocks chose another code than amax/6's
        ws = [torch.zeros(N, HK, D, dtype=torch.float8_e4m3fn) for _ in range(4)]
        tb.gather_workspace(ours, slots, ws[0], ws[1])
        rb.gather_workspace(ref, slots, ws[2], ws[3])
        assert torch.equal(ws[0].view(torch.uint8), ws[2].view(torch.uint8))
        assert torch.equal(ws[1].view(torch.uint8), ws[3].view(torch.uint8))
        # the decode's pool, every slot, written by the reference: both decodes only read it, and the Triton
        # write's bytes equal the reference's (checked above and in tests/test_nvfp4_write.py)
        rb.write_kv(ours, torch.arange(P * S), torch.randn(P * S, HK, D), torch.randn(P * S, HK, D))
        pt = torch.randperm(P).reshape(3, 4).to(torch.int32)
        seq = torch.tensor([64, 33, 1], dtype=torch.int32)
        q = torch.randn(3, HK * G, D).to(torch.bfloat16)
        out = tb.decode(tb.plan_decode(pt, seq, HK * G, HK, D, S), q, ours, 1 / math.sqrt(D)).float()
        expect = rb.decode(rb.plan_decode(pt, seq, HK * G, HK, D, S), q, ours, 1 / math.sqrt(D)).float()
        err = ((out - expect).norm() / expect.norm()).item()
        assert err < 1e-2, err
        # the plans of a part share one pair of split buffers, grown by doubling: a larger plan made after the
        # first (its pages repeated: 40 in the table, 600 tokens, 3 splits) and the first decoded again after it
        pt2 = torch.arange(80).remainder(P).reshape(2, 40).to(torch.int32)
        seq2 = torch.tensor([600, 250], dtype=torch.int32)
        first, second = tb.plan_decode(pt, seq, HK * G, HK, D, S), tb.plan_decode(pt2, seq2, HK * G, HK, D, S)
        assert second.backend_state.num_splits == 3
        q2 = torch.randn(2, HK * G, D).to(torch.bfloat16)
        for plan, table, lens, qq in ((second, pt2, seq2, q2), (first, pt, seq, q)):
            got = tb.decode(plan, qq, ours, 1 / math.sqrt(D)).float()
            want = rb.decode(rb.plan_decode(table, lens, HK * G, HK, D, S), qq, ours, 1 / math.sqrt(D)).float()
            assert ((got - want).norm() / want.norm()).item() < 1e-2
    # the merge walks the splits in tiles: one split, part of a tile, a whole tile, and several tiles with a
    # partial last one; empty splits (lse -inf) weigh nothing, and a head whose every split is empty gets zeros
    from nvfp4_kernels.triton.nvfp4_decode import MERGE_ELEMENTS, MIN_MERGE_TILE, merge_kernel, merge_tile
    tile = MERGE_ELEMENTS // 64
    assert [merge_tile(n, 64) for n in (1, 16, 17, 100, tile, tile + 1)] == [MIN_MERGE_TILE, 16, 32, 128, tile, tile]
    for splits in (1, 5, 16, 40, tile, 2 * tile + 3):
        op, lse = torch.randn(2, 3, splits, 64), torch.randn(2, 3, splits) * 4
        lse[0, 0, ::2] = float("-inf")
        lse[1, 2] = float("-inf")
        out = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        merge_kernel[(2, 3)](op, lse, out, splits, out.stride(0), out.stride(1), D=64,
                             SPLIT_TILE=merge_tile(splits, 64))
        m = lse.amax(-1, keepdim=True)
        w = torch.exp2(lse - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        den = w.sum(-1, keepdim=True)
        expect = (w[..., None] * op).sum(-2) / torch.where(den > 0, den, torch.ones_like(den))
        assert torch.allclose(out.float(), expect, rtol=1e-2, atol=1e-2), splits
        assert torch.equal(out[1, 2].float(), torch.zeros(64)), splits
    print("interpreter ok")
""")


def test_backend_in_triton_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", PRELUDE + _INTERPRETED], cwd=REPO, env=env, capture_output=True, text=True, check=False,
                         timeout=240)
    assert res.returncode == 0 and "interpreter ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
