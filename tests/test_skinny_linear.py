"""The skinny linear (nvfp4_kernels/triton/skinny_linear.py, launched by nvfp4_kernels/skinny_linear.py) against the
fp32 product under Triton's CPU interpreter (odd row counts, a K not a multiple of the block, split-K, the decode
step's config), its refusals, the shapes ``linear`` gives it, and its sm_90a compile without spills."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import PRELUDE, run_interpreted

CASES = """
import torch
from nvfp4_kernels.skinny_linear import DECODE_SKINNY, SkinnyConfig, skinny_linear
torch.manual_seed(0)
worst = 0.0
for m, n, k, cfg in [(1, 96, 512, SkinnyConfig(32, 128, 1)), (5, 80, 384, SkinnyConfig(32, 128, 2)),
                     (16, 64, 1000, SkinnyConfig(16, 256, 3)), (33, 48, 256, SkinnyConfig(16, 64, 1)),
                     (44, 200, 640, DECODE_SKINNY), (3, 64, 128, DECODE_SKINNY)]:
    for dtype in (torch.bfloat16, torch.float16):
        x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) * 0.05).to(dtype)
        y = skinny_linear(x, w, cfg)
        ref = x.float() @ w.float().t()
        assert y.shape == (m, n) and y.dtype == dtype
        worst = max(worst, float(((y.float() - ref).abs() / (ref.abs() + 1)).max()))
assert worst < 2 ** -7, worst  # one rounding of the output
from nvfp4_kernels.model_ops import silu_mul
for m, i, k, cfg in [(1, 48, 384, DECODE_SKINNY), (7, 80, 1000, SkinnyConfig(16, 256)), (44, 64, 256, DECODE_SKINNY)]:
    for dtype in (torch.bfloat16, torch.float16):
        x, w = torch.randn(m, k).to(dtype), (torch.randn(2 * i, k) * 0.05).to(dtype)
        y = skinny_linear(x, w, cfg, gated=True)
        ref = silu_mul((x.float() @ w.float().t()).to(dtype))  # the projection rounded, then silu_mul's roundings
        assert y.shape == (m, i) and y.dtype == dtype
        err = float(((y.float() - ref.float()).abs() / (ref.float().abs() + 1e-2)).max())
        assert err < 2 ** -6, (m, i, k, dtype, err)  # a rounding step of the product moved through silu, at most
        worst = max(worst, err)
x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
for bad_x, bad_w, kw in ((torch.zeros(65, 64), w, {}), (x, torch.zeros(8, 32), {}), (x, w.float(), {}),
                         (x, w.t().contiguous().t(), {}), (x, w, {"cfg": SkinnyConfig(block_k=32), "prefetch": 1}),
                         (x, torch.zeros(7, 64, dtype=torch.bfloat16), {"gated": True}), (x, w, {"cfg": SkinnyConfig(split_k=2), "gated": True})):
    try:
        skinny_linear(bad_x.to(torch.bfloat16), bad_w, **kw)
        raise SystemExit(f"accepted {kw or 'a bad operand'}")
    except ValueError:
        pass
for bad in ({"block_n": 24}, {"split_k": 0}, {"block_k": 8}):
    try:
        SkinnyConfig(**bad)
        raise SystemExit(f"accepted {bad}")
    except ValueError:
        pass
print("ok", worst)
"""


def test_the_kernel_in_the_triton_interpreter_matches_the_fp32_product():
    pytest.importorskip("triton")
    r = run_interpreted(PRELUDE + CASES)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_linear_gives_the_skinny_kernel_the_decode_projections_it_streams_faster():
    pytest.importorskip("triton")
    from nvfp4_kernels.fused_ops import linear
    from nvfp4_kernels.skinny_linear import skinny_applies, skinny_shape

    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)  # Qwen3-8B (N, K)
    for rows in (1, 16):
        assert all(skinny_shape(rows, n, k) for n, k in (qkv, o, gate_up))
    assert skinny_shape(44, *qkv) and skinny_shape(44, *gate_up) and not skinny_shape(44, *o)
    assert not any(skinny_shape(m, *down) for m in (1, 16, 44))
    assert not skinny_shape(65, *qkv) and not skinny_shape(0, *qkv)  # prefill chunks and empty batches: cuBLAS
    x, w, b = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    assert not skinny_applies(x, w, None)  # a CPU tensor: cuBLAS's place is F.linear's
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_warm_cache_compiles_one_row_count_of_each_variant_of_the_hopper_projections_without_a_bias():
    pytest.importorskip("triton")
    from engine.model_config import ModelConfig
    from nvfp4_kernels.skinny_linear import SKINNY_MAX_ROWS, skinny_capability, skinny_row_classes
    from offline.warm_cache import _projections

    def variant(m):  # the tile height and Triton's specialization of M
        return max(16, 1 << (m - 1).bit_length()), m == 1, m % 16 == 0

    rows = skinny_row_classes()
    assert sorted({variant(m) for m in rows}) == sorted({variant(m) for m in range(1, SKINNY_MAX_ROWS + 1)})
    assert len({variant(m) for m in rows}) == len(rows)
    assert skinny_capability((9, 0)) and not any(skinny_capability(c) for c in ((8, 9), (10, 0), (12, 0), None))
    base = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "architectures": ["Qwen3ForCausalLM"]}
    assert _projections(ModelConfig.from_dict(base)) == ((256 + 2 * 128, 256, False), (256, 256, False),
                                                         (1024, 256, True), (256, 512, False))
    biased = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]})  # q/k/v with a bias
    assert _projections(biased) == ((256, 256, False), (1024, 256, True), (256, 512, False))


def test_the_probes_configs_compile_for_sm90a_without_spills():
    pytest.importorskip("triton")
    from benchmarks.kernels.probe_gemv import compile_report, parse_config

    for gated in (False, True):
        rep = compile_report(parse_config("32:128:1:4"), rows=64, gated=gated)
        assert not rep["spills"] and rep["registers"] <= 128, (gated, rep)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 44, 64])
def test_linear_on_gpu_under_a_cuda_graph_matches_cublas(rows):
    """The decode projections of Qwen3-8B through ``linear`` (the skinny kernel where it applies, with PDL on
    SM90+) captured in one CUDA graph, against cuBLAS's product of the same operands."""
    import torch.nn.functional as F

    from nvfp4_kernels.fused_ops import gate_up_silu_mul, linear, silu_mul
    from nvfp4_kernels.skinny_linear import skinny_applies

    torch.manual_seed(0)
    dev = torch.device("cuda")
    shapes = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
    ws = [(torch.randn(n, k, device=dev) * 0.02).bfloat16() for n, k in shapes]
    xs = [torch.randn(rows, k, device=dev).bfloat16() for _, k in shapes]
    outs = [linear(x, w, None) for x, w in zip(xs, ws)]  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear(x, w, None) for x, w in zip(xs, ws)]
    for x in xs:
        x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    used = [skinny_applies(x, w, None) for x, w in zip(xs, ws)]
    if torch.cuda.get_device_capability()[0] == 9:  # Hopper: where linear takes the skinny kernel
        assert used[0] and used[2] and not used[3], used
    for x, w, y in zip(xs, ws, outs):
        ref = F.linear(x, w).float()
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err < 2 ** -7, err
    x, w = xs[2], ws[2]  # the MLP's input side: one gated launch against cuBLAS then silu_mul
    ref = silu_mul(F.linear(x, w)).float()
    err = float((gate_up_silu_mul(x, w, None).float() - ref).abs().max() / ref.abs().max())
    assert err < 2 ** -6, err
