"""Per-head q/k RMSNorm (Qwen3) and neox RoPE in one pass over the merged QKV output: @triton.jit code only
(wrapper: nvfp4_kernels/fused_ops.py).

``qk_norm_rope_kernel``  grid (T, 3): program (t, 0) does the q heads of token t, (t, 1) the k heads, (t, 2)
                         copies the v heads:

    QKV[t] = [ q head 0 .. HQ-1 | k head 0 .. HK-1 | v head 0 .. HK-1 ]   (each D values)
    q/k head x:  HAS_NORM: x = round(w * round(x * rsqrt(mean(x^2) + eps)))     (w: q_norm or k_norm)
                 x1, x2 = x[:D/2], x[D/2:];  c, s = COS[pos[t]], SIN[pos[t]]       (fp32 tables [P, D/2])
                 out = round([x1 c - x2 s, x2 c + x1 s])   -> Q [T, HQ, D] / K [T, HK, D]
    v heads:     copied to V [T, HK, D]

    ROTATE (--kv-rotation): every q, k and v head then leaves as round(round(head) @ U * rot_scale), R = U *
                 rot_scale the rotation (nvfp4_kernels/model_ops.py HeadRotation): U's entries are exact in the model
                 dtype, so the product runs on tf32 tensor cores exactly, with fp32 sums (IEEE fp32 for an fp32 model)

fp32 math; ``round`` is to the output dtype (nvfp4_kernels/triton/rounding.py) where the PyTorch reference
(nvfp4_kernels/model_ops.py) rounds. Head counts and D/2 are padded to powers of two (H_P, HALF_P) and masked; with
ROTATE, D is a power of two >= 32 and H_P >= 16 (the tensor-core tile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.pdl import pdl_enter
from nvfp4_kernels.triton.rounding import round_to


@triton.jit
def _dot(a, b, acc, DT: tl.constexpr):
    """acc + a @ b for fp32 tiles holding DT values. bf16 and fp16 values are exact in tf32 (10 stored mantissa
    bits), so tf32 tensor cores multiply them exactly; fp32 values take IEEE fp32."""
    if DT == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision="tf32")


@triton.jit
def _store_heads(x1, x2, dst, heads, half, m, U, rot_scale, H: tl.constexpr, D: tl.constexpr,
                 HALF_P: tl.constexpr, ROTATE: tl.constexpr):
    """Heads whose halves x1, x2 [H_P, HALF_P] hold values of dst's dtype -> dst, rotated when ROTATE."""
    dt = dst.dtype.element_ty
    if ROTATE:
        cols = tl.arange(0, D)[None, :]
        u_rows = tl.arange(0, HALF_P)[:, None] * D
        acc = _dot(x1, tl.load(U + u_rows + cols).to(tl.float32), tl.zeros([x1.shape[0], D], tl.float32), dt)
        acc = _dot(x2, tl.load(U + (D // 2) * D + u_rows + cols).to(tl.float32), acc, dt)
        tl.store(dst + heads * D + cols, round_to(acc * rot_scale, dt).to(dt), mask=heads < H)
    else:
        lo = heads * D + half
        tl.store(dst + lo, x1.to(dt), mask=m)
        tl.store(dst + lo + D // 2, x2.to(dt), mask=m)


@triton.jit
def _norm_rope_heads(src, W, dst, cos_row, sin_row, eps, U, rot_scale, H: tl.constexpr, H_P: tl.constexpr,
                     D: tl.constexpr, HALF_P: tl.constexpr, HAS_NORM: tl.constexpr, ROTATE: tl.constexpr):
    """Heads [H, D] at src (contiguous) -> dst (contiguous), as tiles [H_P, HALF_P] of the two halves."""
    heads = tl.arange(0, H_P)[:, None]
    half = tl.arange(0, HALF_P)[None, :]
    m = (heads < H) & (half < D // 2)
    lo = heads * D + half
    x1 = tl.load(src + lo, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + lo + D // 2, mask=m, other=0.0).to(tl.float32)
    dt = dst.dtype.element_ty
    if HAS_NORM:
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        w1 = tl.load(W + half, mask=half < D // 2, other=0.0).to(tl.float32)
        w2 = tl.load(W + D // 2 + half, mask=half < D // 2, other=0.0).to(tl.float32)
        x1 = round_to(round_to(x1 * inv, dt) * w1, dt)
        x2 = round_to(round_to(x2 * inv, dt) * w2, dt)
    c = tl.load(cos_row + half, mask=half < D // 2, other=0.0)
    s = tl.load(sin_row + half, mask=half < D // 2, other=0.0)
    _store_heads(round_to(x1 * c - x2 * s, dt), round_to(x2 * c + x1 * s, dt), dst, heads, half, m, U, rot_scale,
                 H, D, HALF_P, ROTATE)


@triton.jit
def _rotate_v_heads(src, dst, U, rot_scale, H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr,
                    HALF_P: tl.constexpr):
    heads = tl.arange(0, H_P)[:, None]
    half = tl.arange(0, HALF_P)[None, :]
    m = (heads < H) & (half < D // 2)
    x1 = tl.load(src + heads * D + half, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + heads * D + half + D // 2, mask=m, other=0.0).to(tl.float32)
    _store_heads(x1, x2, dst, heads, half, m, U, rot_scale, H, D, HALF_P, True)


@triton.jit
def qk_norm_rope_kernel(QKV, POS, COS, SIN, QW, KW, Q, K, V, U, stride_t, stride_cos, eps, rot_scale,
                        HQ: tl.constexpr, HK: tl.constexpr, HQ_P: tl.constexpr, HK_P: tl.constexpr,
                        D: tl.constexpr, HALF_P: tl.constexpr, V_P: tl.constexpr, HAS_NORM: tl.constexpr,
                        ROTATE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row = QKV + t * stride_t
    if part == 2:
        if ROTATE:
            _rotate_v_heads(row + (HQ + HK) * D, V + t * (HK * D), U, rot_scale, HK, HK_P, D, HALF_P)
        else:
            offs = tl.arange(0, V_P)
            vals = tl.load(row + (HQ + HK) * D + offs, mask=offs < HK * D)
            tl.store(V + t * (HK * D) + offs, vals, mask=offs < HK * D)
    else:
        pos = tl.load(POS + t).to(tl.int64)
        cos_row = COS + pos * stride_cos
        sin_row = SIN + pos * stride_cos
        if part == 0:
            _norm_rope_heads(row, QW, Q + t * (HQ * D), cos_row, sin_row, eps, U, rot_scale, HQ, HQ_P, D, HALF_P,
                             HAS_NORM, ROTATE)
        else:
            _norm_rope_heads(row + HQ * D, KW, K + t * (HK * D), cos_row, sin_row, eps, U, rot_scale, HK, HK_P, D,
                             HALF_P, HAS_NORM, ROTATE)
