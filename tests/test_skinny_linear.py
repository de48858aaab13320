"""The skinny linear of the GEMV probe (benchmarks/kernels/skinny_linear.py) against the fp32 product under Triton's
CPU interpreter (odd row counts, a K not a multiple of the block, split-K), and compiled for sm_90a without spills."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import PRELUDE, run_interpreted

CASES = """
import torch
from benchmarks.kernels.skinny_linear import skinny_linear
torch.manual_seed(0)
worst = 0.0
for m, n, k, bn, bk, sk in [(1, 96, 512, 32, 128, 1), (5, 80, 384, 32, 128, 2), (16, 64, 1000, 16, 256, 3),
                            (33, 48, 256, 16, 64, 1)]:
    x, w = torch.randn(m, k).to(torch.bfloat16), (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    y = skinny_linear(x, w, block_n=bn, block_k=bk, split_k=sk)
    ref = x.float() @ w.float().t()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    worst = max(worst, float(((y.float() - ref).abs() / (ref.abs() + 1)).max()))
assert worst < 2 ** -7, worst  # one bf16 rounding of the output
x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
for bad_x, bad_w, kw in ((torch.zeros(65, 64), w, {}), (x, torch.zeros(8, 32), {}), (x, w, {"block_n": 24}),
                         (x, w, {"split_k": 0}), (x, w, {"block_k": 32, "prefetch": 1})):
    try:
        skinny_linear(bad_x.to(torch.bfloat16), bad_w.to(torch.bfloat16), **kw)
        raise SystemExit(f"accepted {kw or 'a bad shape'}")
    except ValueError:
        pass
print("ok", worst)
"""


def test_the_kernel_in_the_triton_interpreter_matches_the_fp32_product():
    pytest.importorskip("triton")
    r = run_interpreted(PRELUDE + CASES)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_the_probes_configs_compile_for_sm90a_without_spills():
    pytest.importorskip("triton")
    from benchmarks.kernels.probe_gemv import compile_report, parse_config

    rep = compile_report(parse_config("16:256:1:3"), rows=16)
    assert not rep["spills"] and rep["registers"] <= 128, rep
