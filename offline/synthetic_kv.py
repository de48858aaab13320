"""Attention-output error of each KV storage format on synthetic outlier-heavy K/V (no model involved).

K gets outlier channels and outlier tokens, V heavy-tailed rows and sparse spikes, both scaled to a
chosen amax: one regime inside the range a global scale of 1.0 represents well, one above it (FP8
saturates at 448, NVFP4 at 6 * 448) and one below it (E4M3 subnormals). Each format stores K and V
(``calibrated``: global scale from the tensor's own amax; ``rotation``: q, K and V rotated by the
``--kv-rotation hadamard`` matrix before K and V are stored, the output rotated back) and the attention output
is compared with float64 attention on the exact K/V.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kv_rotation import rotation_matrix
from nvfp4_kernels import fp8, nvfp4
from nvfp4_kernels.nvfp4_block_select import quantize_block_select


def _roundtrip(x: torch.Tensor, fmt: str, amax: float) -> torch.Tensor:
    if fmt == "bf16":
        return x.to(torch.bfloat16).float()
    if fmt.startswith("fp8"):
        s = amax / 448 if fmt.endswith("calibrated") else 1.0
        return fp8.dequantize(fp8.quantize(x, s), s)
    g = amax / (6 * 448) if "calibrated" in fmt else 1.0
    data, sf = (quantize_block_select if "block select" in fmt else nvfp4.quantize)(x, g)
    return nvfp4.dequantize(data, sf, g)


SYNTHETIC_FORMATS = (
    "bf16",
    "fp8_e4m3 (scale 1.0)",
    "fp8_e4m3 calibrated",
    "nvfp4 (scale 1.0)",
    "nvfp4 calibrated",
    "nvfp4 calibrated + block select",
    "nvfp4 calibrated + rotation",
    "nvfp4 calibrated + rotation + block select",
)
_ROTATION = " + rotation"
SYNTHETIC_REGIMES = (
    ("amax 10", 10.0),
    ("amax 5000 (beyond scale-1.0 range)", 5000.0),
    ("amax 0.05 (E4M3 subnormal range at scale 1.0)", 0.05),
)


def synthetic_kv(
    num_tokens: int, head_dim: int, amax: float, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """K with outlier channels and outlier tokens, V with heavy-tailed rows and spikes, both scaled to
    ``amax``; q scaled so the softmax is neither flat nor one-hot (score std ~2)."""
    k = torch.randn(num_tokens, head_dim, generator=gen)
    channels = torch.randperm(head_dim, generator=gen)[:4]
    k[:, channels] *= 12.0
    k[torch.rand(num_tokens, generator=gen) < 0.02] *= 6.0
    v = torch.randn(num_tokens, head_dim, generator=gen) * torch.exp(
        0.75 * torch.randn(num_tokens, 1, generator=gen)
    )
    spikes = torch.rand(num_tokens, head_dim, generator=gen) < 0.005
    v = torch.where(spikes, v * 20.0, v)
    k, v = k * (amax / k.abs().max()), v * (amax / v.abs().max())
    q = torch.randn(32, head_dim, generator=gen)
    q *= 2.0 / float((q @ k.T).std() * head_dim**-0.5)
    return q, k, v


def synthetic_attention_error(
    seed: int = 0, num_tokens: int = 2048, head_dim: int = 64
) -> list[dict[str, Any]]:
    """Relative L2 error of ``softmax(q K^T / sqrt(D)) V`` when K and V are stored in each format
    (``calibrated`` uses the tensor's own amax), against float64 attention on the exact K/V."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for regime, amax in SYNTHETIC_REGIMES:
        q, k, v = synthetic_kv(num_tokens, head_dim, amax, gen)
        exact = torch.softmax((q.double() @ k.double().T) * head_dim**-0.5, -1) @ v.double()
        row: dict[str, Any] = {"regime": regime, "amax": amax}
        r = rotation_matrix("hadamard", head_dim).double()
        for fmt in SYNTHETIC_FORMATS:
            rotated = _ROTATION in fmt
            qs, ks, vs = ((x.double() @ r).float() for x in (q, k, v)) if rotated else (q, k, v)
            store = fmt.replace(_ROTATION, "")
            kq, vq = _roundtrip(ks, store, float(ks.abs().max())), _roundtrip(vs, store, float(vs.abs().max()))
            approx = torch.softmax((qs.double() @ kq.double().T) * head_dim**-0.5, -1) @ vq.double()
            if rotated:
                approx = approx @ r.T
            row[fmt] = float((approx - exact).norm() / exact.norm())
        out.append(row)
    return out
