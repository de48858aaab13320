"""The NVFP4 format reference (nvfp4_kernels.nvfp4): exact bytes on crafted inputs, an independent scalar
implementation that must agree bit for bit, round-trip error bounds, and the storage size."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from nvfp4_kernels import fp8, nvfp4
from nvfp4_kernels.kv_layout import bytes_per_token_per_layer

# ---------------------------------------------------------------------------------------------
# Independent scalar implementation: numpy fp32 scalars for the arithmetic, exact rationals and a
# brute-force nearest-grid search (ties to the even encoding) for the two roundings.
# ---------------------------------------------------------------------------------------------
F32 = np.float32


def _e4m3_grid() -> list[tuple[Fraction, int]]:
    """All finite non-negative E4M3 (fn) values with their byte, decoded from the bit fields."""
    grid = []
    for byte in range(0x7F):  # 0x7F is NaN
        exp, man = byte >> 3, byte & 7
        value = (
            Fraction(man, 8) * Fraction(2) ** -6
            if exp == 0
            else (1 + Fraction(man, 8)) * Fraction(2) ** (exp - 7)
        )
        grid.append((value, byte))
    return grid


E4M3_GRID = _e4m3_grid()
E2M1_GRID = [(Fraction(v).limit_denominator(2), code) for code, v in enumerate([0, 0.5, 1, 1.5, 2, 3, 4, 6])]


def _nearest_even(value: float, grid: list[tuple[Fraction, int]]) -> tuple[Fraction, int]:
    """Nearest grid point to |value| (saturating at the top); on a tie the point whose code is even."""
    v = Fraction(abs(value)) if math.isfinite(value) else Fraction(10**40)
    return min(grid, key=lambda p: (abs(p[0] - v), p[1] & 1))


def scalar_quantize_block(xs: list[float], g: float) -> tuple[int, list[int]]:
    """(scale byte, 16 codes) for one block, following the spec's order of fp32 operations."""
    g32 = F32(g)
    with np.errstate(over="ignore", divide="ignore"):
        amax = max(abs(F32(x)) for x in xs)
        t = F32(F32(amax) / F32(6.0)) / g32
        s_val, s_byte = _nearest_even(float(t), E4M3_GRID)
        if s_val == 0:
            return 0, [0] * 16
        denom = F32(F32(float(s_val)) * g32)
        codes = []
        for x in xs:
            y = F32(F32(x) / denom)
            _, mag = _nearest_even(float(y), E2M1_GRID)
            codes.append(mag | (8 if np.signbit(y) else 0))
    return s_byte, codes


def scalar_quantize(x: torch.Tensor, g: float) -> tuple[list[int], list[int]]:
    """Bytes of data and scales for a 1-D float32 tensor of length D."""
    vals = x.tolist()
    data, scales = [], []
    for b in range(0, len(vals), 16):
        s, codes = scalar_quantize_block(vals[b : b + 16], g)
        scales.append(s)
        data.extend(codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2))
    return data, scales


def q_bytes(x: torch.Tensor, g: float = 1.0) -> tuple[list[int], list[int]]:
    data, scales = nvfp4.quantize(x, g)
    return data.flatten().tolist(), scales.view(torch.uint8).flatten().tolist()


def block(*values: float) -> torch.Tensor:
    """One 16-value block: the given values padded with zeros."""
    assert len(values) <= 16
    return torch.tensor([*values] + [0.0] * (16 - len(values)), dtype=torch.float32)


