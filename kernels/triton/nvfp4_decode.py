"""Fused NVFP4 decode attention (split-KV flash-decoding): the @triton.jit kernels.

One program = (kv head h, split s, sequence b). It walks the pages of its token range through the page
table, decodes the packed E2M1 codes of K and V in registers (``e2m1.e2m1x4``), applies the E4M3 block
scales with one fp16 multiply (E2M1 * E4M3 is exact in fp16), and runs QK and PV on tensor cores for the
G query heads of the group at once (padded to GP >= 16 rows), with an online softmax in base 2.

Value order. A head of D values is read as D/4 int16 words; word j holds values 4j..4j+3 (nibble k =
value 4j+k). Both dots are split into 4 dots over the nibble index k, so no interleave is ever needed:

    S      = sum_k  Q[:, k::4] . K_k^T          K_k[t, j] = K[t, 4j+k]   (QK reduces over j)
    O[:, k::4] += P . V_k                       V_k[t, j] = V[t, 4j+k]   (PV reduces over tokens)

Scales folded in (so the decoded values stay small exact fp16 numbers):
    qk_scale  = sm_scale * k_global * E2M1_FOLD * log2(e)     (per program also * q_mult, see below)
    out_scale = v_global * E2M1_FOLD
E2M1_FOLD is 2**14 for the software decode (values come out * 2**-14) and 1 for the hardware cvt.
Q is converted to fp16 after dividing by q_mult = 2**ceil(log2(amax|q|)) of the group (exact), so any
bf16 query range fits fp16.

Split-KV: split s covers tokens [s * chunk, (s+1) * chunk) of its sequence. With SPLIT the program writes
its normalised partial output and base-2 log-sum-exp; ``merge_kernel`` combines the splits. A program
whose range is empty writes lse = -inf and a zero row. Grids depend only on (B, num_splits, Hk), never
on the sequence lengths, so one CUDA graph per batch bucket (fixed max_pages) replays for any lengths.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.e2m1 import e2m1x4


@triton.jit
def _load_q_part(Q, q_row, g_ok, j, K_IDX: tl.constexpr):
    return tl.load(Q + q_row[:, None] + (4 * j + K_IDX)[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _e4m3_to_f16(b):
    # fp16 with bits (b & 0x7F) << 7 is the E4M3 value * 2**-8 (subnormals included), exactly.
    return ((b & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _load_scales(ptrs, ok, BLOCK_N: tl.constexpr, NS: tl.constexpr, DW: tl.constexpr):
    """E4M3 block scales of BLOCK_N rows (read as int16 pairs) -> fp16 [BLOCK_N, DW], one per code word."""
    w = tl.load(ptrs, mask=ok[:, None], other=0).to(tl.int32)
    s = tl.join(_e4m3_to_f16(w), _e4m3_to_f16(w >> 8))  # [BLOCK_N, NS/2, 2]: blocks 2i, 2i+1
    return tl.reshape(tl.broadcast_to(s[:, :, :, None], [BLOCK_N, NS // 2, 2, 4]), [BLOCK_N, DW])


@triton.jit
def nvfp4_decode_kernel(
    Q, K16, KSF16, V16, VSF16, PAGE_TABLE, SEQ_LENS, O, O_PART, LSE_PART,
    qk_scale, out_scale,
    stride_qb, stride_qh,
    stride_ptb,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,  # O_PART [B, Hq, num_splits, D] fp32
    stride_lb, stride_lh,  # LSE_PART [B, Hq, num_splits] fp32 (split stride 1)
    chunk_tokens,
    HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, SPLIT: tl.constexpr,
):
    h = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    DW: tl.constexpr = D // 4  # int16 words per head row
    NS: tl.constexpr = D // 16  # block scales per head row

    seq_len = tl.load(SEQ_LENS + b)
    start = split * chunk_tokens
    end = tl.minimum(seq_len, start + chunk_tokens)

    g = tl.arange(0, GP)
    g_ok = g < G
    j = tl.arange(0, DW)
    hq = h * G + g
    q_row = b * stride_qb + hq * stride_qh

    if start >= end:
        if SPLIT:
            dcol = tl.arange(0, D)
            tl.store(O_PART + b * stride_pb + hq[:, None] * stride_ph + split * stride_ps + dcol[None, :],
                     tl.zeros([GP, D], tl.float32), mask=g_ok[:, None])
            tl.store(LSE_PART + b * stride_lb + hq * stride_lh + split,
                     tl.full([GP], float("-inf"), tl.float32), mask=g_ok)
        return

    q0 = _load_q_part(Q, q_row, g_ok, j, 0)
    q1 = _load_q_part(Q, q_row, g_ok, j, 1)
    q2 = _load_q_part(Q, q_row, g_ok, j, 2)
    q3 = _load_q_part(Q, q_row, g_ok, j, 3)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0)), tl.max(tl.abs(q1))),
                      tl.maximum(tl.max(tl.abs(q2)), tl.max(tl.abs(q3))))
    q_mult = tl.where(amax > 0, tl.exp2(tl.ceil(tl.log2(tl.maximum(amax, 1e-30)))), 1.0)
    q0 = (q0 / q_mult).to(tl.float16)
    q1 = (q1 / q_mult).to(tl.float16)
    q2 = (q2 / q_mult).to(tl.float16)
    q3 = (q3 / q_mult).to(tl.float16)
    scale2 = qk_scale * q_mult

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, DW], tl.float32)
    acc1 = tl.zeros([GP, DW], tl.float32)
    acc2 = tl.zeros([GP, DW], tl.float32)
    acc3 = tl.zeros([GP, DW], tl.float32)

    n = tl.arange(0, BLOCK_N)
    sc = tl.arange(0, NS // 2)
    pt_row = PAGE_TABLE + b * stride_ptb
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + n
        ok = tok < end
        page = tl.load(pt_row + tok // PAGE, mask=ok, other=0).to(tl.int64)
        slot = tok % PAGE
        # pool pages are contiguous [P, PAGE, HK, D/4] int16 and [P, PAGE, HK, D/16] bytes
        tok_row = (page * PAGE + slot) * HK + h
        row16 = tok_row * DW
        rows = tok_row * (NS // 2)

        kw = tl.load(K16 + row16[:, None] + j[None, :], mask=ok[:, None], other=0)
        ks = _load_scales(KSF16 + rows[:, None] + sc[None, :], ok, BLOCK_N, NS, DW)
        k0, k1, k2, k3 = e2m1x4(kw, MODE)
        s = tl.dot(q0, tl.trans(k0 * ks))
        s = tl.dot(q1, tl.trans(k1 * ks), s)
        s = tl.dot(q2, tl.trans(k2 * ks), s)
        s = tl.dot(q3, tl.trans(k3 * ks), s)
        s = tl.where(ok[None, :], s * scale2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p16 = p.to(tl.float16)

        vw = tl.load(V16 + row16[:, None] + j[None, :], mask=ok[:, None], other=0)
        vs = _load_scales(VSF16 + rows[:, None] + sc[None, :], ok, BLOCK_N, NS, DW)
        v0, v1, v2, v3 = e2m1x4(vw, MODE)
        acc0 = tl.dot(p16, v0 * vs, acc0 * alpha[:, None])
        acc1 = tl.dot(p16, v1 * vs, acc1 * alpha[:, None])
        acc2 = tl.dot(p16, v2 * vs, acc2 * alpha[:, None])
        acc3 = tl.dot(p16, v3 * vs, acc3 * alpha[:, None])

    inv_l = out_scale / l_i
    if SPLIT:
        base = O_PART + b * stride_pb + hq[:, None] * stride_ph + split * stride_ps + 4 * j[None, :]
        tl.store(base + 0, acc0 * inv_l[:, None], mask=g_ok[:, None])
        tl.store(base + 1, acc1 * inv_l[:, None], mask=g_ok[:, None])
        tl.store(base + 2, acc2 * inv_l[:, None], mask=g_ok[:, None])
        tl.store(base + 3, acc3 * inv_l[:, None], mask=g_ok[:, None])
        tl.store(LSE_PART + b * stride_lb + hq * stride_lh + split, m_i + tl.log2(l_i), mask=g_ok)
    else:
        base = O + b * stride_ob + hq[:, None] * stride_oh + 4 * j[None, :]
        ty = O.dtype.element_ty
        tl.store(base + 0, (acc0 * inv_l[:, None]).to(ty), mask=g_ok[:, None])
        tl.store(base + 1, (acc1 * inv_l[:, None]).to(ty), mask=g_ok[:, None])
        tl.store(base + 2, (acc2 * inv_l[:, None]).to(ty), mask=g_ok[:, None])
        tl.store(base + 3, (acc3 * inv_l[:, None]).to(ty), mask=g_ok[:, None])


@triton.jit
def merge_kernel(
    O_PART, LSE_PART, O, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    D: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    """out[b, hq] = sum_s 2**(lse_s - lse) * o_s with lse = log2(sum_s 2**lse_s): merge of the splits."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, D)
    s_ok = s < num_splits
    lse = tl.load(LSE_PART + b * stride_lb + hq * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(O_PART + b * stride_pb + hq * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_ok[:, None], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(O + b * stride_ob + hq * stride_oh + d, out.to(O.dtype.element_ty))
