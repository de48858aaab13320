"""Typed launches of the fused decoder-layer kernels (nvfp4_kernels/triton/rmsnorm.py, silu_mul.py, qk_norm_rope.py),
and the projections: the skinny linear (nvfp4_kernels/skinny_linear.py) where it applies, else cuBLAS.

Each function checks dtypes, shapes and strides, allocates its outputs and launches one kernel; the math is
that of the same-named reference in nvfp4_kernels/model_ops.py (fp32 inside, rounded where the reference rounds).
``TRITON_OPS`` bundles them as a ``ModelOps``. CPU tensors work under Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from nvfp4_kernels.model_ops import HeadRotation, ModelOps, rotate_heads
from nvfp4_kernels.programmatic_launch import pdl_args
from nvfp4_kernels.skinny_linear import skinny_applies, skinny_linear
from nvfp4_kernels.triton.qk_norm_rope import qk_norm_rope_kernel
from nvfp4_kernels.triton.rmsnorm import rmsnorm_kernel
from nvfp4_kernels.triton.silu_mul import silu_mul_kernel

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SILU_BLOCK = 1024


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"{name} takes rows [T, N] of bf16/fp16/fp32 with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")


def _check_weight(name: str, w: torch.Tensor, x: torch.Tensor, n: int) -> None:
    if w.shape != (n,) or w.dtype != x.dtype or not w.is_contiguous():
        raise ValueError(f"{name} weight must be contiguous [{n}] {x.dtype}, got {w.dtype} {tuple(w.shape)}")


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _qk_warps(half_tile: int, rotate: bool = False) -> int:
    """Warps for a [heads, D/2] tile: 16 fp32 values of each half per thread, 1 to 8 warps; 4 or more to rotate
    (R's [D/2, D] halves, 64 fp32 values per thread at D 128 and 4 warps)."""
    return max(4 if rotate else 1, min(8, half_tile // 512))


def _launch_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                    out: torch.Tensor, res_out: torch.Tensor | None) -> None:
    t, n = x.shape
    if t == 0:
        return
    block = triton.next_power_of_2(n)
    res, ro = (x, out) if residual is None else (residual, res_out)
    rmsnorm_kernel[(t,)](x, res, w, out, ro, x.stride(0), res.stride(0), out.stride(0), ro.stride(0), n,
                         float(eps), BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_norm_warps(block),
                         **pdl_args(x))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """out[t] = round(w * round(x[t] * rsqrt(mean(x[t]^2) + eps))), fp32 inside; x [T, N], w [N], same dtype."""
    _check_rows("rms_norm", x)
    _check_weight("rms_norm", w, x, x.shape[1])
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_rmsnorm(x, None, w, eps, out, None)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """s = round(x + residual); returns (rms_norm(s, w, eps), s); x, residual [T, N], w [N], one dtype."""
    _check_rows("add_rms_norm", x)
    _check_rows("add_rms_norm residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm residual must match x {x.dtype} {tuple(x.shape)}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    _check_weight("add_rms_norm", w, x, x.shape[1])
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out)
    _launch_rmsnorm(x, residual, w, eps, out, res_out)
    return out, res_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """out[t, i] = round(round(silu(gate[t, i])) * up[t, i]) for gate_up [T, 2I] = [gate | up]; out [T, I]."""
    _check_rows("silu_mul", gate_up)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"silu_mul takes [gate | up] rows of even width, got {two_i}")
    out = torch.empty((t, two_i // 2), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        silu_mul_kernel[(t, triton.cdiv(two_i // 2, _SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), two_i // 2, BLOCK=_SILU_BLOCK, num_warps=4,
            **pdl_args(gate_up))
    return out


def _check_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               num_heads: int, num_kv_heads: int) -> int:
    _check_rows("qk_norm_rope", qkv)
    d = 2 * cos.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qk_norm_rope: QKV rows of {qkv.shape[1]} values do not hold {num_heads} + 2 x "
                         f"{num_kv_heads} heads of {d}")
    if positions.shape != (qkv.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qk_norm_rope positions must be int32/int64 [{qkv.shape[0]}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.dtype != torch.float32 or not tab.is_contiguous() or tab.shape != cos.shape:
            raise ValueError(f"qk_norm_rope {name} must be a contiguous fp32 table [P, D/2], got "
                             f"{tab.dtype} {tuple(tab.shape)}")
    return d


def fuses_rotation(rotation: HeadRotation, dtype: torch.dtype) -> bool:
    """Whether the kernel rotates heads itself: D a power of two >= 32 (tensor-core tiles) and ``unit`` in the
    model dtype; other rotations run as the reference's matmul after the kernel."""
    d = rotation.head_dim
    return d >= 32 and d & (d - 1) == 0 and rotation.unit.dtype == dtype and rotation.unit.is_contiguous()


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, num_heads: int,
                 num_kv_heads: int,
                 rotation: HeadRotation | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k = rope(rms_norm_per_head(qkv's q, k heads, q_w / k_w), cos/sin[positions]), v = qkv's v heads;
    with ``rotation`` all three rotated in the same launch (where ``fuses_rotation``)."""
    d = _check_qkv(qkv, positions, cos, sin, num_heads, num_kv_heads)
    if rotation is not None:
        if rotation.head_dim != d or rotation.unit.device != qkv.device:
            raise ValueError(f"qk_norm_rope: a rotation of {rotation.head_dim}-value heads on "
                             f"{rotation.unit.device} for heads of {d} on {qkv.device}")
        if not fuses_rotation(rotation, qkv.dtype):
            q, k, v = qk_norm_rope(qkv, positions, cos, sin, q_w, k_w, eps, num_heads, num_kv_heads)
            return rotate_heads(q, rotation), rotate_heads(k, rotation), rotate_heads(v, rotation)
    if (q_w is None) != (k_w is None):
        raise ValueError("qk_norm_rope takes both q and k norm weights or neither")
    if q_w is not None:
        _check_weight("qk_norm_rope q_norm", q_w, qkv, d)
        _check_weight("qk_norm_rope k_norm", k_w, qkv, d)
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if t:
        rotate = rotation is not None
        min_heads = 16 if rotate else 1  # a rotated tile is a tensor-core operand: >= 16 rows
        hq_p, hk_p = (max(min_heads, triton.next_power_of_2(h)) for h in (num_heads, num_kv_heads))
        qk_norm_rope_kernel[(t, 3)](
            qkv, positions, cos, sin, q if q_w is None else q_w, k if k_w is None else k_w, q, k, v,
            rotation.unit if rotate else q, qkv.stride(0), cos.stride(0), float(eps),
            rotation.scale if rotate else 1.0, HQ=num_heads, HK=num_kv_heads, HQ_P=hq_p, HK_P=hk_p, D=d,
            HALF_P=triton.next_power_of_2(d // 2), V_P=triton.next_power_of_2(num_kv_heads * d),
            num_warps=_qk_warps(hq_p * triton.next_power_of_2(d // 2), rotate), HAS_NORM=q_w is not None, ROTATE=rotate,
            **pdl_args(qkv))
    return q, k, v


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T (+ b): the skinny kernel where ``skinny_applies``, else cuBLAS (``F.linear``)."""
    if skinny_applies(x, w, b):
        return skinny_linear(x, w)
    return F.linear(x, w, b)


def gate_up_silu_mul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """silu_mul(x @ w^T (+ b)) for the merged gate-up weight w [2I, K]: one gated skinny launch where
    ``skinny_applies`` (no gate-up output, no second kernel), else the projection then ``silu_mul``."""
    if skinny_applies(x, w, b) and w.shape[0] % 2 == 0:
        return skinny_linear(x, w, gated=True)
    return silu_mul(linear(x, w, b))


TRITON_OPS = ModelOps("triton", rms_norm, add_rms_norm, silu_mul, qk_norm_rope, linear, gate_up_silu_mul)
