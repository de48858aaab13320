"""Fused NVFP4 decode attention (split-KV flash-decoding): the @triton.jit kernels.

One program = (kv head h, split s, sequence b). It walks the pages of its token range through the page
table, decodes the packed E2M1 codes of K and V in registers (``e2m1.e2m1x4``), applies the E4M3 block
scales with one fp16 multiply (E2M1 * E4M3 is exact in fp16), and runs QK and PV on tensor cores for the
G query heads of the group at once (padded to GP >= 16 rows). Never writes a dequantized cache.

Warp batches. A block of NW * BW tokens is split into NW slices of BW tokens; every tensor carries the
slice as its leading dim and the dots are batched over it, so each warp owns one slice with its own
running max / sum / accumulator (no cross-warp exchange inside the loop). The NW partial states are
merged once at the end.

Value order. A head of D values is read as D/4 int16 words; word j holds values 4j..4j+3 (nibble k =
value 4j+k). Both dots are split into 4 dots over the nibble index k, so no interleave is ever needed:

    S          = sum_k  Q[:, k::4] . K_k^T          K_k[t, j] = K[t, 4j+k]   (QK reduces over j)
    O[:, k::4] += P . V_k                           V_k[t, j] = V[t, 4j+k]   (PV reduces over tokens)

Scales folded in (the decoded values stay small exact fp16 numbers):
    qk_scale  = sm_scale * k_global * E2M1_FOLD * log2(e)
    out_scale = v_global * E2M1_FOLD
E2M1_FOLD is 2**14 for the software decode (values come out * 2**-14) and 1 for the hardware cvt.
Q enters the tensor cores as fp16: |q| must stay below 65504 (bf16 -> fp16 is exact above 2**-14).

Online softmax in base 2, per warp slice; the accumulators are rescaled every step (a conditional,
lazy rescale was measured 1.8x slower: the branch stops Triton's software pipelining of the loads).

Split-KV: split s covers tokens [s * chunk, (s+1) * chunk) of its sequence. The program writes its
normalised partial output and base-2 log-sum-exp; ``merge_kernel`` combines the splits. A program whose
range is empty writes lse = -inf and a zero row. Grids depend only on (B, num_splits, Hk), never on the
sequence lengths, so one CUDA graph per batch bucket (fixed max_pages) replays for any lengths.

One compile per model and tiling. The ints a plan derives from the batch shape (the table's row stride, the
split count and the partial buffers' strides that follow it) are not specialized (``PLAN_INTS``), and the merge
walks the splits in tiles of a few fixed sizes (``merge_tile``): every (batch, table width) a server meets runs one
decode binary and one merge binary per tile size, where Triton compiled a variant per value class of those ints
(4 decode and 16 merge variants over the 966 graph shapes of an H200 server at 256K context), each compile
stalling the batch that met it first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.e2m1 import e2m1x4

# The decode kernels' ints that follow the batch shape (see the module docstring); the partial buffers' other
# strides are multiples of D, so they specialize the same way for every shape.
PLAN_INTS = ("stride_ptb", "stride_lb", "stride_lh")
# ``merge_kernel`` merges splits in tiles of SPLIT_TILE rows ([tile, D] fp32 over ``merge_warps`` warps): the power
# of two that holds the plan's splits, from MIN_MERGE_TILE up to MERGE_ELEMENTS // D (128 at D 128; longer plans,
# 1 x 1M on 132 SMs: 395 splits, loop). A tile's work is paid whatever part of it holds splits: with one tile of 128
# for every plan, a 128 x 4K decode (3 splits, 4,096 merges of 16,384 elements) took 289 us on an H100, 265 with
# tiles sized to it. So the merge compiles once per tile size (four at D 128, five at D 64), not per split count.
MERGE_ELEMENTS = 16384
MIN_MERGE_TILE = 16


def merge_tile(num_splits: int, head_dim: int) -> int:
    """``merge_kernel``'s SPLIT_TILE for a plan of ``num_splits`` splits of head_dim ``head_dim``."""
    return min(MERGE_ELEMENTS // head_dim, max(MIN_MERGE_TILE, triton.next_power_of_2(num_splits)))


def merge_warps(tile: int, head_dim: int) -> int:
    """``merge_kernel``'s warps for a [tile, head_dim] tile: 64 elements a thread, 1 to 4 warps. A merge is a load
    round trip or two per program, and a 128 x 4K decode has 4,096 of them: one warp each fits them on the SMs at
    once where four warps each took two rounds."""
    return max(1, min(4, tile * head_dim // 2048))


@triton.jit
def _block_scales(ptrs, ok, NW: tl.constexpr, BW: tl.constexpr, NS: tl.constexpr, DW: tl.constexpr):
    """E4M3 scale bytes of [NW, BW] token rows -> fp16 [NW, BW, DW], one per code word (exact conversion).

    Read as bytes: a variant reading int16 pairs and converting with integer ops measured 1.45x slower.
    """
    s = tl.load(ptrs, mask=ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.broadcast_to(s[:, :, :, None], [NW, BW, NS, 4]), [NW, BW, DW])


@triton.jit
def _load_q(Q, q_row, g_ok, j, K_IDX: tl.constexpr):
    return tl.load(Q + q_row[:, None] + (4 * j + K_IDX)[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=PLAN_INTS)
def nvfp4_decode_kernel(
    Q, K16, KSF, V16, VSF, PAGE_TABLE, SEQ_LENS, O_PART, LSE_PART,
    qk_scale, out_scale,
    stride_qb, stride_qh, stride_ptb,
    stride_pb, stride_ph, stride_ps,  # O_PART [B, Hq, num_splits, D] fp32 (d stride 1)
    stride_lb, stride_lh,  # LSE_PART [B, Hq, num_splits] fp32 (split stride 1)
    chunk_tokens,
    HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    NW: tl.constexpr, BW: tl.constexpr, MODE: tl.constexpr,
):
    """Pool pages are contiguous: K16/V16 [P, PAGE, HK, D/4] int16, KSF/VSF [P, PAGE, HK, D/16] uint8."""
    h = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    DW: tl.constexpr = D // 4  # int16 code words per head row
    NS: tl.constexpr = D // 16  # block scales per head row
    BLOCK_N: tl.constexpr = NW * BW

    seq_len = tl.load(SEQ_LENS + b)
    start = split * chunk_tokens
    end = tl.minimum(seq_len, start + chunk_tokens)

    g = tl.arange(0, GP)
    g_ok = g < G
    hq = h * G + g
    j = tl.arange(0, DW)
    if start >= end:
        tl.store(O_PART + b * stride_pb + hq[:, None] * stride_ph + split * stride_ps + tl.arange(0, D)[None, :],
                 tl.zeros([GP, D], tl.float32), mask=g_ok[:, None])
        tl.store(LSE_PART + b * stride_lb + hq * stride_lh + split, tl.full([GP], float("-inf"), tl.float32),
                 mask=g_ok)
        return

    q_row = b * stride_qb + hq * stride_qh
    # q is converted to fp16 as loaded (exact for bf16 |q| in [2**-14, 65504]); a per-program rescale by
    # max|q| was measured to cost ~10% more instructions in the loop (the operands stop loading straight
    # into their dot layout), so the fp16 range of q is an input requirement of this kernel.
    q0 = tl.broadcast_to(_load_q(Q, q_row, g_ok, j, 0).to(tl.float16)[None, :, :], [NW, GP, DW])
    q1 = tl.broadcast_to(_load_q(Q, q_row, g_ok, j, 1).to(tl.float16)[None, :, :], [NW, GP, DW])
    q2 = tl.broadcast_to(_load_q(Q, q_row, g_ok, j, 2).to(tl.float16)[None, :, :], [NW, GP, DW])
    q3 = tl.broadcast_to(_load_q(Q, q_row, g_ok, j, 3).to(tl.float16)[None, :, :], [NW, GP, DW])
    scale2 = qk_scale

    m_i = tl.full([NW, GP], float("-inf"), tl.float32)
    l_i = tl.zeros([NW, GP], tl.float32)
    acc0 = tl.zeros([NW, GP, DW], tl.float32)
    acc1 = tl.zeros([NW, GP, DW], tl.float32)
    acc2 = tl.zeros([NW, GP, DW], tl.float32)
    acc3 = tl.zeros([NW, GP, DW], tl.float32)

    tk = tl.arange(0, NW)[:, None] * BW + tl.arange(0, BW)[None, :]  # [NW, BW] token offsets in a block
    sc = tl.arange(0, NS)
    pt_row = PAGE_TABLE + b * stride_ptb
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tk
        ok = tok < end
        page = tl.load(pt_row + tok // PAGE, mask=ok, other=0).to(tl.int64)
        tok_row = (page * PAGE + tok % PAGE) * HK + h  # row of the [P*PAGE*HK, ...] views
        ok3 = ok[:, :, None]

        kw = tl.load(K16 + (tok_row * DW)[:, :, None] + j[None, None, :], mask=ok3, other=0)
        ks = _block_scales(KSF + (tok_row * NS)[:, :, None] + sc[None, None, :], ok3, NW, BW, NS, DW)
        k0, k1, k2, k3 = e2m1x4(kw, MODE)
        s = tl.dot(q0, tl.permute(k0 * ks, (0, 2, 1)))
        s = tl.dot(q1, tl.permute(k1 * ks, (0, 2, 1)), s)
        s = tl.dot(q2, tl.permute(k2 * ks, (0, 2, 1)), s)
        s = tl.dot(q3, tl.permute(k3 * ks, (0, 2, 1)), s)
        s = tl.where(ok[:, None, :], s * scale2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp slice may not have seen a token yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        m_i = m_new
        a3 = alpha[:, :, None]
        p16 = p.to(tl.float16)

        vw = tl.load(V16 + (tok_row * DW)[:, :, None] + j[None, None, :], mask=ok3, other=0)
        vs = _block_scales(VSF + (tok_row * NS)[:, :, None] + sc[None, None, :], ok3, NW, BW, NS, DW)
        v0, v1, v2, v3 = e2m1x4(vw, MODE)
        acc0 = tl.dot(p16, v0 * vs, acc0 * a3)
        acc1 = tl.dot(p16, v1 * vs, acc1 * a3)
        acc2 = tl.dot(p16, v2 * vs, acc2 * a3)
        acc3 = tl.dot(p16, v3 * vs, acc3 * a3)

    # merge the NW warp slices: O = sum_w 2**(m_w - m) acc_w / sum_w 2**(m_w - m) l_w
    m = tl.max(m_i, 0)
    wgt = tl.exp2(m_i - m[None, :])
    l_tot = tl.sum(l_i * wgt, 0)
    inv = out_scale / l_tot
    w3 = wgt[:, :, None]
    base = O_PART + b * stride_pb + hq[:, None] * stride_ph + split * stride_ps + 4 * j[None, :]
    tl.store(base + 0, tl.sum(acc0 * w3, 0) * inv[:, None], mask=g_ok[:, None])
    tl.store(base + 1, tl.sum(acc1 * w3, 0) * inv[:, None], mask=g_ok[:, None])
    tl.store(base + 2, tl.sum(acc2 * w3, 0) * inv[:, None], mask=g_ok[:, None])
    tl.store(base + 3, tl.sum(acc3 * w3, 0) * inv[:, None], mask=g_ok[:, None])
    tl.store(LSE_PART + b * stride_lb + hq * stride_lh + split, m + tl.log2(l_tot), mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def merge_kernel(O_PART, LSE_PART, O, num_splits, stride_ob, stride_oh, D: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """out[b, hq] = sum_s 2**(lse_s - lse) * o_s, lse = log2(sum_s 2**lse_s): merge of the splits, SPLIT_TILE of them
    at a time with a running max (``merge_tile``). O_PART [B, Hq, num_splits, D] and LSE_PART [B, Hq, num_splits]
    fp32 are contiguous (the plan makes them), so their offsets follow from num_splits and D alone: no stride is an
    argument."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    row = (b * tl.num_programs(1) + hq).to(tl.int64) * num_splits  # this head's first split
    s = tl.arange(0, SPLIT_TILE)
    d = tl.arange(0, D)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        ok = s0 + s < num_splits
        lse = tl.load(LSE_PART + row + s0 + s, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty: weights stay 0
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        o = tl.load(O_PART + (row + s0 + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)
    tl.store(O + b * stride_ob + hq * stride_oh + d, out.to(O.dtype.element_ty))
