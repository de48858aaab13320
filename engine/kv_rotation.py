"""Rotated K/V (``--kv-rotation``): an orthogonal transform of each head's vectors before they are quantized.

    hadamard   R = diag(s) @ H / sqrt(D): H the D x D Sylvester Hadamard matrix, s fixed random signs (seed 0)

Attention is computed on q R, k R, v R and its output rotated back (o R^T). Exact in real arithmetic:
(q R)(k R)^T = q k^T since R R^T = I, and softmax(.) (v R) R^T = softmax(.) v. Only quantization sees the
difference: R spreads an outlier channel of K or V over all D channels, so a 16-value block's scale is set by
typical values rather than by one large one, and the E2M1 grid resolves the rest better.

Every path sees the same R, applied where the model hands q/k/v to attention (engine/attention_paths.py):
the prefill and extend workspace, the pool (what is written, transferred and cached is rotated K/V) and decode.
The rotation is part of the KV layout (svc_common/layout.py), so a decode refuses pages rotated differently.
"""

from __future__ import annotations

import functools

import torch

from engine.model import AttnFn

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


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r`` over the last dim in fp32, returned in ``x``'s dtype."""
    return (x.float() @ r).to(x.dtype)


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The inverse of ``rotate``: ``x @ r.T``."""
    return (x.float() @ r.T).to(x.dtype)


def rotated_attn(attn: AttnFn, r: torch.Tensor | None) -> AttnFn:
    """``attn`` on rotated q/k/v with its output rotated back (``attn`` itself when ``r`` is None). On CUDA the
    rotation is one kernel launch for q, k and v and one for the output (kernels/head_rotate.py, the same math
    up to the order of fp32 sums); elsewhere ``rotate`` / ``unrotate`` (three ops per tensor)."""
    if r is None:
        return attn
    if r.device.type == "cuda":
        from kernels import head_rotate  # needs triton, which a CUDA install has

        def fused(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not head_rotate.supports(q, r):
                return unrotate(attn(layer_id, rotate(q, r), rotate(k, r), rotate(v, r)), r)
            return head_rotate.unrotate_heads(attn(layer_id, *head_rotate.rotate_qkv(q, k, v, r)), r)

        return fused

    def rotated(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return unrotate(attn(layer_id, rotate(q, r), rotate(k, r), rotate(v, r)), r)

    return rotated
