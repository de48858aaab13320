"""NVFP4 quantize-on-write and the workspace dequant: @triton.jit kernels, bit-identical to nvfp4_kernels.nvfp4.

``nvfp4_quantize_kernel``  rows of K and V [T, HK, D] (bf16/fp16/fp32, one dtype, any token/head strides)
                           -> pool slots of both tensors in one launch (or of K alone): packed codes
                           [P*S, HK, D/2] uint8 and E4M3 scales [P*S, HK, D/16] (both contiguous);
                           with ``BLOCK_SELECT`` each block takes the scale code near amax/6 that
                           reconstructs it best, bit-identical to nvfp4_kernels.nvfp4_block_select (launch it with
                           ``enable_fp_fusion=False``: its error sums must not contract into FMAs).
``nvfp4_to_fp8_kernel``    pool slots -> FP8 workspace rows [N, HK, D]: fp8(dequant(code) / ws_scale).

Every fp32 operation follows the order fixed in nvfp4_kernels/nvfp4.py (two correctly rounded divisions for the
scale, one multiply for the denominator, a correctly rounded division per value) and the E4M3/E2M1
roundings are done with integer ops, so the result does not depend on the target's conversion
instructions (and the same code runs in Triton's CPU interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.pdl import pdl_enter


@triton.jit
def slot_rows(SLOTS, num_rows, HK: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's rows r = (token r // HK, head r % HK): (in range, token, head, pool row SLOTS[token] * HK
    + head as int64)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    t = r // HK
    h = r % HK
    slot = tl.load(SLOTS + t, mask=r_ok, other=0)
    return r_ok, t, h, slot.to(tl.int64) * HK + h


@triton.jit
def e4m3_rne_positive(s):
    """fp32 s in [0, 448] -> (E4M3 byte, its fp32 value), round to nearest even incl. subnormals."""
    bits = s.to(tl.int32, bitcast=True)
    # normal range (s >= 2**-6): keep 3 mantissa bits, ties to even; a carry bumps the exponent
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    byte_n = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    val_n = rb.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2**-9; rint via the 2**23 magic (exact, s * 512 < 8)
    k = (s * 512.0 + 8388608.0) - 8388608.0
    byte_s = k.to(tl.int32)
    val_s = k * 0.001953125  # 2**-9
    normal = s >= 0.015625  # 2**-6
    return tl.where(normal, byte_n, byte_s), tl.where(normal, val_n, val_s)


@triton.jit
def e2m1_code(y):
    """fp32 y -> E2M1 code 0..15: nearest magnitude with ties to the even code, |y| > 6 -> 6, sign bit of y."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return mag | (sign << 3)


