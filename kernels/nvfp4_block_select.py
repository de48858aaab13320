"""NVFP4 quantization with per-block scale selection (an encoder option; same bytes format, same decoder).

``kernels.nvfp4.quantize`` maps each block's amax to the top E2M1 magnitude 6 (``s = amax / 6``). Mapping it
to 4 instead (``s = amax / 4``) uses the grid ``{0, .5, 1, 1.5, 2, 3, 4} * s``, which is finer near the
block's largest values, at the price of the coarse step between 4 and 6 going unused. Per block, this
encoder tries both and keeps the one whose dequantized values are closer to the input (sum of squared
errors; a tie keeps ``amax / 6``):

    s6 = e4m3_rne_saturate((amax / 6) / g)        exactly as kernels.nvfp4.quantize
    s4 = e4m3_rne_saturate((amax / 4) / g)
    codes(s) = e2m1_rne_saturate(x / (float(s) * g))                    (the spec's rounding)
    keep s4 iff sum((dq(codes(s4), s4) - x)^2) < sum((dq(codes(s6), s6) - x)^2)

Every fp32 step has a fixed order, so the Triton encoder (``kernels/triton/nvfp4_quantize.py``,
``BLOCK_SELECT``) is bit-identical: dq = (E2M1 value * float(s)) * g, and each sum of 16 squares adds
adjacent pairs in 4 levels (``_pairwise_sum16``), never a library reduction of unspecified order.

Any decoder of the contract (``kernels.nvfp4.dequantize``, every decode kernel) reads the result
unchanged. It is NOT the bit-exact reference GPU kernels are held to: that stays
``kernels.nvfp4.quantize``. The evaluation (``offline/evaluation.py``) measures whether it helps.
"""

from __future__ import annotations

import torch

from kernels import nvfp4


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


def quantize_block_select(
    x: torch.Tensor, global_scale: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``kernels.nvfp4.quantize`` (same inputs and output layout), picking amax/6 or amax/4 per block."""
    _six_data, six_scales = nvfp4.quantize(x, global_scale)  # validates x and g with the reference's messages
    g = nvfp4._global_scale_tensor(global_scale, x.device)
    lead, d = x.shape[:-1], x.shape[-1]
    nb = d // nvfp4.BLOCK_SIZE
    x32 = x.float().reshape(*lead, nb, nvfp4.BLOCK_SIZE)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    four = torch.tensor(4.0, dtype=torch.float32, device=x.device)
    s4 = (amax / four / g).clamp(max=nvfp4.E4M3_MAX).to(torch.float8_e4m3fn)
    s6 = six_scales.reshape(*lead, nb, 1)
    codes6, dq6 = _codes_for_scale(x32, s6, g)
    codes4, dq4 = _codes_for_scale(x32, s4, g)
    d6, d4 = dq6 - x32, dq4 - x32
    err6, err4 = _pairwise_sum16(d6 * d6), _pairwise_sum16(d4 * d4)
    use4 = err4 < err6
    codes = torch.where(use4, codes4, codes6).reshape(*lead, d // 2, 2)
    scales = torch.where(use4, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn)
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data.contiguous(), scales.reshape(*lead, nb).contiguous()
