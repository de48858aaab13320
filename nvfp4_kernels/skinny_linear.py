"""Typed launch of the skinny linear (kernel: nvfp4_kernels/triton/skinny_linear.py) and the rule saying where the
decode's projections take it rather than cuBLAS (``skinny_applies``; ``nvfp4_kernels.fused_ops.linear`` and
``gate_up_silu_mul`` call it). CPU tensors work under Triton's interpreter (the tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from nvfp4_kernels.gpu_capability import nvidia_capability
from nvfp4_kernels.programmatic_launch import pdl_args
from nvfp4_kernels.triton.skinny_linear import skinny_linear_kernel


@dataclass(frozen=True)
class SkinnyConfig:
    """A launch of the skinny linear: BLOCK_N x BLOCK_K weight tiles, SPLIT_K programs along K, warps, stages."""

    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        if any(b < 16 or b & (b - 1) for b in (self.block_n, self.block_k)) or self.split_k < 1:
            raise ValueError(f"block_n and block_k are powers of two >= 16, split_k >= 1 (got {self.block_n}, "
                             f"{self.block_k}, {self.split_k})")


# The decode step's launch: of the probe's configs (benchmarks/kernels/probe_gemv.py, 36 projections of their
# own weights per CUDA graph, H100), the one fastest or within 4% of it on the Qwen3-8B q/k/v, o and gate/up
# projections at 1, 16 and 44 rows.
DECODE_SKINNY = SkinnyConfig()
SKINNY_MAX_ROWS = 64
_SKINNY_MAX_K = 8192  # a longer K (Qwen3-8B's down projection, 12,288) streams faster through cuBLAS's split-K
_skinny = {"enabled": True}


def set_skinny_linear(enabled: bool) -> None:
    """Whether ``linear`` launches the skinny kernel where it applies (process-wide; benchmarks' before/after)."""
    _skinny["enabled"] = bool(enabled)


def skinny_row_classes() -> tuple[int, ...]:
    """One row count of each variant the kernel compiles into over 1..SKINNY_MAX_ROWS rows: the tile height
    (BLOCK_M) and Triton's specialization of M (1, a multiple of 16, other). ``nvfp4-serve warm-cache`` compiles
    these; any other row count reuses one of their variants."""
    classes: dict[tuple[int, bool, bool], int] = {}
    for m in range(1, SKINNY_MAX_ROWS + 1):
        classes.setdefault((_block_m(m), m == 1, m % 16 == 0), m)
    return tuple(classes.values())


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig = DECODE_SKINNY, pdl: bool | None = None,
                  prefetch: int = 0, gated: bool = False, gpu_code: bool | None = None) -> torch.Tensor:
    """y = x @ w^T: x [M, K] (1 <= M <= 64, unit column stride), w [N, K] contiguous, one dtype of bf16/fp16 ->
    y [M, N] in that dtype (fp32 accumulation, one rounding). ``pdl``: launched with programmatic dependent launch
    (None: as ``programmatic_launch`` decides for x); ``prefetch``: the first that many weight blocks of each
    program sent towards L2 before its wait (GPU only, block_k >= 64). ``gated``: w is a merged gate-up weight
    [2I, K] and y [M, I] = silu_mul(x @ w^T), as ``silu_mul`` rounds it (split_k 1). ``gpu_code``: the variant a
    GPU runs (bf16/fp16 tensor-core dots, the prefetch) rather than the interpreter's (None: x.is_cuda; True on CPU
    tensors only where nothing runs them: warm-cache's target driver)."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"skinny_linear takes x [M, K] with a unit column stride and a contiguous w [N, K], got "
                         f"{tuple(x.shape)} strides {x.stride()} and {tuple(w.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(f"skinny_linear takes bf16 or fp16 x and w of one dtype, got {x.dtype} and {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1..{SKINNY_MAX_ROWS} rows, got {m}")
    if prefetch < 0 or (prefetch and cfg.block_k < 64):
        raise ValueError(f"prefetch sends 128-byte lines: prefetch >= 0 and, with it, block_k >= 64 (got "
                         f"{prefetch}, {cfg.block_k})")
    if gated and (n % 2 or cfg.split_k != 1):
        raise ValueError(f"a gated skinny_linear takes a [gate | up] weight of even rows and split_k 1, got {n} "
                         f"rows, split_k {cfg.split_k}")
    n = n // 2 if gated else n
    gpu_code = x.is_cuda if gpu_code is None else gpu_code
    launch = pdl_args(x) if pdl is None else {"PDL": pdl, "launch_pdl": pdl}
    split = cfg.split_k > 1
    y = (torch.zeros if split else torch.empty)((m, n), dtype=torch.float32 if split else x.dtype, device=x.device)
    k_span = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    skinny_linear_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, w, y, m, n, k, k_span, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        PREFETCH=prefetch if gpu_code else 0, BF16_DOT=gpu_code, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, GATED=gated, **launch)
    return y.to(x.dtype) if split else y


def skinny_shape(m: int, n: int, k: int) -> bool:
    """The shapes ``linear`` gives the skinny kernel: 1..64 rows, K <= 8192, and a weight wider than deep once
    there are more than 16 rows (at 44 rows cuBLAS streams Qwen3-8B's square o projection 3% faster)."""
    return 1 <= m <= SKINNY_MAX_ROWS and k <= _SKINNY_MAX_K and (m <= 16 or n > k)


def skinny_capability(capability: tuple[int, int] | None) -> bool:
    """The GPUs whose projections take the skinny kernel: Hopper (compute capability 9.x), where it was measured;
    cuBLAS keeps them on other GPUs until the probe says otherwise there."""
    return capability is not None and capability[0] == 9


def skinny_applies(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Where ``linear`` launches the skinny kernel rather than cuBLAS: enabled, no bias, 2-D bf16/fp16 operands of
    one dtype on a GPU of ``skinny_capability``, of a ``skinny_shape``."""
    if not _skinny["enabled"] or b is not None or x.dim() != 2 or not x.is_cuda:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or not w.is_contiguous():
        return False
    if x.stride(1) != 1 or not skinny_shape(x.shape[0], w.shape[0], x.shape[1]):
        return False
    return skinny_capability(nvidia_capability(x))
