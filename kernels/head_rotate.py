"""Typed launches of the KV rotation kernel (kernels/triton/head_rotate.py): q, k and v rotated in one launch,
the attention output rotated back in one, where engine/kv_rotation.py's PyTorch form takes three ops per tensor.

``rotate_qkv(q, k, v, r)`` -> (q @ r, k @ r, v @ r) and ``unrotate_heads(o, r)`` -> o @ r^T, over the last dim,
each rounded once to the input dtype from fp32 products (the reference's numerics up to the order of the fp32
sums). Tensors [T, H, D] with D a power of two >= 16; ``r`` fp32 [D, D] on the same device. CPU tensors run under
Triton's interpreter (the tests); the engine uses these on CUDA only.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton.head_rotate import rotate_heads_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(x: torch.Tensor, r: torch.Tensor) -> bool:
    """Whether the kernel takes heads of ``x`` (the tensor-core tile needs D >= 16; R a power-of-two size)."""
    d = x.shape[-1]
    return x.dtype in _DTYPES and d >= 16 and d & (d - 1) == 0 and tuple(r.shape) == (d, d)


def _check(name: str, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3 or not supports(x, r) or r.dtype != torch.float32 or r.device != x.device:
        raise ValueError(f"{name} takes [T, H, D] bf16/fp16/fp32 heads with D a power of two >= 16 and an fp32 "
                         f"[D, D] rotation on their device, got {x.dtype} {tuple(x.shape)} on {x.device} and "
                         f"{r.dtype} {tuple(r.shape)} on {r.device}")
    return x.contiguous()


_BLOCK = 16  # rows per program: the [16, D] fp32 sums and R's [16, D] slices stay in registers (64 rows spill at D 128)


def _launch(xs: list[torch.Tensor], r: torch.Tensor, transpose: bool) -> list[torch.Tensor]:
    outs = [torch.empty_like(x) for x in xs]
    rows = [x.shape[0] * x.shape[1] for x in xs]
    most = max(rows)
    if most == 0:
        return outs
    pad = 3 - len(xs)  # unused parts: no rows
    xs3, os3, n3 = xs + [xs[0]] * pad, outs + [outs[0]] * pad, rows + [0] * pad
    block = _BLOCK
    rotate_heads_kernel[(triton.cdiv(most, block), len(xs))](
        *xs3, r.contiguous(), *os3, *n3, D=xs[0].shape[-1], BLOCK=block, TRANSPOSE=transpose, num_warps=4)
    return outs


def rotate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q @ r, k @ r, v @ r) per head, rounded to each input's dtype; one launch."""
    xs = [_check(n, x, r) for n, x in (("rotate_qkv q", q), ("rotate_qkv k", k), ("rotate_qkv v", v))]  # one D: r's
    oq, ok, ov = _launch(xs, r, transpose=False)
    return oq, ok, ov


def unrotate_heads(o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """o @ r^T per head (the rotation undone), rounded to o's dtype; one launch."""
    return _launch([_check("unrotate_heads", o, r)], r, transpose=True)[0]
