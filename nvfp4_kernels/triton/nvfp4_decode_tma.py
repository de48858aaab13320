"""NVFP4 decode attention for Hopper, the Gluon kernel fed by TMA: one bulk copy per page and part.

The default NVFP4 decode on Hopper where its geometry fits (``tma_fits`` in nvfp4_kernels/backends/decode_kernels.py).
The program and each step's math are ``gluon_decode_step``'s, as for the cp.async kernel (``nvfp4_decode_gluon``:
one warp per program = (kv head h, split s, sequence b), transposed MMAs, split-KV partials merged by
``merge_kernel``); only the loads differ. There, 32 lanes
compute a row address each and issue 16- and 8-byte cp.async copies per step. Here one thread issues, per page
of a step, four TMA copies (2-D boxes through tensor maps made on the host):

  - K and V codes: the pool viewed as [P*PAGE, HK*D/4] int16, box [PAGE, D/4] at (page*PAGE, h*D/4): a head's
    rows of one page (D/2 bytes each at the HK*D/2-byte token stride), landing 64-byte swizzled
    (``NVMMASharedLayout``), which is the layout ldmatrix reads without bank conflicts;
  - K and V block scales: the pool viewed as [P*PAGE, HK*D/16] uint8, box [PAGE, SW] at (page*PAGE, c),
    SW = max(16, D/16) bytes (a TMA box row is 16 bytes at least). A box's innermost coordinate must be 16-byte
    aligned (else the copy faults as an illegal instruction), so c = h*D/16 rounded down to a multiple of SW and
    this head's D/16 bytes lie at SOFF = h*D/16 - c inside each row (the neighbouring heads' bytes beside them).
    SOFF is a compile-time slice offset: the loop is compiled once per offset (SW / (D/16) of them: 2 at D 128,
    1 from D 256) and each program runs the one of its head.

Each ring slot has an mbarrier that counts the slot's bytes in. Pages past the split's end are read at a row
past the pool (TMA fills them with zeros), so every copy of a step completes the same byte count. Token slots
past ``end`` inside the last page hold whatever the pool has there: S is masked to -inf for them (so K's values
never matter), and V's scales are zeroed for them on the tail step (E2M1 codes are finite, so those V rows
decode to 0 and P = 0 multiplies 0, never NaN).

Fewer, larger memory requests are what it buys: 8 bulk copies per 32 tokens instead of about 10 warp-wide cp.async
instructions of 32 addresses each (L2 was the busiest unit of the cp.async kernel). docs/benchmarks/kernels.md has
the measurements. The tensor maps are passed by value (``__grid_constant__``), so a captured CUDA graph replays
with the pool they were made for; the pool tensors of an engine never move.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from nvfp4_kernels.triton.gluon_decode_step import (
    ACC_LAYOUT,
    attend,
    fresh_state,
    load_q,
    scale_buffers,
    split_range,
    store_empty,
    store_out,
    total_sums,
)
from nvfp4_kernels.triton.nvfp4_decode import PLAN_INTS


@gluon.jit
def pool_row(pt_row, tok, end, oob_row, PAGE: gl.constexpr):
    """The first pool row of the page holding token ``tok`` of the sequence whose page-table row is ``pt_row``, or
    ``oob_row`` (a row past the pool: TMA reads zeros there) for a token at or past ``end``."""
    page = gl.load(pt_row + tok // PAGE, mask=tok < end, other=-1)
    return gl.where(tok < end, page * PAGE, oob_row)


@gluon.jit
def _issue(ring, bars, k_desc, v_desc, ks_desc, vs_desc, pt_row, t0, end, stage, h, oob_row,
           DW: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr, NPG: gl.constexpr, SW: gl.constexpr,
           SOFF: gl.constexpr, LEAN: gl.constexpr):
    """TMA copies of tokens [t0, t0 + NPG*PAGE) of head h into ring slot ``stage`` (nothing when t0 >= end; with
    LEAN issued anyway: pages past ``end`` read at ``oob_row`` give zeros and the full byte count, and ``_run``
    waits for those STAGES - 1 issues after its last step)."""
    k_smem, v_smem, ks_smem, vs_smem = ring
    if LEAN:
        live = True
    else:
        live = t0 < end
    bar = bars.index(stage)
    mbarrier.expect(bar, NPG * PAGE * (4 * DW + 2 * SW), pred=live)
    for j in gl.static_range(NPG):
        row = pool_row(pt_row, t0 + j * PAGE, end, oob_row, PAGE)
        tma.async_copy_global_to_shared(k_desc, [row, h * DW], bar, k_smem.index(stage).slice(j * PAGE, PAGE), pred=live)
        tma.async_copy_global_to_shared(v_desc, [row, h * DW], bar, v_smem.index(stage).slice(j * PAGE, PAGE), pred=live)
        tma.async_copy_global_to_shared(ks_desc, [row, h * NS - SOFF], bar,
                                        ks_smem.index(stage).slice(j * PAGE, PAGE), pred=live)
        tma.async_copy_global_to_shared(vs_desc, [row, h * NS - SOFF], bar,
                                        vs_smem.index(stage).slice(j * PAGE, PAGE), pred=live)


@gluon.jit
def _run(ring, bars, bufs, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE, b, h, start, end, oob_row, q0, q1, q2, q3,
         qk_scale, stride_ptb, GN: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, NPG: gl.constexpr,
         STAGES: gl.constexpr, SW: gl.constexpr, SOFF: gl.constexpr, LEAN: gl.constexpr):
    """The split's tokens [start, end) of head h through the TMA ring (``ring``, ``bars``: fresh), this head's
    scales at byte SOFF of each scale row. Returns the softmax state and accumulators."""
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    BT: gl.constexpr = NPG * PAGE
    zl: gl.constexpr = gl.BlockedLayout([1, SW], [32, 1], [1, 1], [1, 0])  # a scale row per lane
    pt_row = PAGE_TABLE + b * stride_ptb
    for i in gl.static_range(STAGES - 1):
        _issue(ring, bars, k_desc, v_desc, ks_desc, vs_desc, pt_row, start + i * BT, end, i, h, oob_row,
               DW, NS, PAGE, NPG, SW, SOFF, LEAN)

    tz = gl.arange(0, BT, layout=gl.SliceLayout(1, zl))
    m_i, l_i, acc0, acc1, acc2, acc3 = fresh_state(GN, DW, BT, LEAN)
    for i in range(gl.cdiv(end - start, BT)):
        t0 = start + i * BT
        stage = i % STAGES
        gl.thread_barrier()  # every lane has read slot (i - 1) % STAGES (its values consumed) before TMA refills it
        _issue(ring, bars, k_desc, v_desc, ks_desc, vs_desc, pt_row, t0 + (STAGES - 1) * BT, end,
               (i + STAGES - 1) % STAGES, h, oob_row, DW, NS, PAGE, NPG, SW, SOFF, LEAN)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        k_smem, v_smem, ks_smem, vs_smem = ring
        if t0 + BT > end:  # the tail step: V's scale rows past the prompt zeroed (the pool's bytes there are any)
            x = vs_smem.index(stage).load(zl)
            vs_smem.index(stage).store(gl.where(((t0 + tz) < end)[:, None], x, gl.zeros_like(x)))
            fence_async_shared()  # these generic writes are ordered before a later TMA refill of the slot
            gl.thread_barrier()
        m_i, l_i, acc0, acc1, acc2, acc3 = attend(
            k_smem.index(stage), ks_smem.index(stage).slice(SOFF, NS, dim=1), v_smem.index(stage),
            vs_smem.index(stage).slice(SOFF, NS, dim=1), q0, q1, q2, q3, t0, end, qk_scale, m_i, l_i, acc0, acc1, acc2,
            acc3, BT, GN, NS, LEAN, bufs)
    if LEAN:  # the copies issued past the last step have landed before the program's shared memory is freed
        n = gl.cdiv(end - start, BT)
        for j in gl.static_range(STAGES - 1):
            mbarrier.wait(bars.index((n + j) % STAGES), ((n + j) // STAGES) & 1)

    return m_i, l_i, acc0, acc1, acc2, acc3


@gluon.jit(do_not_specialize=PLAN_INTS)  # one compile for every batch shape (nvfp4_decode.py)
def nvfp4_decode_tma_kernel(
    Q, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE, SEQ_LENS, O_PART, LSE_PART,
    qk_scale, out_scale,
    stride_qb, stride_qh, stride_ptb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    chunk_tokens, oob_row,
    HK: gl.constexpr, G: gl.constexpr, GN: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
    NPG: gl.constexpr, STAGES: gl.constexpr, SW: gl.constexpr, LEAN: gl.constexpr,
):
    """Descriptors: k/v [P*PAGE, HK*D/4] int16, box [PAGE, D/4]; ks/vs [P*PAGE, HK*D/16] uint8, box [PAGE, SW]
    (HK*D/16 a multiple of SW). ``oob_row`` = P*PAGE (a row past the pool). num_warps=1."""
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    BT: gl.constexpr = NPG * PAGE

    h, split, b, start, end = split_range(SEQ_LENS, chunk_tokens)
    if start >= end:
        store_empty(O_PART, LSE_PART, b, split, h, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW)
        return
    q0, q1, q2, q3 = load_q(Q, b, h, stride_qb, stride_qh, G, GN, DW)

    ring = (gl.allocate_shared_memory(gl.int16, [STAGES, BT, DW], k_desc.layout),
            gl.allocate_shared_memory(gl.int16, [STAGES, BT, DW], v_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BT, SW], ks_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BT, SW], vs_desc.layout))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for si in gl.static_range(STAGES):
        mbarrier.init(bars.index(si), count=1)
    fence_async_shared()
    if LEAN:
        bufs = scale_buffers(BT, NS)
    else:
        bufs = None
    m_i, l_i, acc0, acc1, acc2, acc3 = fresh_state(GN, DW, BT, LEAN)
    for v in gl.static_range(SW // NS):  # the loop compiled for each offset of a head's scales in a box row
        if (h * NS) % SW == v * NS:
            m_i, l_i, acc0, acc1, acc2, acc3 = _run(
                ring, bars, bufs, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE, b, h, start, end, oob_row, q0, q1, q2,
                q3, qk_scale, stride_ptb, GN, D, PAGE, NPG, STAGES, SW, v * NS, LEAN)

    l_i = total_sums(l_i, LEAN)
    inv = (out_scale / l_i)[None, :]
    store_out(O_PART, LSE_PART, b, split, h, acc0 * inv, acc1 * inv, acc2 * inv, acc3 * inv, m_i + gl.log2(l_i),
               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW, ACC_LAYOUT)
