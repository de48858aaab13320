"""Rotated K/V (``--kv-rotation``): an orthogonal transform of each head's vectors before they are quantized.

    hadamard   R = diag(s) @ H / sqrt(D): H the D x D Sylvester Hadamard matrix, s fixed random signs (seed 0)

Attention is computed on q R, k R, v R and its output rotated back (o R^T). Exact in real arithmetic:
(q R)(k R)^T = q k^T since R R^T = I, and softmax(.) (v R) R^T = softmax(.) v. Only quantization sees the
difference: R spreads an outlier channel of K or V over all D channels, so a 16-value block's scale is set by
typical values rather than by one large one, and the E2M1 grid resolves the rest better.

Every path sees the same R because the model itself hands attention rotated vectors (``CausalLM.rotate_kv``):
q, k, v leave the fused q/k-norm + RoPE kernel rotated (nvfp4_kernels/triton/qk_norm_rope.py, no extra launch) and the
output's R^T is folded into o_proj's weight at load, so the prefill and extend workspace, the pool (what is
written, transferred and cached is rotated K/V), decode and calibration all see rotated K/V at no cost per step.
The rotation is part of the KV layout (svc_common/layout.py), so a decode refuses pages rotated differently.
"""

from __future__ import annotations

import functools

import torch

from nvfp4_kernels.model_ops import HeadRotation

KV_ROTATIONS = ("none", "hadamard")
_SIGN_SEED = 0  # part of the format: changing it changes what a rotated pool's bytes mean


@functools.cache
def _matrix_cpu(kind: str, head_dim: int) -> torch.Tensor:
    if kind != "hadamard":
        raise ValueError(f"--kv-rotation must be one of {KV_ROTATIONS}, got {kind!r}")
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"--kv-rotation hadamard needs head_dim a power of two, got {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(_SIGN_SEED)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return (signs[:, None] * h / head_dim ** 0.5).to(torch.float32)


def rotation_matrix(kind: str, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The fp32 [D, D] orthogonal matrix of ``kind`` (None for "none"): vectors are rotated as ``x @ R``."""
    if kind == "none":
        return None
    return _matrix_cpu(kind, head_dim).to(device)


def head_rotation(kind: str, head_dim: int, device: torch.device | str,
                  dtype: torch.dtype) -> HeadRotation | None:
    """``rotation_matrix`` as the model applies it: +-1 entries in ``dtype`` times 1/sqrt(D) (None for "none")."""
    r = rotation_matrix(kind, head_dim)
    if r is None:
        return None
    scale = head_dim ** -0.5
    unit = torch.sign(r)  # R = signs * H / sqrt(D): every entry +-1/sqrt(D)
    return HeadRotation(unit.to(device=device, dtype=dtype).contiguous(), scale)
