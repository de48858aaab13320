"""SiLU-and-multiply on the merged gate-up projection: @triton.jit code only (wrapper: nvfp4_kernels/fused_ops.py).

``silu_mul_kernel``  grid (T, cdiv(I, BLOCK)); row t of GU [T, 2I] is [gate | up]:
                     out[t, i] = round(round(silu(gate[t, i])) * up[t, i]), silu(g) = g / (1 + exp(-g)) in fp32
(``round``: to the output dtype, nvfp4_kernels/triton/rounding.py, where the PyTorch reference ``F.silu(gate) * up`` rounds).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.pdl import pdl_enter
from nvfp4_kernels.triton.rounding import round_to


@triton.jit
def silu_mul_kernel(GU, OUT, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    a = round_to(g / (1.0 + tl.exp(-g)), OUT.dtype.element_ty)
    out = round_to(a * u, OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)
