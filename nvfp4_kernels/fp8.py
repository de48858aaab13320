"""Per-tensor-scaled FP8 E4M3 (float8_e4m3fn) with a saturating cast: the pure-PyTorch reference.

    quantize:   q = e4m3_rne(clamp(x.float() / scale, -448, 448))    true IEEE fp32 division
    dequantize: x = float(q) * scale                                 fp32 multiply, then cast

torch's cast to float8_e4m3fn rounds to nearest even but turns out-of-range values into NaN, hence
the clamp (which also maps +-inf to +-448). NaN inputs stay NaN. ``scale`` is one FP32 value per
layer for K and one for V; kernels must use a correctly rounded division (not ``x * (1/scale)``) to
match these bytes.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
# 0-d fp32 scale tensors already on a non-CPU device, by (value, device): a decode step must not copy a
# scale host->device per layer (that would also break CUDA-graph capture, which forbids pageable copies).
_DEVICE_SCALES: dict[tuple[float, torch.device], torch.Tensor] = {}


def _scale_tensor(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``scale`` as a 0-d fp32 tensor on ``device``; must be finite and > 0 in fp32."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"FP8 scale must be a python float or a 0-d tensor, got shape {tuple(scale.shape)}"
            )
        s = torch.tensor(float(scale.reshape(())), dtype=torch.float32)
    else:
        s = torch.tensor(float(scale), dtype=torch.float32)
    sv = float(s)
    if not (math.isfinite(sv) and sv > 0):
        raise ValueError(
            f"FP8 scale must be a finite fp32 > 0 (got {sv!r} from {scale!r}); "
            f"use 1.0 or a calibrated amax / {E4M3_MAX:g}"
        )
    if device.type == "cpu":
        return s
    key = (sv, device)
    cached = _DEVICE_SCALES.get(key)
    if cached is None:
        cached = _DEVICE_SCALES[key] = s.to(device)
    return cached


def quantize(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x / scale`` cast to float8_e4m3fn with saturation at +-448; same shape and device as ``x``."""
    s = _scale_tensor(scale, x.device)
    # A device tensor divisor: CUDA turns division by a CPU scalar into a reciprocal multiply.
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(
    x8: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float(x8) * scale`` in fp32, cast to ``dtype``; ``x8`` is float8_e4m3fn (or its uint8 bytes)."""
    if x8.dtype == torch.uint8:
        x8 = x8.view(torch.float8_e4m3fn)
    if x8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 dequantize takes float8_e4m3fn, got {x8.dtype}")
    s = _scale_tensor(scale, x8.device)
    return (x8.float() * s).to(dtype)
