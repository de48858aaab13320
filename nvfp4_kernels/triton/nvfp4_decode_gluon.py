"""NVFP4 decode attention for Hopper in Gluon, pages through a cp.async ring: the Hopper kernel where TMA's boxes do
not fit the pool (``decode_kernels.tma_fits``) and for eager (uncaptured) launches (``decode_choice.eager_config``).

The program, its state and each step's math are ``gluon_decode_step``'s (one warp per program, transposed MMAs);
this kernel only loads: cp.async (``async_copy``) puts the packed codes of K and V ([BT, D/4] int16 rows, 16-byte
copies) and their block-scale bytes ([BT, D/16], one copy per row, a lane per row) into a STAGES-deep
shared-memory ring, rows past the split's end zero-filled; the page table is read once per step, STAGES-1 steps
ahead of its use.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from nvfp4_kernels.triton.gluon_decode_step import (
    ACC_LAYOUT,
    attend,
    fresh_state,
    load_q,
    split_range,
    store_empty,
    store_out,
)
from nvfp4_kernels.triton.nvfp4_decode import PLAN_INTS


@gluon.jit
def _rows(pt_row, tok, end, h, HK: gl.constexpr, PAGE: gl.constexpr):
    """Pool rows ([P*PAGE*HK, ...] views) of tokens ``tok`` of head h, and which of them are below ``end``."""
    ok = tok < end
    page = gl.load(pt_row + tok // PAGE, mask=ok, other=0).to(gl.int64)
    return (page * PAGE + tok % PAGE) * HK + h, ok


@gluon.jit
def _issue(ring, K16, V16, KSF, VSF, pt_row, t0, end, stage, h, tr, tc, trs, tcs,
           HK: gl.constexpr, DW: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr):
    """cp.async of tokens [t0, t0 + BT) (rows past ``end`` are zero-filled) into ring slot ``stage``."""
    k_smem, v_smem, ks_smem, vs_smem = ring
    row, ok = _rows(pt_row, t0 + tr, end, h, HK, PAGE)
    off = (row * DW)[:, None] + tc[None, :]
    async_copy.async_copy_global_to_shared(k_smem.index(stage), K16 + off, mask=ok[:, None])
    async_copy.async_copy_global_to_shared(v_smem.index(stage), V16 + off, mask=ok[:, None])
    # the scale rows (NS bytes each, one copy per row) in their own layout: a lane per row
    srow, sok = _rows(pt_row, t0 + trs, end, h, HK, PAGE)
    soff = (srow * NS)[:, None] + tcs[None, :]
    async_copy.async_copy_global_to_shared(ks_smem.index(stage), KSF + soff, mask=sok[:, None])
    async_copy.async_copy_global_to_shared(vs_smem.index(stage), VSF + soff, mask=sok[:, None])
    async_copy.commit_group()


@gluon.jit(do_not_specialize=PLAN_INTS)  # one compile for every batch shape (nvfp4_decode.py)
def nvfp4_decode_gluon_kernel(
    Q, K16, KSF, V16, VSF, PAGE_TABLE, SEQ_LENS, O_PART, LSE_PART,
    qk_scale, out_scale,
    stride_qb, stride_qh, stride_ptb,
    stride_pb, stride_ph, stride_ps,  # O_PART [B, Hq, num_splits, D] fp32 (d stride 1)
    stride_lb, stride_lh,  # LSE_PART [B, Hq, num_splits] fp32 (split stride 1)
    chunk_tokens,
    HK: gl.constexpr, G: gl.constexpr, GN: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
    BT: gl.constexpr, STAGES: gl.constexpr,
):
    """Pool pages are contiguous: K16/V16 [P, PAGE, HK, D/4] int16, KSF/VSF [P, PAGE, HK, D/16] uint8. num_warps=1."""
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    mma: gl.constexpr = ACC_LAYOUT
    # copies: 8 int16 (16 bytes) per thread, DW // 8 threads per row
    cp: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DW // 8), DW // 8], [1, 1], [1, 0])
    cps: gl.constexpr = gl.BlockedLayout([1, NS], [32, 1], [1, 1], [1, 0])  # scales: NS bytes per lane
    codes_sh: gl.constexpr = gl.SwizzledSharedLayout(8, 2, 4, [1, 0])
    bytes_sh: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    h, split, b, start, end = split_range(SEQ_LENS, chunk_tokens)
    if start >= end:
        store_empty(O_PART, LSE_PART, b, split, h, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW)
        return
    q0, q1, q2, q3 = load_q(Q, b, h, stride_qb, stride_qh, G, GN, DW)

    ring = (gl.allocate_shared_memory(gl.int16, [STAGES, BT, DW], codes_sh),
            gl.allocate_shared_memory(gl.int16, [STAGES, BT, DW], codes_sh),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BT, NS], bytes_sh),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BT, NS], bytes_sh))
    tr = gl.arange(0, BT, layout=gl.SliceLayout(1, cp))
    tc = gl.arange(0, DW, layout=gl.SliceLayout(0, cp))
    trs = gl.arange(0, BT, layout=gl.SliceLayout(1, cps))
    tcs = gl.arange(0, NS, layout=gl.SliceLayout(0, cps))
    pt_row = PAGE_TABLE + b * stride_ptb
    for i in gl.static_range(STAGES - 1):
        _issue(ring, K16, V16, KSF, VSF, pt_row, start + i * BT, end, i, h, tr, tc, trs, tcs, HK, DW, NS, PAGE)

    m_i, l_i, acc0, acc1, acc2, acc3 = fresh_state(GN, DW, BT, False)
    for i in range(gl.cdiv(end - start, BT)):
        t0 = start + i * BT
        stage = i % STAGES
        gl.thread_barrier()  # every lane has read slot (i - 1) % STAGES before it is refilled
        _issue(ring, K16, V16, KSF, VSF, pt_row, t0 + (STAGES - 1) * BT, end, (i + STAGES - 1) % STAGES, h, tr, tc,
               trs, tcs, HK, DW, NS, PAGE)
        async_copy.wait_group(STAGES - 1)  # slot `stage` has landed
        k_smem, v_smem, ks_smem, vs_smem = ring
        m_i, l_i, acc0, acc1, acc2, acc3 = attend(
            k_smem.index(stage), ks_smem.index(stage), v_smem.index(stage), vs_smem.index(stage), q0, q1, q2, q3, t0,
            end, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, BT, GN, NS, False, None)
    async_copy.wait_group(0)

    inv = (out_scale / l_i)[None, :]
    store_out(O_PART, LSE_PART, b, split, h, acc0 * inv, acc1 * inv, acc2 * inv, acc3 * inv, m_i + gl.log2(l_i),
               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW, mma)
