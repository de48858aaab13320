"""A linear layer for the decode's few rows (development variant, timed against cuBLAS by probe_gemv.py):
y[M, N] = x[M, K] @ w[N, K]^T for M <= 64, bf16 in, fp32 accumulation, bf16 out.

At decode batch sizes a projection is a stream of its weights: cuBLAS reaches 2.4-3.1 TB/s on the Qwen3-8B
q/k/v and o projections at M <= 16 on the H200 (copy: 4.27 TB/s), and each of the step's ~250 GEMM launches
starts only once the kernel before it has completed. Launched with programmatic dependent launch, this kernel's
blocks start during the previous kernel's tail; with ``prefetch`` they also send their first weight blocks towards
L2 before they wait on it (the weights depend on nothing that kernel writes).

Grid (cdiv(N, BLOCK_N), SPLIT_K). Each program streams w[BLOCK_N rows, its K range] once. SPLIT_K = 1 stores y
in bf16; SPLIT_K > 1 adds fp32 partial sums into a zeroed fp32 y (atomics; the caller casts)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_kernels.triton.pdl import pdl_enter


@triton.jit
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of each address where ``mask`` (a hint: no value comes back, nothing waits on it)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def skinny_linear_kernel(X, W, Y, M, N, K, k_span, stride_xm, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                         BF16_DOT: tl.constexpr):
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
    pdl_enter(PDL)  # x is the kernel ahead's output
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, k_span, BLOCK_K):
        k = k_lo + i
        kmask = (k + rk)[None, :] < K
        x = tl.load(X + rm[:, None] * stride_xm + (k + rk)[None, :], mask=(rm[:, None] < M) & kmask, other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + (k + rk)[None, :], mask=(rn[:, None] < N) & kmask, other=0.0)
        if BF16_DOT:  # the GPU: bf16 operands straight into the tensor cores
            acc = tl.dot(x, tl.trans(w), acc)
        else:  # the CPU interpreter (its dot takes bf16 as raw bits): fp32 tiles, bf16 values exact in tf32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="tf32")
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


def skinny_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256, split_k: int = 1,
                  num_warps: int = 4, num_stages: int = 3, pdl: bool = False, prefetch: int = 0) -> torch.Tensor:
    """x [M, K] bf16 (rows contiguous), w [N, K] bf16 (rows contiguous) -> y [M, N] bf16. ``pdl``: launched with
    programmatic dependent launch (SM90+); ``prefetch``: the first that many weight blocks of each program sent
    towards L2 before the wait (GPU only; BLOCK_K a multiple of 64)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x [M, K] and w [N, K] with unit column strides, got {tuple(x.shape)} and {tuple(w.shape)}")
    if not 1 <= m <= 64:
        raise ValueError(f"skinny_linear takes 1..64 rows, got {m}")
    if any(b < 16 or b & (b - 1) for b in (block_n, block_k)) or split_k < 1 or prefetch < 0:
        raise ValueError(f"block_n and block_k are powers of two >= 16, split_k >= 1, prefetch >= 0 (got {block_n}, "
                         f"{block_k}, {split_k}, {prefetch})")
    if prefetch and block_k < 64:
        raise ValueError(f"prefetch sends 128-byte lines: block_k must be >= 64, got {block_k}")
    block_m = max(16, triton.next_power_of_2(m))
    y = (torch.empty if split_k == 1 else torch.zeros)((m, n), dtype=x.dtype if split_k == 1 else torch.float32,
                                                       device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    skinny_linear_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, y, m, n, k, triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, PDL=pdl, PREFETCH=prefetch if x.is_cuda else 0, BF16_DOT=x.is_cuda, num_warps=num_warps, num_stages=num_stages, **extra)
    return y if split_k == 1 else y.to(x.dtype)
