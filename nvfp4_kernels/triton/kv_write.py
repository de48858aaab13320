"""Quantize-on-write for FP8 E4M3 and BF16 pools: @triton.jit, bit-identical to nvfp4_kernels.backends.reference.

``kv_write_kernel``  rows of K and V [T, HK, D] (bf16/fp16/fp32, any token/head strides, contiguous last dim)
                     -> pool slots [P*S, HK, D] of both tensors in one launch (K and V of one dtype):
                     fp8_e4m3  the E4M3 byte of clamp(x / scale, -448, 448), round to nearest even
                               (nvfp4_kernels.fp8.quantize: a correctly rounded fp32 division); NaN stays NaN (0x7F
                               with the sign of x, as torch's cast writes it on the CPU)
                     bf16      x rounded to bf16, to nearest even; NaN stays NaN (0x7FC0: torch's NaN bits
                               differ between its CPU and GPU casts, so only NaN-ness is the contract)

Row r = (token r // HK, head r % HK) goes to pool row SLOTS[token] * HK + head. The roundings are integer ops
on the bits, so the bytes do not depend on the target's conversion instructions, and Triton's CPU interpreter
runs the same code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.nvfp4_quantize import e4m3_rne_signed_sat, slot_rows
from nvfp4_kernels.triton.pdl import pdl_enter


@triton.jit
def _e4m3_bytes(x, scale):
    """fp32 x -> E4M3 bytes of nvfp4_kernels.fp8.quantize(x, scale) (int32 holding 0..255)."""
    y = tl.math.div_rn(x, scale)
    ybits = y.to(tl.int32, bitcast=True)
    nan = (ybits & 0x7FFFFFFF) > 0x7F800000
    sign = ((ybits >> 31) & 1) << 7
    byte = e4m3_rne_signed_sat(tl.where(nan, 0.0, y))  # +-inf saturate to +-448
    return tl.where(nan, 0x7F | sign, byte)


@triton.jit
def _bf16_bits(x):
    """fp32 x -> the bf16 bits of x rounded to nearest even (int32 holding 0..65535); NaN -> 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)


@triton.jit
def _write_rows(X, POOL, t, h, row, col, r_ok, stride_t, stride_h, scale, D: tl.constexpr, FP8: tl.constexpr,
                X_IS_BF16: tl.constexpr):
    x = tl.load(X + (t.to(tl.int64) * stride_t + h * stride_h)[:, None] + col[None, :], mask=r_ok[:, None],
                other=0.0)
    dst = POOL + (row * D)[:, None] + col[None, :]
    if FP8:
        tl.store(dst, _e4m3_bytes(x.to(tl.float32), scale).to(tl.uint8), mask=r_ok[:, None])
    elif X_IS_BF16:
        tl.store(dst, x, mask=r_ok[:, None])
    else:
        tl.store(dst, _bf16_bits(x.to(tl.float32)).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=r_ok[:, None])


@triton.jit
def kv_write_kernel(
    K, V, SLOTS, POOL_K, POOL_V, num_rows, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HK: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr, X_IS_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """POOL_K[SLOTS[t], h] = enc(K[t, h]) and POOL_V likewise; POOL_* are uint8 (FP8) or bf16, contiguous.

    Program (i, j) writes row block i of K (j = 0) or of V (j = 1): K's and V's programs run side by side."""
    pdl_enter(PDL)
    is_v = tl.program_id(1) == 1
    r_ok, t, h, row = slot_rows(SLOTS, num_rows, HK, BLOCK_R)
    col = tl.arange(0, D)
    _write_rows(tl.where(is_v, V, K), tl.where(is_v, POOL_V, POOL_K), t, h, row, col, r_ok,
                tl.where(is_v, stride_vt, stride_kt), tl.where(is_v, stride_vh, stride_kh),
                tl.where(is_v, v_scale, k_scale), D, FP8, X_IS_BF16)
