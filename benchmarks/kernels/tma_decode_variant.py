"""NVFP4 decode attention for Hopper, the Gluon kernel fed by TMA: one bulk copy per page and part.

Same contract, tiling and math as ``nvfp4_decode_gluon`` (one warp per program = (kv head h, split s, sequence
b), transposed MMAs, split-KV partials merged by ``merge_kernel``); only the loads differ. There, 32 lanes
compute a row address each and issue 16- and 8-byte cp.async copies per step. Here one thread issues, per page
of a step, four TMA copies (2-D boxes through tensor maps made on the host):

  - K and V codes: the pool viewed as [P*PAGE, HK*D/4] int16, box [PAGE, D/4] at (page*PAGE, h*D/4): a head's
    rows of one page (D/2 bytes each at the HK*D/2-byte token stride), landing 64-byte swizzled
    (``NVMMASharedLayout``), which is the layout ldmatrix reads without bank conflicts;
  - K and V block scales: the pool viewed as [P*PAGE, HK*D/16] uint8, box [PAGE, SW] at (page*PAGE, h*D/16),
    SW = max(16, D/16) bytes (a TMA box row is 16 bytes at least: the first D/16 are this head's, the rest the
    next head's or zeros past the last head).

Each ring slot has an mbarrier that counts the slot's bytes in. Pages past the split's end are read at a row
past the pool (TMA fills them with zeros), so every copy of a step completes the same byte count. Token slots
past ``end`` inside the last page hold whatever the pool has there: S is masked to -inf for them (so K's values
never matter), and V's scales are zeroed for them on the tail step (E2M1 codes are finite, so those V rows
decode to 0 and P = 0 multiplies 0, never NaN).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from nvfp4_kernels.triton.nvfp4_decode_gluon import _HI_ASM, _LO_ASM, _decode_half, _scales, _store_out


@gluon.jit
def _issue(ring, bars, k_desc, v_desc, ks_desc, vs_desc, pt_row, t0, end, stage, h, oob_row,
           DW: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr, NPG: gl.constexpr, SW: gl.constexpr):
    """TMA copies of tokens [t0, t0 + NPG*PAGE) of head h into ring slot ``stage`` (nothing when t0 >= end)."""
    k_smem, v_smem, ks_smem, vs_smem = ring
    live = t0 < end
    bar = bars.index(stage)
    mbarrier.expect(bar, NPG * PAGE * (4 * DW + 2 * SW), pred=live)
    for j in gl.static_range(NPG):
        tok = t0 + j * PAGE
        page = gl.load(pt_row + tok // PAGE, mask=tok < end, other=-1)
        row = gl.where(tok < end, page * PAGE, oob_row)
        tma.async_copy_global_to_shared(k_desc, [row, h * DW], bar, k_smem.index(stage).slice(j * PAGE, PAGE), pred=live)
        tma.async_copy_global_to_shared(v_desc, [row, h * DW], bar, v_smem.index(stage).slice(j * PAGE, PAGE), pred=live)
        tma.async_copy_global_to_shared(ks_desc, [row, h * NS], bar, ks_smem.index(stage).slice(j * PAGE, PAGE),
                                        pred=live)
        tma.async_copy_global_to_shared(vs_desc, [row, h * NS], bar, vs_smem.index(stage).slice(j * PAGE, PAGE),
                                        pred=live)


@gluon.jit
def nvfp4_decode_tma_kernel(
    Q, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE, SEQ_LENS, O_PART, LSE_PART,
    qk_scale, out_scale,
    stride_qb, stride_qh, stride_ptb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    chunk_tokens, oob_row,
    HK: gl.constexpr, G: gl.constexpr, GN: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
    NPG: gl.constexpr, STAGES: gl.constexpr, SW: gl.constexpr,
):
    """Descriptors: k/v [P*PAGE, HK*D/4] int16, box [PAGE, D/4]; ks/vs [P*PAGE, HK*D/16] uint8, box [PAGE, SW].
    ``oob_row`` = P*PAGE (a row past the pool). num_warps=1."""
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    BT: gl.constexpr = NPG * PAGE
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    k_sl: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 2, 2], [1, 1, 1], [2, 1, 0])
    v_sl: gl.constexpr = gl.BlockedLayout([2, 1, 1], [4, 2, 4], [1, 1, 1], [0, 2, 1])

    h = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    seq_len = gl.load(SEQ_LENS + b)
    start = split * chunk_tokens
    end = gl.minimum(seq_len, start + chunk_tokens)
    if start >= end:
        z = gl.zeros([DW, GN], gl.float32, layout=mma)
        _store_out(O_PART, LSE_PART, b, split, h, z, z, z, z,
                   gl.full([GN], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma)),
                   stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW, mma)
        return

    jq = gl.arange(0, DW, layout=gl.SliceLayout(1, op_b))
    gq = gl.arange(0, GN, layout=gl.SliceLayout(0, op_b))
    qp = Q + b * stride_qb + (h * G + gq)[None, :] * stride_qh + 4 * jq[:, None]
    qm = (gq < G)[None, :] & (jq >= 0)[:, None]
    q0 = gl.load(qp + 0, mask=qm, other=0.0).to(gl.float16)
    q1 = gl.load(qp + 1, mask=qm, other=0.0).to(gl.float16)
    q2 = gl.load(qp + 2, mask=qm, other=0.0).to(gl.float16)
    q3 = gl.load(qp + 3, mask=qm, other=0.0).to(gl.float16)

    ring = (gl.allocate_shared_memory(gl.int16, [STAGES, BT, DW], k_desc.layout),
            gl.allocate_shared_memory(gl.int16, [STAGES, BT, DW], v_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BT, SW], ks_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BT, SW], vs_desc.layout))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for si in gl.static_range(STAGES):
        mbarrier.init(bars.index(si), count=1)
    fence_async_shared()
    pt_row = PAGE_TABLE + b * stride_ptb
    for i in gl.static_range(STAGES - 1):
        _issue(ring, bars, k_desc, v_desc, ks_desc, vs_desc, pt_row, start + i * BT, end, i, h, oob_row,
               DW, NS, PAGE, NPG, SW)

    ts = gl.arange(0, BT, layout=gl.SliceLayout(1, mma))
    zl: gl.constexpr = gl.BlockedLayout([1, SW], [32, 1], [1, 1], [1, 0])  # a scale row per lane
    tz = gl.arange(0, BT, layout=gl.SliceLayout(1, zl))
    m_i = gl.full([GN], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_i = gl.zeros([GN], gl.float32, layout=gl.SliceLayout(0, mma))
    acc0 = gl.zeros([DW, GN], gl.float32, layout=mma)
    acc1 = gl.zeros([DW, GN], gl.float32, layout=mma)
    acc2 = gl.zeros([DW, GN], gl.float32, layout=mma)
    acc3 = gl.zeros([DW, GN], gl.float32, layout=mma)
    for i in range(gl.cdiv(end - start, BT)):
        t0 = start + i * BT
        stage = i % STAGES
        gl.thread_barrier()  # every lane has read slot (i - 1) % STAGES (its values consumed) before TMA refills it
        _issue(ring, bars, k_desc, v_desc, ks_desc, vs_desc, pt_row, t0 + (STAGES - 1) * BT, end,
               (i + STAGES - 1) % STAGES, h, oob_row, DW, NS, PAGE, NPG, SW)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        k_smem, v_smem, ks_smem, vs_smem = ring
        if t0 + BT > end:  # the tail step: V's scale rows past the prompt zeroed (the pool's bytes there are any)
            x = vs_smem.index(stage).load(zl)
            vs_smem.index(stage).store(gl.where(((t0 + tz) < end)[:, None], x, gl.zeros_like(x)))
            fence_async_shared()  # these generic writes are ordered before a later TMA refill of the slot
            gl.thread_barrier()
        ks = _scales(ks_smem.index(stage).slice(0, NS, dim=1), k_sl, op_a, BT, NS, False)
        kw = k_smem.index(stage).load(op_a)
        k0, k2 = _decode_half(kw, ks, _LO_ASM)
        s = mma_v2(k0, q0, gl.zeros([BT, GN], gl.float32, layout=mma))
        s = mma_v2(k2, q2, s)
        k1, k3 = _decode_half(kw, ks, _HI_ASM)
        s = mma_v2(k1, q1, s)
        s = mma_v2(k3, q3, s)
        s = gl.where(((t0 + ts) < end)[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        pb = gl.convert_layout(p.to(gl.float16), op_b)
        vs = _scales(vs_smem.index(stage).slice(0, NS, dim=1), v_sl, op_a, BT, NS, True)
        vw = v_smem.index(stage).permute((1, 0)).load(op_a)
        a2 = alpha[None, :]
        v0, v2 = _decode_half(vw, vs, _LO_ASM)
        acc0 = mma_v2(v0, pb, acc0 * a2)
        acc2 = mma_v2(v2, pb, acc2 * a2)
        v1, v3 = _decode_half(vw, vs, _HI_ASM)
        acc1 = mma_v2(v1, pb, acc1 * a2)
        acc3 = mma_v2(v3, pb, acc3 * a2)

    inv = (out_scale / l_i)[None, :]
    _store_out(O_PART, LSE_PART, b, split, h, acc0 * inv, acc1 * inv, acc2 * inv, acc3 * inv, m_i + gl.log2(l_i),
               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW, mma)
