"""The KV rotation kernel (kernels/head_rotate.py): q, k, v rotated in one launch and the output rotated back in
one, against engine/kv_rotation.py's ``rotate`` / ``unrotate`` (the PyTorch reference).

* Triton's interpreter (a subprocess) runs the kernel on CPU tensors: bf16/fp16/fp32 heads of D 16/64/128, row
  counts that are and are not multiples of the block, empty tensors; every value within one rounding step of the
  reference (the fp32 sums differ only in order), most identical, and the round trip returns the input.
* Bad shapes, dtypes and devices get a ValueError; heads the kernel does not take are reported by ``supports``.
* On a GPU (marked ``gpu``): the same comparison, and an engine with ``--kv-rotation hadamard`` decodes greedily
  as the PyTorch rotation does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kv_rotation import rotate, rotation_matrix, unrotate
from kernels import head_rotate
from tests.triton_interpreter import interpreted_cases

CASES = [(torch.bfloat16, 128, 3, 8, 32), (torch.float16, 64, 17, 2, 4), (torch.float32, 16, 1, 1, 2),
         (torch.bfloat16, 128, 70, 8, 32), (torch.bfloat16, 64, 0, 2, 8)]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.numel() == 0:
        return
    scale = want.float().abs().amax().clamp_min(1e-30)
    step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}[want.dtype]
    diff = (got.float() - want.float()).abs()
    assert float(diff.max() / scale) <= 2 * step, float(diff.max() / scale)
    if want.dtype != torch.float32:
        assert float((got == want).float().mean()) >= 0.9  # rounding differences only where a sum sits on a tie


def check_cases(fns, device: str) -> int:
    """Every CASE on ``device``; ``fns`` is the kernels.head_rotate module. Returns the number of cases."""
    g = torch.Generator().manual_seed(0)
    for dt, d, t, hk, hq in CASES:
        r = rotation_matrix("hadamard", d, device)
        q = (torch.randn(t, hq, d, generator=g) * 3).to(dt).to(device)
        k = (torch.randn(t, hk, d, generator=g) * 3).to(dt).to(device)
        v = torch.randn(t, hk, d, generator=g).to(dt).to(device)
        k[..., 3] *= 30  # an outlier channel
        oq, ok, ov = fns.rotate_qkv(q, k, v, r)
        for got, x in ((oq, q), (ok, k), (ov, v)):
            _close(got, rotate(x, r))
        _close(fns.unrotate_heads(oq, r), unrotate(oq, r))
        if dt == torch.float32 and t:
            assert torch.allclose(fns.unrotate_heads(oq, r), q, atol=1e-4 * float(q.abs().max()))
    return len(CASES)


def test_the_kernel_matches_the_pytorch_rotation_under_the_interpreter():
    cases, output = interpreted_cases("kernels:head_rotate", "tests.test_head_rotate")
    assert cases == len(CASES), output


def test_bad_inputs_get_clear_errors_and_supports_names_what_the_kernel_takes():
    r = rotation_matrix("hadamard", 64)
    x = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    assert head_rotate.supports(x, r)
    assert not head_rotate.supports(torch.zeros(2, 4, 8), rotation_matrix("hadamard", 8))  # D < 16
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        head_rotate.rotate_qkv(x.view(8, 64), x, x, r)
    with pytest.raises(ValueError, match="fp32"):
        head_rotate.unrotate_heads(x, r.to(torch.bfloat16))
    with pytest.raises(ValueError, match="rotate_qkv v takes"):  # a head dim other than the rotation's
        r32 = rotation_matrix("hadamard", 32)
        head_rotate.rotate_qkv(torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), torch.zeros(1, 1, 64), r32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_matches_the_pytorch_rotation_on_gpu():
    assert check_cases(head_rotate, "cuda") == len(CASES)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_kernel_compiles_for_sm90a_without_spills(tmp_path, d):
    import os
    import subprocess

    from kernels.triton.head_rotate import rotate_heads_kernel
    from tests.test_kernel_crosscompile import _TOOLS, _compile

    sig = {**{n: "*bf16" for n in ("X0", "X1", "X2")}, "R": "*fp32", **{n: "*bf16" for n in ("O0", "O1", "O2")},
           **{n: "i32" for n in ("n0", "n1", "n2")}}
    k = _compile(rotate_heads_kernel, sig, {"D": d, "BLOCK": head_rotate._BLOCK, "TRANSPOSE": False}, 90)
    path = tmp_path / "k.cubin"
    path.write_bytes(k.asm["cubin"])
    res = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True,
                         check=True).stdout
    assert "LOCAL:0" in res and "STACK:0" in res, res
