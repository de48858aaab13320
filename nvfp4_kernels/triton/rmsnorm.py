"""RMSNorm, optionally fused with the residual add before it: @triton.jit code only (wrapper: nvfp4_kernels/fused_ops.py).

``rmsnorm_kernel``  one program per row of x [T, N]:
                    HAS_RESIDUAL: s = round(x + residual) -> RES_OUT, then the norm of s (not of x);
                    out = round(w * round(s * rsqrt(mean(s^2) + eps)))
All math in fp32; ``round`` is to the output dtype (nvfp4_kernels/triton/rounding.py), done where the PyTorch reference
(nvfp4_kernels/model_ops.py) rounds, so the kernel differs from it only by the fp32 reduction order and rsqrt.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.pdl import pdl_enter
from nvfp4_kernels.triton.rounding import round_to


@triton.jit
def rmsnorm_kernel(X, RES, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                   BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + cols, x.to(RES_OUT.dtype.element_ty), mask=mask)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = round_to(x * inv, OUT.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(normed * w, OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)
