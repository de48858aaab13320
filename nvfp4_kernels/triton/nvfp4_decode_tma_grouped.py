"""NVFP4 decode attention for Hopper, the TMA kernel with the KV heads that share block-scale sectors in one CTA.

The pool stores each token's block scales of all KV heads side by side (``[P, PAGE, HK, D/16]``): at D 128 a 32-byte
DRAM sector holds one token's scales of 4 heads. The one-head programs of ``nvfp4_decode_tma`` each read their
head's 8 bytes (inside a 16-byte TMA box row), so a sector comes from DRAM once per head program that misses it in
L2. The programs start together but drift apart by more than L2 holds: Nsight Compute measured DRAM reads of
1.19 / 1.32 / 1.23 / 1.07x the pages' bytes for the lean step at 32 programs per SM (44 x 32K / 84 x 32K / 10 x 160K /
128 x 4K, one H100), 1.04-1.12x for the kept step at 12 (docs/benchmarks/kernel-notes.md).

Here a CTA holds KV heads 4g .. 4g+3 of one (split, sequence), through ``gl.warp_specialize``:
  - the default partition (4 warps, 24 registers a thread after setmaxnreg) issues every TMA copy: per page of a
    step, each head's K and V codes (box [PAGE, D/4], into the head's own ring slot) and the 4 heads' scale rows
    once (box [PAGE, 32] bytes: whole sectors) into scale rings the heads share;
  - a one-warp partition per head runs ``attend``'s step on its slot and its 8 scale bytes at ``W * D/16``, and
    stores its own partial output and LSE.
Per ring slot, ``full`` counts the copy partition's arrival and the slot's bytes; ``empty`` counts the 4 heads that
have read it, and the copy partition waits for it before refilling the slot. A head zeroes only its own V scale
bytes on the tail step (disjoint bytes of the shared rows).

Measured on an H100 (``probe_tma``, configs ``:hg4``): DRAM reads equal the pages' bytes (1.000-1.003x), but the
heads advance in lockstep behind one copy partition, and at 3 CTAs (12 heads) per SM the best tiling (16-token
steps, 4 stages, lean step) reads at 75-78% of copy where the one-head kept step reads at 80-82%. Not a default:
a config chooses it (``DecodeConfig.head_group``). D 128 only, KV heads a multiple of 4.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from nvfp4_kernels.triton.gluon_decode_step import (
    ACC_LAYOUT,
    SCALE_BUFFER,
    attend,
    fresh_state,
    load_q,
    store_empty,
    store_out,
    total_sums,
)
from nvfp4_kernels.triton.nvfp4_decode import PLAN_INTS
from nvfp4_kernels.triton.nvfp4_decode_tma import pool_row

# each head partition's registers a thread (setmaxnreg; the step needs 128-131): with the copy partition's 24, the
# 8 warps fit the launch's cap of decode_choice.GROUPED_MAX_REGISTERS = (4 * 24 + 4 * 136) / 8 = 80
PARTITION_REGISTERS = gl.constexpr(136)


@gluon.jit
def _produce(k_ring, v_ring, ks_ring, vs_ring, full, empty, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE, stride_ptb,
             b, g, start, end, oob_row, D: gl.constexpr, PAGE: gl.constexpr, NPG: gl.constexpr, STAGES: gl.constexpr,
             HG: gl.constexpr):
    """The default partition: every step's TMA copies, into ring slot i % STAGES once the HG heads have read it
    (``empty``): each head's K and V codes (box [PAGE, D/4] per page, into the head's own ring) and the HG heads'
    scale rows (box [PAGE, HG*D/16], whole 32-byte sectors, into the shared rings). Pages past ``end`` (the last
    step's) are read at ``oob_row``: zeros, and the full byte count."""
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    SWG: gl.constexpr = HG * NS
    BT: gl.constexpr = NPG * PAGE
    pt_row = PAGE_TABLE + b * stride_ptb
    for i in range(gl.cdiv(end - start, BT)):
        stage = i % STAGES
        if i >= STAGES:
            mbarrier.wait(empty.index(stage), ((i - STAGES) // STAGES) & 1)
        bar = full.index(stage)
        mbarrier.expect(bar, NPG * PAGE * (HG * 4 * DW + 2 * SWG))
        for j in gl.static_range(NPG):
            row = pool_row(pt_row, start + i * BT + j * PAGE, end, oob_row, PAGE)
            for w in gl.static_range(HG):
                h = g * HG + w
                tma.async_copy_global_to_shared(k_desc, [row, h * DW], bar,
                                                k_ring.index(w * STAGES + stage).slice(j * PAGE, PAGE))
                tma.async_copy_global_to_shared(v_desc, [row, h * DW], bar,
                                                v_ring.index(w * STAGES + stage).slice(j * PAGE, PAGE))
            tma.async_copy_global_to_shared(ks_desc, [row, g * SWG], bar, ks_ring.index(stage).slice(j * PAGE, PAGE))
            tma.async_copy_global_to_shared(vs_desc, [row, g * SWG], bar, vs_ring.index(stage).slice(j * PAGE, PAGE))


@gluon.jit
def _head(W: gl.constexpr, k_ring, v_ring, ks_ring, vs_ring, full, empty, kbufs, vbufs, Q, O_PART, LSE_PART, qk_scale,
          out_scale, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, b, g, split, start,
          end, G: gl.constexpr, GN: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, NPG: gl.constexpr,
          STAGES: gl.constexpr, HG: gl.constexpr, LEAN: gl.constexpr):
    """Worker partition W (one warp): KV head g*HG + W over the split's tokens [start, end) from the rings, its
    partial output and LSE stored."""
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    SOFF: gl.constexpr = W * NS
    BT: gl.constexpr = NPG * PAGE
    h = g * HG + W
    q0, q1, q2, q3 = load_q(Q, b, h, stride_qb, stride_qh, G, GN, DW)
    if LEAN:
        bufs = (kbufs.slice(W * BT, BT), vbufs.slice(W * (BT // 2), BT // 2))
    else:
        bufs = None
    zl: gl.constexpr = gl.BlockedLayout([1, NS], [32, 1], [1, 1], [1, 0])  # a scale row per lane
    tz = gl.arange(0, BT, layout=gl.SliceLayout(1, zl))
    m_i, l_i, acc0, acc1, acc2, acc3 = fresh_state(GN, DW, BT, LEAN)
    for i in range(gl.cdiv(end - start, BT)):
        t0 = start + i * BT
        stage = i % STAGES
        mbarrier.wait(full.index(stage), (i // STAGES) & 1)
        ks_slot = ks_ring.index(stage).slice(SOFF, NS, dim=1)
        vs_slot = vs_ring.index(stage).slice(SOFF, NS, dim=1)
        if t0 + BT > end:  # the tail step: this head's V scale bytes past the prompt zeroed (the pool's are any)
            x = vs_slot.load(zl)
            vs_slot.store(gl.where(((t0 + tz) < end)[:, None], x, gl.zeros_like(x)))
            gl.thread_barrier()
        m_i, l_i, acc0, acc1, acc2, acc3 = attend(
            k_ring.index(W * STAGES + stage), ks_slot, v_ring.index(W * STAGES + stage), vs_slot, q0, q1, q2, q3, t0,
            end, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, BT, GN, NS, LEAN, bufs)
        fence_async_shared()  # this warp's reads (and tail writes) of the slot ordered before its TMA refill
        gl.thread_barrier()  # every lane of this warp is past its reads of the slot
        mbarrier.arrive(empty.index(stage))

    if start >= end:  # no token in this split: a zero row and lse -inf (the merge weighs it 0)
        store_empty(O_PART, LSE_PART, b, split, h, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW)
    else:
        tot = total_sums(l_i, LEAN)
        inv = (out_scale / tot)[None, :]
        store_out(O_PART, LSE_PART, b, split, h, acc0 * inv, acc1 * inv, acc2 * inv, acc3 * inv, m_i + gl.log2(tot),
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW, ACC_LAYOUT)


@gluon.jit(do_not_specialize=PLAN_INTS)  # one compile for every batch shape (nvfp4_decode.py)
def nvfp4_decode_tma_grouped_kernel(
    Q, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE, SEQ_LENS, O_PART, LSE_PART,
    qk_scale, out_scale,
    stride_qb, stride_qh, stride_ptb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    chunk_tokens, oob_row,
    HK: gl.constexpr, G: gl.constexpr, GN: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
    NPG: gl.constexpr, STAGES: gl.constexpr, LEAN: gl.constexpr,
):
    """Grid (HK / 4, splits, batch). Descriptors: k/v [P*PAGE, HK*D/4] int16, box [PAGE, D/4]; ks/vs
    [P*PAGE, HK*D/16] uint8, box [PAGE, 4*D/16] = [PAGE, 32]. ``oob_row`` = P*PAGE. num_warps=4 (the copy
    partition, ``_produce``) plus a one-warp partition per head (``_head``): 8 warps."""
    HG: gl.constexpr = 4  # decode_choice.GROUPED_HEADS: the heads of one scale sector at D 128
    W0: gl.constexpr = 0  # the partitions' indices
    W1: gl.constexpr = 1
    W2: gl.constexpr = 2
    W3: gl.constexpr = 3
    DW: gl.constexpr = D // 4
    NS: gl.constexpr = D // 16
    BT: gl.constexpr = NPG * PAGE
    gl.static_assert(D == 128, "the grouped TMA decode is built for head_dim 128 (4 heads per scale sector)")

    g = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    start = split * chunk_tokens
    end = gl.minimum(gl.load(SEQ_LENS + b), start + chunk_tokens)
    # a split past its sequence's end: no copy issued (_produce), an empty row stored per head (_head)
    k_ring = gl.allocate_shared_memory(gl.int16, [HG * STAGES, BT, DW], k_desc.layout)
    v_ring = gl.allocate_shared_memory(gl.int16, [HG * STAGES, BT, DW], v_desc.layout)
    ks_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BT, HG * NS], ks_desc.layout)
    vs_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BT, HG * NS], vs_desc.layout)
    kbufs = gl.allocate_shared_memory(gl.float16, [HG * BT, 2, NS // 2, 2], SCALE_BUFFER)  # a head's: BT rows
    vbufs = gl.allocate_shared_memory(gl.float16, [HG * BT // 2, 2, NS // 2, 2], SCALE_BUFFER)  # BT // 2 rows
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for si in gl.static_range(STAGES):
        mbarrier.init(full.index(si), count=1)
        mbarrier.init(empty.index(si), count=HG)
    fence_async_shared()

    # each partition's arguments written out in place (the four head tuples differ only in W): constexprs in a
    # tuple kept in a variable arrive in the partition as tensors, so the tuple cannot be built once
    gl.warp_specialize([
        (_produce, (k_ring, v_ring, ks_ring, vs_ring, full, empty, k_desc, ks_desc, v_desc, vs_desc, PAGE_TABLE,
                    stride_ptb, b, g, start, end, oob_row, D, PAGE, NPG, STAGES, HG)),
        (_head, (W0, k_ring, v_ring, ks_ring, vs_ring, full, empty, kbufs, vbufs, Q, O_PART, LSE_PART, qk_scale,
                 out_scale, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, b, g, split,
                 start, end, G, GN, D, PAGE, NPG, STAGES, HG, LEAN)),
        (_head, (W1, k_ring, v_ring, ks_ring, vs_ring, full, empty, kbufs, vbufs, Q, O_PART, LSE_PART, qk_scale,
                 out_scale, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, b, g, split,
                 start, end, G, GN, D, PAGE, NPG, STAGES, HG, LEAN)),
        (_head, (W2, k_ring, v_ring, ks_ring, vs_ring, full, empty, kbufs, vbufs, Q, O_PART, LSE_PART, qk_scale,
                 out_scale, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, b, g, split,
                 start, end, G, GN, D, PAGE, NPG, STAGES, HG, LEAN)),
        (_head, (W3, k_ring, v_ring, ks_ring, vs_ring, full, empty, kbufs, vbufs, Q, O_PART, LSE_PART, qk_scale,
                 out_scale, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, b, g, split,
                 start, end, G, GN, D, PAGE, NPG, STAGES, HG, LEAN)),
    ], [1, 1, 1, 1], [PARTITION_REGISTERS, PARTITION_REGISTERS, PARTITION_REGISTERS, PARTITION_REGISTERS])
