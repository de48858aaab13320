"""The KV rotation (``--kv-rotation``) of each head's vectors in one launch: @triton.jit code only (wrapper:
kernels/head_rotate.py).

``rotate_heads_kernel``  grid (cdiv(max rows, BLOCK), PARTS): program (i, p) takes rows [i*BLOCK, (i+1)*BLOCK) of
                         part p (q, k, v: X0, X1, X2; rows = token x head, each D contiguous values):

    out[row] = round(x[row] @ R)        (TRANSPOSE: round(x[row] @ R^T), the rotation undone)

fp32 products (x is exact in fp32, R is fp32, the dot runs in IEEE fp32), ``round`` to the output dtype
(kernels/triton/rounding.py) once, where the PyTorch reference (engine/kv_rotation.py) rounds its fp32 matmul.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.rounding import round_to


@triton.jit
def _rotate_rows(X, R, OUT, n_rows, row0, D: tl.constexpr, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The products run over 16 input columns at a time, so R's [16, D] slice and the [BLOCK, D] sums are what
    stays in registers (a whole fp32 [D, D] R would spill)."""
    rows = row0 + tl.arange(0, BLOCK)
    ok = rows < n_rows
    cols = tl.arange(0, D)
    base = rows.to(tl.int64)[:, None] * D
    acc = tl.zeros([BLOCK, D], tl.float32)
    for c0 in tl.static_range(0, D, 16):
        kc = c0 + tl.arange(0, 16)
        x = tl.load(X + base + kc[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if TRANSPOSE:
            r = tl.load(R + cols[None, :] * D + kc[:, None])  # R^T[kc, c] = R[c, kc]
        else:
            r = tl.load(R + kc[:, None] * D + cols[None, :])
        acc = tl.dot(x, r, acc, input_precision="ieee")
    dt = OUT.dtype.element_ty
    tl.store(OUT + base + cols[None, :], round_to(acc, dt).to(dt), mask=ok[:, None])


@triton.jit
def rotate_heads_kernel(X0, X1, X2, R, O0, O1, O2, n0, n1, n2, D: tl.constexpr, BLOCK: tl.constexpr,
                        TRANSPOSE: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK
    part = tl.program_id(1)
    if part == 0:
        _rotate_rows(X0, R, O0, n0, row0, D, BLOCK, TRANSPOSE)
    elif part == 1:
        _rotate_rows(X1, R, O1, n1, row0, D, BLOCK, TRANSPOSE)
    else:
        _rotate_rows(X2, R, O2, n2, row0, D, BLOCK, TRANSPOSE)
