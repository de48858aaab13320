"""The decoder layer's ops (everything but attention and the logits), by device.

``ModelOps`` names the six ops ``engine.model`` calls; ``REFERENCE_OPS`` is their pure-PyTorch form, the
numerics the model always had (HF order: normalise in fp32, round, times the weight) and the CPU path;
``nvfp4_kernels.op_select.model_ops(device, fused)`` picks between them and the fused Triton kernels
(nvfp4_kernels/fused_ops.py), which take this module's types. Shapes (T tokens, model dtype throughout):

    rms_norm(x [T, N], w [N], eps) -> out [T, N]
    add_rms_norm(x, residual [T, N], w, eps) -> (rms_norm(x + residual), x + residual)
    silu_mul(gate_up [T, 2I]) -> silu(gate) * up [T, I]
    qk_norm_rope(qkv [T, (Hq + 2Hk) D], positions [T], cos, sin [P, D/2] fp32, q_w, k_w [D] | None, eps, Hq, Hk)
        -> q [T, Hq, D], k [T, Hk, D] (per-head RMSNorm when q_w/k_w are given, then neox RoPE), v [T, Hk, D]
        ``rotation`` (a ``HeadRotation``, --kv-rotation): q, k and v then leave rotated, each head ``x @ R``
    linear(x [T, K], w [N, K], b [N] | None) -> x w^T + b [T, N]     (the projections)
    gate_up_silu_mul(x [T, K], w [2I, K], b [2I] | None) -> silu_mul(linear(x, w, b)) [T, I]   (the MLP's input side)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class ModelOps(NamedTuple):
    name: str
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    gate_up_silu_mul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, eq=False)
class HeadRotation:
    """An orthogonal rotation of each head's vectors, ``x -> x @ R`` with ``R = unit * scale``.

    ``unit`` is [D, D] in the model dtype with entries exactly representable in it (+-1 for a Hadamard), so a
    kernel multiplies by it exactly on tensor cores and applies ``scale`` once in fp32; ``matrix()`` is the fp32 R
    the reference multiplies by.
    """

    unit: torch.Tensor
    scale: float

    @property
    def head_dim(self) -> int:
        return self.unit.shape[0]

    def matrix(self) -> torch.Tensor:
        return self.unit.float() * self.scale


def rotate_heads(x: torch.Tensor, rotation: HeadRotation) -> torch.Tensor:
    """``x @ R`` over the last dim in fp32, rounded once to ``x``'s dtype."""
    return (x.float() @ rotation.matrix()).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """out = w * round(x / rms(x)), the norm over the last dim in fp32 (HF's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) for s = x + residual, rounded to the model dtype."""
    s = x + residual
    return rms_norm(s, w, eps), s


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1 cos - x2 sin, x2 cos + x1 sin] for the halves x1, x2 of the last dim, in fp32; x's dtype out."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, num_heads: int,
                 num_kv_heads: int,
                 rotation: HeadRotation | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (per-head RMSNorm if q_w/k_w, then RoPE at ``positions``) and v, contiguous, from the QKV rows;
    with ``rotation`` each of the three then rotated (``rotate_heads``: one more rounding)."""
    t = qkv.shape[0]
    d = cos.shape[-1] * 2
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = q.view(t, num_heads, d), k.view(t, num_kv_heads, d)
    v = v.reshape(t, num_kv_heads, d).contiguous()
    if q_w is not None:
        assert k_w is not None
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D/2]
    q, k = rotate_neox(q, c, s), rotate_neox(k, c, s)
    if rotation is None:
        return q, k, v
    return rotate_heads(q, rotation), rotate_heads(k, rotation), rotate_heads(v, rotation)


def gate_up_silu_mul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return silu_mul(F.linear(x, w, b))


REFERENCE_OPS = ModelOps("reference", rms_norm, add_rms_norm, silu_mul, qk_norm_rope, F.linear, gate_up_silu_mul)
