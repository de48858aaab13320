"""NVFP4 quantization with per-block scale selection (an encoder option; same bytes format, same decoder).

``nvfp4_kernels.nvfp4.quantize`` maps each block's amax to the top E2M1 magnitude 6: its E4M3 scale code is
``c6 = e4m3_rne_saturate((amax / 6) / g)``. That is rarely the scale that reconstructs the block best: a larger
scale puts the block's largest values on a finer part of the grid, a smaller one gives the many small values a
finer step and lets the largest saturate a little. Per block, this encoder tries the E4M3 codes

    c6 + k  for k = 0, -1, 1, 2, 3, 4, 5, 6, 7   (clamped to [0, 0x7E]; in this order)

and keeps the first whose dequantized values are closest to the input (sum of squared errors; a tie keeps
the earlier code, so c6 wins every tie):

    codes(s) = e2m1_rne_saturate(x / (float(s) * g))                    (the spec's rounding)
    err(s)   = sum((dq(codes(s), s) - x)^2),  dq = (E2M1 value * float(s)) * g

The codes reach amax / 4 (at most 7 codes above c6 anywhere in the E4M3 range), so a block never reconstructs
worse than under amax/6 or amax/4; on the shipped model this choice with the Hadamard rotation brings NVFP4's KL
vs bf16 to under 4x FP8's (docs/benchmarks/accuracy.md).

Every fp32 step has a fixed order, so the Triton encoder (``nvfp4_kernels/triton/nvfp4_quantize.py``,
``BLOCK_SELECT``) is bit-identical: each sum of 16 squares adds adjacent pairs in 4 levels
(``_pairwise_sum16``), never a library reduction of unspecified order.

Any decoder of the contract (``nvfp4_kernels.nvfp4.dequantize``, every decode kernel) reads the result
unchanged. It is NOT the bit-exact reference GPU kernels are held to: that stays
``nvfp4_kernels.nvfp4.quantize``. The evaluation (``offline/evaluation.py``) measures whether it helps.
"""

from __future__ import annotations

import torch

from nvfp4_kernels import nvfp4


def _codes_for_scale(
    x32: torch.Tensor, scales: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., nb, 16], dequantized fp32) of blocks ``x32`` under E4M3 ``scales [..., nb, 1]``."""
    s_f = scales.float()
    nonzero = s_f != 0
    denom = torch.where(nonzero, s_f * g, torch.ones_like(s_f))
    codes = nvfp4._e2m1_codes(x32 / denom)
    codes = torch.where(nonzero, codes, torch.zeros_like(codes))
    lut = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float32, device=x32.device)
    return codes, (lut[codes.long()] * s_f) * g


def _pairwise_sum16(e: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) by adjacent pairs, 4 levels: [..., 16] -> [..., 1]."""
    for _ in range(4):
        e = e[..., 0::2] + e[..., 1::2]
    return e


# the candidate codes, as offsets from c6, in the order ties are broken (the first one wins)
SCALE_OFFSETS = (0, -1, 1, 2, 3, 4, 5, 6, 7)
_MAX_CODE = 0x7E  # E4M3 (fn) 448; 0x7F is NaN


def quantize_block_select(
    x: torch.Tensor, global_scale: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``nvfp4_kernels.nvfp4.quantize`` (same inputs and output layout), the scale code of each block chosen
    among ``c6 + SCALE_OFFSETS`` by the least squared reconstruction error."""
    _six_data, six_scales = nvfp4.quantize(x, global_scale)  # validates x and g with the reference's messages
    g = nvfp4._global_scale_tensor(global_scale, x.device)
    lead, d = x.shape[:-1], x.shape[-1]
    nb = d // nvfp4.BLOCK_SIZE
    x32 = x.float().reshape(*lead, nb, nvfp4.BLOCK_SIZE)
    c6 = six_scales.reshape(*lead, nb, 1).view(torch.uint8).to(torch.int32)
    best_err = best_codes = best_byte = None
    for k in SCALE_OFFSETS:
        byte = (c6 + k).clamp(0, _MAX_CODE).to(torch.uint8)
        codes, dq = _codes_for_scale(x32, byte.view(torch.float8_e4m3fn), g)
        e = dq - x32
        err = _pairwise_sum16(e * e)
        if best_err is None:
            best_err, best_codes, best_byte = err, codes, byte
            continue
        better = err < best_err  # strict: a tie keeps the earlier code
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better, codes, best_codes)
        best_byte = torch.where(better, byte, best_byte)
    codes = best_codes.reshape(*lead, d // 2, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data.contiguous(), best_byte.view(torch.float8_e4m3fn).reshape(*lead, nb).contiguous()
