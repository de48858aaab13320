"""A linear layer for a decode step's few rows: y[M, N] = x[M, K] @ w[N, K]^T for M <= 64, bf16/fp16 in, fp32
accumulation, rounded once to the input dtype (typed launch and the rule where it runs: nvfp4_kernels/skinny_linear.py).

At decode batch sizes a projection is a stream of its weights. Launched with programmatic dependent launch, this
kernel's blocks start during the previous kernel's tail; with ``PREFETCH`` they also send their first weight
blocks towards L2 before they wait on it (the weights depend on nothing that kernel writes).

Grid (cdiv(N, BLOCK_N), SPLIT_K). Each program streams w[BLOCK_N rows, its K range] once. SPLIT_K = 1 stores y
in x's dtype; SPLIT_K > 1 adds fp32 partial sums into a zeroed fp32 y (atomics; the caller casts).

GATED (SPLIT_K 1): w is the merged gate-up weight [2N, K] (gate rows, then up rows) and y [M, N] the MLP's
activation: each program streams the gate rows n and the up rows N + n of its columns and stores
round(round(silu(round(g))) * round(u)) (``round``: to y's dtype, rounding/silu as silu_mul_kernel's), the
values the projection followed by silu_mul_kernel gives, without the gate-up output or a second kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_kernels.triton.pdl import pdl_enter
from nvfp4_kernels.triton.rounding import round_to


@triton.jit
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of each address where ``mask`` (a hint: no value comes back, nothing waits on it)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def skinny_linear_kernel(X, W, Y, M, N, K, k_span, stride_xm, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                         BF16_DOT: tl.constexpr, GATED: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_span  # this program's K range: [k_lo, k_lo + k_span), masked at K (k_span: BLOCK_K's)
    # the first PREFETCH weight blocks towards L2 before the wait (they depend on nothing the kernel ahead writes):
    # one prefetch per 128-byte line
    rl = tl.arange(0, BLOCK_K // 64) * 64
    for j in tl.static_range(PREFETCH):
        kl = k_lo + j * BLOCK_K + rl
        _prefetch_l2(W + rn[:, None] * stride_wn + kl[None, :],
                     (rn[:, None] < N) & (kl[None, :] < K) & (kl[None, :] < k_lo + k_span))
        if GATED:
            _prefetch_l2(W + (N + rn)[:, None] * stride_wn + kl[None, :],
                         (rn[:, None] < N) & (kl[None, :] < K) & (kl[None, :] < k_lo + k_span))
    pdl_enter(PDL)  # x is the kernel ahead's output
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED: the up rows' sums (else unused)
    for i in range(0, k_span, BLOCK_K):
        k = k_lo + i
        kmask = (k + rk)[None, :] < K
        x = tl.load(X + rm[:, None] * stride_xm + (k + rk)[None, :], mask=(rm[:, None] < M) & kmask, other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + (k + rk)[None, :], mask=(rn[:, None] < N) & kmask, other=0.0)
        acc = _dot(x, w, acc, BF16_DOT)
        if GATED:
            wu = tl.load(W + (N + rn)[:, None] * stride_wn + (k + rk)[None, :], mask=(rn[:, None] < N) & kmask,
                         other=0.0)
            up = _dot(x, wu, up, BF16_DOT)
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if GATED:
        g = round_to(acc, Y.dtype.element_ty)
        a = round_to(g / (1.0 + tl.exp(-g)), Y.dtype.element_ty)
        tl.store(y_ptrs, round_to(a * round_to(up, Y.dtype.element_ty), Y.dtype.element_ty).to(Y.dtype.element_ty),
                 mask=mask)
    elif SPLIT_K == 1:
        tl.store(y_ptrs, round_to(acc, Y.dtype.element_ty).to(Y.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _dot(x, w, acc, BF16_DOT: tl.constexpr):
    """acc + x @ w^T."""
    if BF16_DOT:  # the GPU: bf16/fp16 operands straight into the tensor cores
        return tl.dot(x, tl.trans(w), acc)
    else:  # the CPU interpreter (its dot takes bf16 as raw bits): fp32 tiles, bf16 values exact in tf32
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="tf32")
