"""The fp8_e4m3 / bf16 pool write (nvfp4_kernels/triton/kv_write.py, its launch nvfp4_kernels/backends/triton_kv_write.py) against
``ReferenceBackend.write_kv``: the same bytes in the named slots, every other slot untouched.

The cases run under Triton's CPU interpreter (a subprocess: the interpreter is chosen before kernels are defined)
and on a GPU. Inputs cover what the pool sees and the edges of the encodings: bf16 / fp16 / fp32 rows, K and V
as strided views of one projection output, shuffled slots, values past +-448 x scale, +-inf, -0.0, the E4M3
subnormal range, bf16 rounding ties; NaN stays NaN (only NaN-ness is compared: torch's NaN bits differ by
device)."""

from __future__ import annotations

import os

import pytest
import torch

from nvfp4_kernels.backends.reference import ReferenceBackend
from tests.test_reference_backend import make_layer
from tests.triton_interpreter import interpreted_cases

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (kv_dtype, page size, KV heads, head_dim, k_scale, v_scale, row dtype)
CASES = [("fp8_e4m3", 4, 2, 64, 1.0, 1.0, torch.bfloat16), ("fp8_e4m3", 16, 8, 128, 0.0371, 0.05, torch.bfloat16),
         ("fp8_e4m3", 4, 2, 64, 7.0, 0.3, torch.bfloat16), ("fp8_e4m3", 4, 2, 32, 0.3, 2.5, torch.float16), ("fp8_e4m3", 4, 1, 16, 0.7, 0.011, torch.float32),
         ("bf16", 4, 2, 64, 1.0, 1.0, torch.bfloat16), ("bf16", 16, 8, 128, 1.0, 1.0, torch.float16),
         ("bf16", 4, 2, 32, 1.0, 1.0, torch.float32)]


def _rows(n: int, hk: int, d: int, dtype: torch.dtype, gen: torch.Generator,
          device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [n, hk, d] as strided views of one [n, 2 + hk + hk, d] output on ``device`` (as a QKV projection
    gives them), with the encodings' edge values planted."""
    qkv = (torch.randn(n, 2 * hk + 2, d, generator=gen) * 3).to(dtype)
    # 406 and -700 under the scale 7, 0.00439453125 under 0.3: a reciprocal multiply instead of the division
    # encodes them differently
    edges = torch.tensor([float("inf"), -float("inf"), -0.0, 1e4, -1e4, 1e-3, -2e-3, 3e-4, 406.0, -700.0,
                          0.00439453125, float("nan")])
    if dtype == torch.float32:  # bf16 ties (round to even either way) and a value just past a tie
        edges = torch.cat([edges, torch.tensor([1.00390625, 1.01171875, 1.0039063])])
    flat = qkv.view(-1)
    flat[: edges.numel()] = edges.to(dtype)
    flat[-edges.numel():] = edges.to(dtype)
    qkv = qkv.to(device)
    return qkv[:, 2:2 + hk], qkv[:, 2 + hk:]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bytes, NaN compared as NaN-ness."""
    nan = a.float().isnan()
    bits = torch.int16 if a.element_size() == 2 else torch.uint8
    return bool(torch.equal(nan, b.float().isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan]))


def check_cases(write, device: str) -> int:
    """Every case with 1, 7 and 40 tokens; returns the number of (case, tokens) checked."""
    done = 0
    for kv_dtype, s, hk, d, ks, vs, dt in CASES:
        for n in (1, 7, 40):
            gen = torch.Generator().manual_seed(done)
            ours, ref = (make_layer(kv_dtype, 12, s, hk, d, torch.Generator().manual_seed(1)) for _ in range(2))
            for layer in (ours, ref):
                layer.k_scale, layer.v_scale = ks, vs
            slots = torch.randperm(12 * s, generator=gen)[:n]
            k, v = _rows(n, hk, d, dt, gen, device)
            assert k.stride(0) == (2 * hk + 2) * d  # strided views, as the model hands them over
            ReferenceBackend().write_kv(ref, slots, k.cpu(), v.cpu())
            ours.k, ours.v = ours.k.to(device), ours.v.to(device)
            write(ours, slots.to(device), k, v)
            for name in ("k", "v"):
                got, want = getattr(ours, name).cpu(), getattr(ref, name)
                assert _same(got, want), (kv_dtype, hk, d, dt, n, name)
            done += 1
    return done


def test_kernel_in_the_triton_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    cases, output = interpreted_cases("nvfp4_kernels.backends.triton_kv_write:write_rows", "tests.test_kv_write")
    assert cases == len(CASES) * 3, output


def test_cpu_rows_and_unservable_pools_go_to_the_reference():
    pytest.importorskip("triton")
    from nvfp4_kernels.backends.triton_kv_write import TritonDenseWrite

    part = TritonDenseWrite()
    gen = torch.Generator().manual_seed(3)
    ours, ref = (make_layer("fp8_e4m3", 4, 4, 2, 64, torch.Generator().manual_seed(1)) for _ in range(2))
    k, v = _rows(5, 2, 64, torch.bfloat16, gen)
    slots = torch.tensor([3, 0, 9, 15, 4])
    assert not part.serves(ours, k, v)  # CPU tensors
    part.write_kv(ours, slots, k, v)
    ReferenceBackend().write_kv(ref, slots, k, v)
    assert _same(ours.k, ref.k) and _same(ours.v, ref.v)
    with pytest.raises(ValueError, match="write_kv needs slots"):
        part.write_kv(ours, slots, k[:4], v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_the_gpu_matches_the_reference_byte_for_byte():
    from nvfp4_kernels.backends.triton_kv_write import TritonDenseWrite

    part = TritonDenseWrite()

    def write(layer, slots, k, v):
        assert part.serves(layer, k, v)
        part.write_kv(layer, slots, k, v)

    assert check_cases(write, "cuda") == len(CASES) * 3
