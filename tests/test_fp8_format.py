"""Per-tensor-scaled FP8 E4M3 (nvfp4_kernels.fp8): saturation, rounding, exact round trips, validation."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_kernels import fp8


def all_finite_e4m3() -> torch.Tensor:
    """Every finite float8_e4m3fn value (bytes 0x00-0x7E and 0x80-0xFE)."""
    b = torch.tensor([i for i in range(256) if i & 0x7F != 0x7F], dtype=torch.uint8)
    return b.view(torch.float8_e4m3fn)


def test_values_beyond_448_times_scale_saturate_instead_of_becoming_nan():
    s = 0.5
    q = fp8.quantize(torch.tensor([224.0, 1e6, -1e6, 230.0, math.inf, -math.inf]), s)
    assert q.view(torch.uint8).tolist() == [0x7E, 0x7E, 0xFE, 0x7E, 0x7E, 0xFE]
    assert fp8.dequantize(q, s).tolist() == [224.0, 224.0, -224.0, 224.0, 224.0, -224.0]
    assert fp8.E4M3_MAX == 448.0


def test_nan_stays_nan():
    assert torch.isnan(fp8.quantize(torch.tensor([math.nan]), 1.0).float()).all()


def test_rounding_is_nearest_even():
    # ties: 1.0625 (1.0 | 1.125) -> 1.0, 1.1875 (1.125 | 1.25) -> 1.25, 2^-10 (0 | 2^-9) -> 0
    x = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-11, 1.07, -1.1875])
    assert fp8.quantize(x, 1.0).float().tolist() == [1.0, 1.25, 0.0, 2.0**-9, 1.125, -1.25]


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.0173, 3.7])
def test_every_representable_value_round_trips_exactly(scale):
    q = all_finite_e4m3()
    x = fp8.dequantize(q, scale)
    assert torch.equal(fp8.quantize(x, scale).view(torch.uint8), q.view(torch.uint8))
    if math.log2(scale).is_integer():  # power-of-two scale: dequantized values are exact
        assert torch.equal(x, q.float() * scale)


def test_division_is_true_ieee_division():
    # found by search: x / s lands on the other side of an E4M3 midpoint than x * (1 / s) does
    cases = [
        (3.425823211669922, 1.4424519538879395, 2.25),
        (8.429851531982422, 0.6244334578514099, 14.0),
        (10.079455375671387, 9.48654556274414, 1.125),
    ]
    for x, s, expect in cases:
        assert fp8.quantize(torch.tensor([x]), s).float().item() == expect


def test_round_trip_error_is_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 10
    scale = float(x.abs().max()) / 448
    y = fp8.dequantize(fp8.quantize(x, scale), scale)
    normal = x.abs() >= 2.0**-6 * scale
    assert ((y - x).abs()[normal] <= x.abs()[normal] * 2.0**-4 * (1 + 1e-6)).all()
    assert ((y - x).abs()[~normal] <= 2.0**-10 * scale * (1 + 1e-6)).all()


def test_dtypes_shapes_and_tensor_scales():
    x = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    q = fp8.quantize(x, torch.tensor(0.5))
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.equal(q.view(torch.uint8), fp8.quantize(x.float(), 0.5).view(torch.uint8))
    out = fp8.dequantize(q.view(torch.uint8), 0.5, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fp8.dequantize(q, 0.5).to(torch.bfloat16))


def test_invalid_scales_raise_value_errors():
    for bad in (0.0, -2.0, math.nan, math.inf, 1e39):
        with pytest.raises(ValueError, match="FP8 scale"):
            fp8.quantize(torch.ones(4), bad)
        with pytest.raises(ValueError, match="FP8 scale"):
            fp8.dequantize(torch.zeros(4, dtype=torch.float8_e4m3fn), bad)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.dequantize(torch.zeros(4), 1.0)


@pytest.mark.gpu
def test_cuda_bytes_equal_cpu_bytes():
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(100_000, generator=gen) * 50, fp8.dequantize(all_finite_e4m3(), 0.0173)])
    for s in (1.0, 0.0173, 3.7, 1.4424519538879395):
        assert torch.equal(
            fp8.quantize(x.cuda(), s).cpu().view(torch.uint8), fp8.quantize(x, s).view(torch.uint8)
        )
    assert fp8.quantize(torch.tensor([3.425823211669922]).cuda(), 1.4424519538879395).float().item() == 2.25