def outlier_heavy(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Gaussian values with ~2% outliers up to 300x and a few channels scaled 50x (like real K)."""
    x = torch.randn(shape, generator=gen)
    spikes = torch.rand(shape, generator=gen) < 0.02
    x = torch.where(spikes, x * torch.empty(shape).uniform_(20, 300, generator=gen), x)
    hot = torch.randperm(shape[-1], generator=gen)[:3]
    x[..., hot] *= 50
    return x


# ---------------------------------------------------------------------------------------------
# Exact bytes on crafted inputs (g = 1 and amax = 6 give scale 1.0, so y = x exactly)
# ---------------------------------------------------------------------------------------------
def test_scale_one_is_e4m3_byte_0x38_and_grid_values_are_exact():
    data, scales = q_bytes(block(6, 0, 0.5, 1, 1.5, 2, 3, 4, -0.5, -1, -1.5, -2, -3, -4, -6, 6))
    assert scales == [0x38]
    codes = [7, 0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 7]
    assert data == [codes[i] | codes[i + 1] << 4 for i in range(0, 16, 2)]


def test_e2m1_ties_round_to_the_even_code():
    x = block(6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6)
    data, scales = q_bytes(x)
    assert scales == [0x38]
    # 6->7 0.25->0 | 0.75->2 1.25->2 | 1.75->4 2.5->4 | 3.5->6 5->6 | negatives: same | sign bit
    assert data == [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0xFE]


def test_values_just_off_a_tie_round_to_the_nearest():
    up = [np.nextafter(F32(t), F32(9)) for t in (0.25, 1.25, 2.5, 5.0)]  # one fp32 ulp off the tie
    down = [np.nextafter(F32(t), F32(0)) for t in (0.75, 1.75, 3.5)]
    x = block(6, *[float(v) for v in up + down])
    codes = [7, 1, 3, 5, 7, 1, 3, 5] + [0] * 8
    data, _ = q_bytes(x)
    assert data == [codes[i] | codes[i + 1] << 4 for i in range(0, 16, 2)]


def test_even_element_goes_in_the_low_nibble():
    data, _ = q_bytes(block(0.5, 1.0, 6.0, -0.5))
    assert data[:2] == [0x21, 0x97]  # (code 1 | code 2 << 4), (code 7 | code 9 << 4)


def test_e4m3_scale_tie_rounds_to_even_and_codes_saturate_at_6():
    # amax / 6 = 1.0625 is halfway between E4M3 1.0 (even) and 1.125: scale 1.0, so y = 6.375 -> 6.
    data, scales = q_bytes(block(6.375, 6.2, -6.3))
    assert scales == [0x38]
    assert data[:2] == [0x77, 0x0F]


def test_scale_saturates_at_448_and_codes_at_6_with_a_small_global_scale():
    g = 2.0**-10  # amax / 6 / g = 1.7e8 >> 448
    data, scales = q_bytes(block(1e6, -1e5, 1.0, 0.3), g)
    assert scales == [0x7E]  # 448
    # denom = 448 * 2^-10 = 0.4375: 1e6 -> 6, -1e5 -> -6, 1.0 -> 2.29 -> 2, 0.3 -> 0.69 -> 0.5
    assert data[:2] == [0xF7, 0x14]
    x = nvfp4.dequantize(*nvfp4.quantize(block(1e6, -1e5, 1.0, 0.3), g), g)
    assert x[:4].tolist() == [6 * 0.4375, -6 * 0.4375, 2 * 0.4375, 0.5 * 0.4375]


def test_scale_saturates_with_unit_global_scale_above_6_times_448():
    x = block(1e5, 2688, -2000)
    data, scales = q_bytes(x)
    assert scales == [0x7E] and data[:2] == [0x77, 0x0E]  # y = 223, 6, -4.46 -> 6, 6, -4
    out = nvfp4.dequantize(*nvfp4.quantize(x, 1.0), 1.0)
    assert out[:3].tolist() == [2688.0, 2688.0, -1792.0]


def test_zero_and_negative_zero_blocks_store_scale_0_and_code_0():
    x = torch.cat([torch.zeros(16), torch.full((16,), -0.0)])
    data, scales = q_bytes(x)
    assert scales == [0, 0] and data == [0] * 16
    assert torch.equal(nvfp4.dequantize(*nvfp4.quantize(x, 1.0), 1.0), torch.zeros(32))


def test_tiny_blocks_whose_scale_underflows_store_zeros_even_for_negatives():
    tie = 6 * 2.0**-10  # amax / 6 = 2^-10: halfway between 0 and the smallest subnormal 2^-9 -> 0
    x = torch.cat([block(1e-4, -1e-4, 3e-5), block(-tie, tie / 2), block(-tie * 1.01, 1e-4)])
    data, scales = q_bytes(x)
    assert scales == [0, 0, 0x01]  # the third block gets the smallest E4M3 subnormal 2^-9
    assert data[:16] == [0] * 16
    # third block: denom = 2^-9, y = -1.01 * 3 -> -3 (code 13), 1e-4 / 2^-9 = 0.05 -> 0
    assert data[16] == 0x0D


def test_negative_zero_and_small_negatives_in_a_live_block_store_code_8():
    data, _ = q_bytes(block(6, -0.0, -0.1, 0.1, -0.25, 0.0))
    assert data[:3] == [0x87, 0x08, 0x08]


# Inputs found by search where a different order of fp32 operations changes the bytes.
ORDER_CASES = [
    # (block values, g, scale byte, first data byte)
    # (amax / 6) / g rounds to E4M3 1.125 (0x39); amax / (6 * g) would round to 1.25
    ((29.585933685302734,), 4.152411937713623, 0x39, 0x07),
    # scale 1.0, so y = x / g: 22.306364 / 6.373247 = 3.4999998 -> 3 (code 5); x * (1 / g) = 3.5 -> 4
    ((float(F32(6 * F32(6.373247146606445))), 22.306364059448242), 6.373247146606445, 0x38, 0x57),
    # 33.547692 / 6.709538 = 5.0 exactly (tie -> 4, code 6); x * (1 / g) = 5.0000005 -> 6
    ((float(F32(6 * F32(6.709537982940674))), 33.547691345214844), 6.709537982940674, 0x38, 0x67),
]


@pytest.mark.parametrize("values,g,scale_byte,data_byte", ORDER_CASES)
def test_the_order_of_fp32_operations_is_part_of_the_contract(values, g, scale_byte, data_byte):
    x = block(*values)
    data, scales = q_bytes(x, g)
    assert (scales[0], data[0]) == (scale_byte, data_byte)
    assert (data, scales) == scalar_quantize(x, g)


def test_bf16_and_fp16_inputs_give_the_bytes_of_their_fp32_values():
    gen = torch.Generator().manual_seed(1)
    x = outlier_heavy((6, 64), gen)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        d1, s1 = nvfp4.quantize(xd, 0.7)
        d2, s2 = nvfp4.quantize(xd.float(), 0.7)
        assert torch.equal(d1, d2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))
    data, scales = q_bytes(block(6, 0.75, 1.25, -3.5).to(torch.bfloat16))
    assert scales == [0x38] and data[:2] == [0x27, 0xE2]


# ---------------------------------------------------------------------------------------------
# Agreement with the scalar implementation, round trip, size
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [1.0, 0.037, 2.0**-10, 1234.5])
def test_matches_the_independent_scalar_implementation_bit_for_bit(g):
    gen = torch.Generator().manual_seed(int(g * 1000))
    x = torch.cat(
        [
            torch.randn(128, generator=gen) * 3,
            outlier_heavy((128,), gen),
            torch.randn(64, generator=gen) * 1e-3,  # subnormal E4M3 scales
            torch.randn(32, generator=gen) * 1e4,  # saturated scales for small g
            # random multiples of half-steps: lots of exact ties
            torch.randint(-24, 25, (64,), generator=gen).float() * 0.25,
        ]
    )
    data, scales = nvfp4.quantize(x, g)
    ref_data, ref_scales = scalar_quantize(x, g)
    assert scales.view(torch.uint8).tolist() == ref_scales
    assert data.tolist() == ref_data
    # dequantize: (E2M1 * s) * g in fp32
    e2m1 = [float(v) for v in nvfp4.E2M1_VALUES]
    s_vals = [float(E4M3_GRID[b][0]) for b in ref_scales]
    codes = [c for byte in ref_data for c in (byte & 15, byte >> 4)]
    expect = [float(F32(F32(e2m1[c] * s_vals[i // 16]) * F32(g))) for i, c in enumerate(codes)]
    assert nvfp4.dequantize(data, scales, g).tolist() == expect


@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
def test_round_trip_error_is_bounded_per_block(kind):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 4, 128, generator=gen) if kind == "gaussian" else outlier_heavy((64, 4, 128), gen)
    g = float(x.abs().max()) / (6 * 448)  # calibrated: no block saturates
    data, scales = nvfp4.quantize(x, g)
    err = (nvfp4.dequantize(data, scales, g) - x).abs().reshape(-1, 16)
    amax = x.abs().reshape(-1, 16).amax(-1)
    normal = scales.float().flatten() >= 2.0**-6  # E4M3 normal range: scale error <= 1/16
    assert normal.float().mean() > 0.95
    # worst case: half the 4..6 gap (1) against an amax of at least 6 / 1.0625 in code units
    assert (err.amax(-1)[normal] <= amax[normal] * (1.0625 / 6) * (1 + 1e-6)).all()
    rel = (err.pow(2).mean(-1).sqrt() / amax)[normal].mean()
    assert rel < 0.06, rel  # ~0.035-0.045 for gaussian blocks


def test_bytes_per_token_per_layer_is_0_5625_of_fp8():
    t, hk, d = 5, 8, 128
    k = torch.randn(t, hk, d)
    data, scales = nvfp4.quantize(k, 1.0)
    nvfp4_bytes = 2 * (data.numel() * data.element_size() + scales.numel() * scales.element_size()) // t
    k8 = fp8.quantize(k, 1.0)
    fp8_bytes = 2 * k8.numel() * k8.element_size() // t
    assert nvfp4_bytes == bytes_per_token_per_layer("nvfp4", hk, d) == 2 * hk * (d // 2 + d // 16)
    assert fp8_bytes == bytes_per_token_per_layer("fp8_e4m3", hk, d)
    assert nvfp4_bytes / fp8_bytes == 0.5625


def test_shapes_dtypes_and_leading_dims():
    data, scales = nvfp4.quantize(torch.randn(2, 3, 4, 32), 1.0)
    assert data.shape == (2, 3, 4, 16) and data.dtype == torch.uint8
    assert scales.shape == (2, 3, 4, 2) and scales.dtype == torch.float8_e4m3fn
    out = nvfp4.dequantize(data, scales, 1.0, dtype=torch.bfloat16)
    assert out.shape == (2, 3, 4, 32) and out.dtype == torch.bfloat16
    # scales may also be passed as their raw bytes (how the pool and the wire carry them)
    assert torch.equal(
        nvfp4.dequantize(data, scales.view(torch.uint8), 1.0), nvfp4.dequantize(data, scales, 1.0)
    )


def test_global_scale_may_be_a_0d_tensor():
    x = torch.randn(4, 32)
    a = nvfp4.quantize(x, torch.tensor(0.3))
    b = nvfp4.quantize(x, 0.3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


def test_invalid_inputs_raise_value_errors_that_say_what_is_wrong():
    with pytest.raises(ValueError, match="D=24"):
        nvfp4.quantize(torch.randn(2, 24), 1.0)
    for bad in (0.0, -1.0, math.nan, math.inf, 1e-45):
        with pytest.raises(ValueError, match="global_scale"):
            nvfp4.quantize(torch.randn(2, 16), bad)
    for bad_value in (math.nan, math.inf, -math.inf):
        x = torch.randn(2, 32)
        x[1, 17] = bad_value
        with pytest.raises(ValueError, match="NaN or inf"):
            nvfp4.quantize(x, 1.0)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        nvfp4.quantize(torch.randn(2, 16, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="shapes do not match"):
        nvfp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), 1.0)


@pytest.mark.gpu
def test_cuda_bytes_equal_cpu_bytes():
    gen = torch.Generator().manual_seed(3)
    for x in (
        torch.randn(257, 8, 128, generator=gen),
        outlier_heavy((257, 8, 128), gen),
        torch.randn(64, 4, 64, generator=gen) * 1e-3,
    ):
        for g in (1.0, 0.013, float(x.abs().max()) / 2688):
            d_cpu, s_cpu = nvfp4.quantize(x, g)
            d_gpu, s_gpu = nvfp4.quantize(x.cuda(), g)
            assert torch.equal(d_gpu.cpu(), d_cpu)
            assert torch.equal(s_gpu.cpu().view(torch.uint8), s_cpu.view(torch.uint8))
            assert torch.equal(nvfp4.dequantize(d_gpu, s_gpu, g).cpu(), nvfp4.dequantize(d_cpu, s_cpu, g))
        xb = x.to(torch.bfloat16)
        assert torch.equal(nvfp4.quantize(xb.cuda(), 0.5)[0].cpu(), nvfp4.quantize(xb, 0.5)[0])
    for values, g, scale_byte, data_byte in ORDER_CASES:
        data, scales = nvfp4.quantize(block(*values).cuda(), g)
        assert (scales.view(torch.uint8)[0].item(), data[0].item()) == (scale_byte, data_byte)