@triton.jit
def e4m3_value_positive(byte):
    """E4M3 byte 0..0x7F without sign (int32) -> its fp32 value: exponent field 0 is subnormal (m * 2**-9)."""
    e = byte >> 3
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _codes_under(xb, sbyte, global_scale):
    """(E2M1 codes, dequantized fp32) of blocks ``xb`` [R, NS, 16] under E4M3 scale bytes ``sbyte`` [R, NS]
    (int32); a zero scale gives zero codes."""
    sval = e4m3_value_positive(sbyte)
    nonzero = sval != 0.0
    denom = tl.where(nonzero, sval * global_scale, 1.0)
    code = tl.where(nonzero[:, :, None], e2m1_code(tl.math.div_rn(xb, denom[:, :, None])), 0)
    c = code & 7
    mag = tl.where(c < 4, c.to(tl.float32) * 0.5, tl.where(c < 6, (c - 2).to(tl.float32), (c - 4).to(tl.float32) * 2.0))
    val = (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    return code, (val * sval[:, :, None]) * global_scale


@triton.jit
def _pairwise_sum16(e, R: tl.constexpr, NS: tl.constexpr):
    """Sum of each block's 16 values as nvfp4_kernels.nvfp4_block_select._pairwise_sum16 does: adjacent pairs, 4 levels."""
    a, b = tl.split(tl.reshape(e, [R, NS, 8, 2]))
    a, b = tl.split(tl.reshape(a + b, [R, NS, 4, 2]))
    a, b = tl.split(tl.reshape(a + b, [R, NS, 2, 2]))
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def _block_error(xb, sbyte, global_scale, R: tl.constexpr, NS: tl.constexpr):
    """Sum of squared reconstruction errors [R, NS] of blocks ``xb`` under scale bytes ``sbyte``."""
    _, dq = _codes_under(xb, sbyte, global_scale)
    e = dq - xb
    return _pairwise_sum16(e * e, R, NS)


@triton.jit
def _quantize_block(X, SLOTS, DATA, SCALES, num_rows, global_scale, stride_xt, stride_xh,
                    HK: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SELECT: tl.constexpr):
    """This program's rows r = (token r // HK, head r % HK) of X -> pool slot SLOTS[token], head h."""
    NS: tl.constexpr = D // 16
    r_ok, t, h, row = slot_rows(SLOTS, num_rows, HK, BLOCK_R)
    col = tl.arange(0, D)
    x = tl.load(X + (t.to(tl.int64) * stride_xt + h * stride_xh)[:, None] + col[None, :], mask=r_ok[:, None],
                other=0.0).to(tl.float32)
    xb = tl.reshape(x, [BLOCK_R, NS, 16])
    amax = tl.max(tl.abs(xb), 2)
    s32 = tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, 6.0), global_scale), 448.0)
    if BLOCK_SELECT:  # codes c6 + k, k in nvfp4_kernels.nvfp4_block_select.SCALE_OFFSETS, in that order
        c6, _ = e4m3_rne_positive(s32)
        err = _block_error(xb, c6, global_scale, BLOCK_R, NS)
        sbyte = c6
        for i in range(8):  # k = -1, 1, 2, ..., 7; a loop, not unrolled: one candidate's values live at a time
            k = tl.where(i == 0, -1, i)
            cand = tl.minimum(tl.maximum(c6 + k, 0), 0x7E)
            err_k = _block_error(xb, cand, global_scale, BLOCK_R, NS)
            better = err_k < err  # strict: a tie keeps the earlier code
            err = tl.where(better, err_k, err)
            sbyte = tl.where(better, cand, sbyte)
        code, _ = _codes_under(xb, sbyte, global_scale)  # only per-block errors stay live across candidates
    else:
        sbyte, sval = e4m3_rne_positive(s32)
        nonzero = sval != 0.0
        denom = tl.where(nonzero, sval * global_scale, 1.0)
        y = tl.math.div_rn(xb, denom[:, :, None])
        code = tl.where(nonzero[:, :, None], e2m1_code(y), 0)
    lo, hi = tl.split(tl.reshape(code, [BLOCK_R, D // 2, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    tl.store(DATA + (row * (D // 2))[:, None] + tl.arange(0, D // 2)[None, :], packed, mask=r_ok[:, None])
    tl.store(SCALES + (row * NS)[:, None] + tl.arange(0, NS)[None, :], sbyte.to(tl.uint8), mask=r_ok[:, None])


@triton.jit
def nvfp4_quantize_kernel(
    K, V, SLOTS, K_DATA, K_SCALES, V_DATA, V_SCALES, num_rows, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HK: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SELECT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Program (i, j): row block i of K (j = 0) or V (j = 1) -> that tensor's pool slots SLOTS[token], head h.

    A grid of (blocks, 2) writes K and V in one launch, their programs side by side; (blocks, 1) writes K only.
    K and V share a dtype (the pointer select needs one element type) and their pools share a layout."""
    pdl_enter(PDL)
    is_v = tl.program_id(1) == 1
    _quantize_block(tl.where(is_v, V, K), SLOTS, tl.where(is_v, V_DATA, K_DATA), tl.where(is_v, V_SCALES, K_SCALES),
                    num_rows, tl.where(is_v, v_scale, k_scale), tl.where(is_v, stride_vt, stride_kt),
                    tl.where(is_v, stride_vh, stride_kh), HK, D, BLOCK_R, BLOCK_SELECT)


@triton.jit
def e4m3_rne_signed_sat(x):
    """fp32 x (finite) -> E4M3 byte of clamp(x, -448, 448), round to nearest even, sign kept for zeros."""
    sign = ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 7
    byte, _ = e4m3_rne_positive(tl.minimum(tl.abs(x), 448.0))
    return byte | sign


@triton.jit
def nvfp4_to_fp8_kernel(
    DATA, SCALES, SLOTS, OUT, num_rows, global_scale, ws_scale,
    HK: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """OUT[i, h] = fp8((E2M1[code] * float(s)) * g / ws_scale) for row (i, h) of pool slot SLOTS[i]."""
    NS: tl.constexpr = D // 16
    r_ok, i, h, row = slot_rows(SLOTS, num_rows, HK, BLOCK_R)
    packed = tl.load(DATA + (row * (D // 2))[:, None] + tl.arange(0, D // 2)[None, :], mask=r_ok[:, None],
                     other=0).to(tl.int32)
    code = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_R, NS, 16])
    sb = tl.load(SCALES + (row * NS)[:, None] + tl.arange(0, NS)[None, :], mask=r_ok[:, None], other=0).to(tl.int32)
    s = e4m3_value_positive(sb & 0x7F)  # scales are >= 0
    # E2M1 magnitude: code&7 -> 0, .5, 1, 1.5, 2, 3, 4, 6 ; fp16-style bits give it exactly
    c = code & 7
    mag = tl.where(c < 4, c.to(tl.float32) * 0.5, tl.where(c < 6, (c - 2).to(tl.float32), (c - 4).to(tl.float32) * 2.0))
    v = (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # code 8 is -0.0
    val = (v * s[:, :, None]) * global_scale
    q = e4m3_rne_signed_sat(tl.math.div_rn(val, ws_scale))
    out_row = i.to(tl.int64) * HK + h
    tl.store(OUT + (out_row * D)[:, None] + tl.arange(0, D)[None, :], tl.reshape(q, [BLOCK_R, D]).to(tl.uint8),
             mask=r_ok[:, None])
