"""NVFP4 (E2M1 values, E4M3 block scales, FP32 global scale): the pure-PyTorch reference.

This module is the spec every NVFP4 kernel (Triton, CUDA, any other backend) is held to: for the
same input and global scale they must produce bit-identical bytes.

Layout of one head of D values (D % 16 == 0)::

    data   uint8 [..., D/2]    byte j = code[2j] | code[2j+1] << 4     (EVEN element in the LOW nibble)
    scales e4m3  [..., D/16]   scale b covers elements 16b .. 16b+15

    code bits: sign (bit 3) | exponent (bits 2..1) | mantissa (bit 0)
    code & 7 :  0    1    2    3    4    5    6    7
    magnitude:  0    0.5  1    1.5  2    3    4    6

Quantize, with every operation in IEEE fp32, round-to-nearest-even, in EXACTLY this order
(g is the global scale rounded to fp32)::

    x32  = x.float()
    amax = max(|x32|) over the 16 values of the block
    s    = e4m3_rne_saturate((amax / 6.0) / g)     two fp32 divisions, in that order; values above
                                                 448 (and +inf) saturate to 448, tiny values round
                                                 to E4M3 subnormals or to +0
    if float(s) == 0:  scale byte 0x00 and all 16 codes 0   (all-zero blocks, underflowing scales)
    else:
        denom = float(s) * g                     one fp32 multiply
        y     = x32 / denom                      true IEEE fp32 division (not x * (1/denom))
        code  = e2m1_rne_saturate(y)             nearest magnitude, ties to the EVEN code
                                                 (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
                                                 5->4), |y| > 6 -> 6
        sign  = signbit(y)                       so -0.0 and negatives rounding to zero store code 8;
                                                 this is what PTX cvt.rn.satfinite.e2m1x2.f32 does

Dequantize: ``value = (E2M1[code] * float(s)) * g`` in fp32 (the first product is exact), then cast.

Kernel authors: fp32 ``/`` must be the correctly rounded division (PTX div.rn.f32; Triton's default
``/`` lowers to an approximate division, use ``tl.math.div_rn``), and the compiler must not contract
``float(s) * g`` into anything else. Non-finite inputs are rejected here; kernels may assume finite data.
"""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP32_MIN_NORMAL = 2.0**-126

# E2M1 value of each 4-bit code; code 8 is -0.0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rounding |y| to the nearest E2M1 magnitude: code = number of thresholds |y| has passed.
# A midpoint between two magnitudes rounds to the even code: strict ">" where the even code is
# below the midpoint, ">=" where it is above it.
_DOWN_TIES = (0.25, 1.25, 2.5, 5.0)  # midpoints 0|0.5, 1|1.5, 2|3, 4|6 -> lower (even) code
_UP_TIES = (0.75, 1.75, 3.5)  # midpoints 0.5|1, 1.5|2, 3|4 -> upper (even) code

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _global_scale_tensor(global_scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The global scale as a 0-d fp32 tensor on ``device``; must be a finite normal fp32 > 0."""
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(
                f"global_scale must be a python float or a 0-d tensor, got shape {tuple(global_scale.shape)}"
            )
        g = torch.tensor(float(global_scale.reshape(())), dtype=torch.float32)
    else:
        g = torch.tensor(float(global_scale), dtype=torch.float32)
    gv = float(g)
    # A subnormal g could make float(s) * g round to 0 (then 0/0 = NaN codes), so require a normal fp32.
    if not (math.isfinite(gv) and gv >= FP32_MIN_NORMAL):
        raise ValueError(
            f"NVFP4 global_scale must be a finite fp32 >= {FP32_MIN_NORMAL:.4g} (got {gv!r} "
            f"from {global_scale!r}); use 1.0 or a calibrated amax / (6 * 448)"
        )
    return g.to(device)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` to E2M1 codes (uint8 0..15): RNE with ties to the even code, saturating at 6."""
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _DOWN_TIES:
        mag += a > t
    for t in _UP_TIES:
        mag += a >= t
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def quantize(x: torch.Tensor, global_scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x [..., D]`` -> ``(data uint8 [..., D/2], scales float8_e4m3fn [..., D/16])``.

    ``x`` is float32, bfloat16 or float16 with D % 16 == 0 and finite values; ``global_scale`` is a
    python float or 0-d tensor, finite and > 0. The exact arithmetic is in the module docstring.
    Works on any device; outputs live on ``x.device``.
    """
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"NVFP4 quantize takes float32/bfloat16/float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        d = x.shape[-1] if x.dim() else None
        raise ValueError(f"NVFP4 needs the last dim D to be a positive multiple of {BLOCK_SIZE} (got D={d})")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("NVFP4 quantize got NaN or inf values; the KV cache only holds finite values")
    g = _global_scale_tensor(global_scale, x.device)
    lead, d = x.shape[:-1], x.shape[-1]

    x32 = x.float().reshape(*lead, d // BLOCK_SIZE, BLOCK_SIZE)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=x.device)
    # Tensor (not python-scalar) divisors: CUDA turns division by a CPU scalar into a reciprocal multiply.
    s32 = (amax / six / g).clamp(max=E4M3_MAX)  # amax >= 0, so only the top needs saturating
    scales = s32.to(torch.float8_e4m3fn)  # RNE; exact E4M3 subnormals, underflow to +0
    s_f = scales.float()
    nonzero = s_f != 0
    denom = torch.where(nonzero, s_f * g, torch.ones_like(s_f))
    codes = _e2m1_codes(x32 / denom)
    codes = torch.where(nonzero, codes, torch.zeros_like(codes))  # zero-scale blocks: all codes 0

    codes = codes.reshape(*lead, d // 2, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data.contiguous(), scales.reshape(*lead, d // BLOCK_SIZE).contiguous()


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: float | torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``x[..., i] = (E2M1[code_i] * float(scales[..., i // 16])) * g`` -> ``dtype``.

    ``data`` uint8 [..., D/2], ``scales`` float8_e4m3fn (or its uint8 bytes) [..., D/16].
    """
    if data.dtype != torch.uint8:
        raise ValueError(f"NVFP4 data must be uint8 packed codes, got {data.dtype}")
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 scales must be float8_e4m3fn, got {scales.dtype}")
    lead, half = data.shape[:-1], data.shape[-1]
    d = half * 2
    if d == 0 or d % BLOCK_SIZE != 0 or tuple(scales.shape) != (*lead, d // BLOCK_SIZE):
        raise ValueError(
            f"NVFP4 shapes do not match: data {tuple(data.shape)} (D={d}) needs scales "
            f"{(*lead, d // BLOCK_SIZE)}, got {tuple(scales.shape)}"
        )
    g = _global_scale_tensor(global_scale, data.device)

    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*lead, d // BLOCK_SIZE, BLOCK_SIZE)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    values = lut[codes.long()]
    out = (values * scales.float().unsqueeze(-1)) * g
    return out.reshape(*lead, d).to(dtype)
