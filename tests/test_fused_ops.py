"""The fused decoder-layer kernels (nvfp4_kernels/fused_ops.py) against their PyTorch references (nvfp4_kernels/model_ops.py).

* Which ops the model runs: ``model_ops`` picks the Triton ops for CUDA tensors only, and the reference when
  fused ops are off; the CPU model runs the reference ops, bit-identical to the unfused layer it replaced.
* Triton's CPU interpreter (a subprocess: the interpreter must be chosen before the kernels are defined) runs
  every kernel on random and outlier-heavy inputs, batch 1 / 7 (1 / 16 with outliers), head_dim 128 with GQA
  32/8 and 8/2 heads (and an odd width / head_dim 96 for the masks), then a whole bf16 model with the Triton
  ops vs the reference, with and without the Hadamard K/V rotation. Tolerances (bf16):
  |out - ref| <= 2^-7 |ref| + 2^-8 max|ref| (one bf16 rounding step of the value or of an intermediate the
  reference rounds), and at most 1% of the elements differ at all; v heads and fp32 outputs as stated per
  check.
* sm_90a cross-compile (no GPU): each kernel compiles with no local-memory spills; register counts printed.
* GPU: the engine's greedy tokens with the fused ops equal those without (also under --kv-rotation hadamard).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.triton_interpreter import PRELUDE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_model_ops_choose_triton_for_cuda_tensors_only():
    from nvfp4_kernels.model_ops import REFERENCE_OPS
    from nvfp4_kernels.op_select import model_ops

    assert model_ops("cpu") is REFERENCE_OPS and model_ops(torch.device("cpu"), fused=True) is REFERENCE_OPS
    assert model_ops("cuda", fused=False) is REFERENCE_OPS
    pytest.importorskip("triton")
    assert model_ops("cuda:0").name == "triton" and model_ops(torch.device("cuda")).name == "triton"


def _unfused_forward(model, input_ids, positions, attn):
    """The decoder as engine/model.py computed it before the fused ops: separate adds, norms, rope."""
    import torch.nn.functional as F

    from nvfp4_kernels.model_ops import REFERENCE_OPS

    h = F.embedding(input_ids, model.model.embed_tokens.weight)
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = a.qkv_proj(x, REFERENCE_OPS).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        n = x.shape[0]
        q, k = a.q_norm(q.view(n, a.num_heads, a.head_dim)), a.k_norm(k.view(n, a.num_kv_heads, a.head_dim))
        q, k = model.rotary(positions, q, k)
        o = attn(i, q, k, v.reshape(n, a.num_kv_heads, a.head_dim).contiguous())
        h = h + a.o_proj(o.reshape(n, a.q_size), REFERENCE_OPS)
        gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(h), REFERENCE_OPS).split(layer.mlp.intermediate_size, -1)
        h = h + layer.mlp.down_proj(F.silu(gate) * up, REFERENCE_OPS)
    return model.model.norm(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_model_with_reference_ops_equals_the_unfused_layer_bit_for_bit(tmp_path, dtype):
    from engine.loader import load_model
    from engine.model import causal_attention_no_cache
    from offline.tiny_model import make_tiny_model

    model = load_model(make_tiny_model(tmp_path / "m", seed=3), dtype=dtype).model
    ids = torch.randint(0, 512, (9,))
    pos = torch.arange(9)
    attn = causal_attention_no_cache([9])
    with torch.no_grad():
        assert torch.equal(model(ids, pos, attn), _unfused_forward(model, ids, pos, attn))


_INTERPRETED = textwrap.dedent("""
    import torch
    from engine.rope import rope_tables
    from nvfp4_kernels import fused_ops, model_ops as ref, op_select

    torch.manual_seed(0)
    BF = torch.bfloat16
    from engine.kv_rotation import head_rotation
    ROT = {dt: head_rotation("hadamard", 128, "cpu", dt) for dt in (BF, torch.float16, torch.float32)}

    def check(name, out, expect, rtol=2**-7, atol_frac=2**-8, max_diff_frac=0.01):
        out, expect = out.float(), expect.float()
        assert out.shape == expect.shape, (name, out.shape, expect.shape)
        bound = rtol * expect.abs() + atol_frac * expect.abs().max()
        err = (out - expect).abs()
        assert bool((err <= bound).all()), (name, float((err - bound).max()))
        frac = float((out != expect).float().mean())
        assert frac <= max_diff_frac, (name, frac)
        return frac

    def inputs(shape, outliers, dtype=BF):
        x = torch.randn(shape)
        if outliers:
            x = x * torch.exp(torch.randn(shape) * 1.5)
            x[..., 3] *= 80.0  # one outlier channel, as Qwen's hidden states have
        return x.to(dtype)

    worst = 0.0
    for outliers in (False, True):
        # rows 1, 7 and (outlier inputs) 16, a count divisible by 16 (what Triton specializes on when
        # compiling; the interpreter does not, and no kernel takes the row count: each row is its own
        # program, so more rows only add programs; the outlier inputs need no second odd row count)
        for t in ((1, 7) if not outliers else (1, 16)):
            for n in (4096, 1000):
                x, r = inputs((t, n), outliers), inputs((t, n), outliers)
                w = (1 + 0.3 * torch.randn(n)).to(BF)
                worst = max(worst, check("rms_norm", fused_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)))
                out, s = fused_ops.add_rms_norm(x, r, w, 1e-6)
                eout, es = ref.add_rms_norm(x, r, w, 1e-6)
                assert torch.equal(s, es), "residual sum"
                worst = max(worst, check("add_rms_norm", out, eout))
                xs = inputs((t, 2 * n), outliers)[:, :n]  # a strided row view
                worst = max(worst, check("rms_norm strided", fused_ops.rms_norm(xs, w, 1e-6), ref.rms_norm(xs, w, 1e-6)))
            # 3000: blocks 0, 1 full, block 2 a partial tail (1024-column programs); 1000: one partial block
            for inter in (3000, 1000):
                gu = inputs((t, 2 * inter), outliers) * 4
                worst = max(worst, check("silu_mul", fused_ops.silu_mul(gu), ref.silu_mul(gu)))
            # the 32 x 8 head shape at the odd row counts only: under the interpreter it costs 6 s at 16 rows
            for hq, hk, d in ((32, 8, 128), (8, 2, 128), (4, 2, 96))[1 if t == 16 else 0:]:
                cos, sin = rope_tables(d, 1e6, None, 40960, 8192)
                pos = torch.randint(0, 8192, (t,))
                qkv = inputs((t, (hq + 2 * hk) * d), outliers)
                for norm in (True, False):
                    qw = (1 + 0.3 * torch.randn(d)).to(BF) if norm else None
                    kw = (1 + 0.3 * torch.randn(d)).to(BF) if norm else None
                    got = fused_ops.qk_norm_rope(qkv, pos, cos, sin, qw, kw, 1e-6, hq, hk)
                    exp = ref.qk_norm_rope(qkv, pos, cos, sin, qw, kw, 1e-6, hq, hk)
                    worst = max(worst, check("q", got[0], exp[0]), check("k", got[1], exp[1]))
                    assert torch.equal(got[2], exp[2]), "v heads are copied"
                    assert all(g.is_contiguous() for g in got)
                    if d == 128:  # rotated in the same launch (--kv-rotation): q, k and v
                        got = fused_ops.qk_norm_rope(qkv, pos, cos, sin, qw, kw, 1e-6, hq, hk, ROT[BF])
                        exp = ref.qk_norm_rope(qkv, pos, cos, sin, qw, kw, 1e-6, hq, hk, ROT[BF])
                        for n, g, e in zip("qkv", got, exp):  # a 1-ulp input difference reaches a whole head
                            check("rotated " + n, g, e, max_diff_frac=0.1)
    # fp32 rows (a --dtype float32 model on CUDA): no intermediate rounding, differences at fp32 level only
    x32, w32 = inputs((7, 4096), True, torch.float32), torch.randn(4096)
    torch.testing.assert_close(fused_ops.rms_norm(x32, w32, 1e-6), ref.rms_norm(x32, w32, 1e-6), rtol=1e-5, atol=1e-5)
    gu32 = inputs((7, 2000), True, torch.float32)
    torch.testing.assert_close(fused_ops.silu_mul(gu32), ref.silu_mul(gu32), rtol=1e-5, atol=1e-5)
    cos, sin = rope_tables(128, 1e6, None, 40960, 8192)
    pos = torch.randint(0, 8192, (7,))
    for dt, tol in ((torch.float16, 2**-9), (torch.float32, 1e-5)):  # the rotation's tf32 / IEEE fp32 products
        qkv = inputs((7, 12 * 128), True, dt)
        for g, e in zip(fused_ops.qk_norm_rope(qkv, pos, cos, sin, None, None, 1e-6, 8, 2, ROT[dt]),
                        ref.qk_norm_rope(qkv, pos, cos, sin, None, None, 1e-6, 8, 2, ROT[dt])):
            torch.testing.assert_close(g.float(), e.float(), rtol=tol, atol=tol * float(e.abs().max()))
    print(f"kernels ok (largest fraction of differing elements {worst:.4f})")

    # the whole model: Triton ops (interpreted) vs the reference, bf16, with and without K/V rotation; the rotated
    # model (q/k/v rotated in qk_norm_rope, o_proj folded) against the plain one up to rounding
    import sys, tempfile
    import engine.model
    from engine.loader import load_model
    from offline.tiny_model import make_tiny_model
    tiny = make_tiny_model(tempfile.mkdtemp(), hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128,
                           intermediate_size=512, seed=1)
    ids, pos = torch.randint(0, 512, (12,)), torch.arange(12)
    attn = engine.model.causal_attention_no_cache([12])
    plain = None
    for kind in ("none", "hadamard"):
        model = load_model(tiny, dtype=BF).model
        if kind != "none":
            model.rotate_kv(ROT[BF])
        with torch.no_grad():
            expect = model.compute_logits(model(ids, pos, attn))
            engine.model.model_ops = lambda device, fused=True: fused_ops.TRITON_OPS
            got = model.compute_logits(model(ids, pos, attn))
            engine.model.model_ops = op_select.model_ops
        rel = float((got - expect).norm() / expect.norm())
        assert rel < 2e-2, (kind, rel)
        assert float((got.argmax(-1) == expect.argmax(-1)).float().mean()) >= 0.9, kind
        plain = expect if plain is None else plain
        moved = float((expect - plain).norm() / plain.norm())
        assert moved < 3e-2, (kind, moved)
        print(f"model ok ({kind}: logits relative error {rel:.2e}, {moved:.2e} from the unrotated model)")
""")


def test_fused_kernels_in_triton_interpreter_match_the_references():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", PRELUDE + _INTERPRETED], cwd=REPO, env=env, capture_output=True, text=True,
                         check=False, timeout=600)
    assert res.returncode == 0 and res.stdout.count("model ok") == 2, res.stdout[-2000:] + res.stderr[-4000:]
    print(res.stdout)


def _sm90a(fn, signature: dict, constexprs: dict, num_warps: int, tmp_path):
    """Compile for sm_90a (no GPU needed); returns (registers per thread, SASS)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(signature) if signature[k].startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 2})
    path = tmp_path / f"{fn.__name__}.cubin"
    path.write_bytes(k.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", str(path)], capture_output=True,
                         text=True, check=True).stdout
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                          check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert re.search(r"STACK:0\b", res) and re.search(r"LOCAL:0\b", res), res
    return regs, sass


_NORM_SIG = {"X": "*bf16", "RES": "*bf16", "W": "*bf16", "OUT": "*bf16", "RES_OUT": "*bf16", "stride_x": "i32",
             "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "n_cols": "i32", "eps": "fp32"}
_QK_SIG = {"QKV": "*bf16", "POS": "*i64", "COS": "*fp32", "SIN": "*fp32", "QW": "*bf16", "KW": "*bf16",
           "Q": "*bf16", "K": "*bf16", "V": "*bf16", "U": "*bf16", "stride_t": "i32", "stride_cos": "i32",
           "eps": "fp32", "rot_scale": "fp32"}


@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_kernel_compiles_for_sm90a_without_spills(tmp_path, residual):
    from nvfp4_kernels.fused_ops import _norm_warps
    from nvfp4_kernels.triton.rmsnorm import rmsnorm_kernel

    regs, sass = _sm90a(rmsnorm_kernel, _NORM_SIG, {"BLOCK": 4096, "HAS_RESIDUAL": residual}, _norm_warps(4096),
                        tmp_path)
    print(f"rmsnorm_kernel (hidden 4096, residual={residual}): {regs} registers")
    assert "STL" not in sass and "LDL" not in sass and regs <= 128


def test_silu_mul_kernel_compiles_for_sm90a_without_spills(tmp_path):
    from nvfp4_kernels.fused_ops import _SILU_BLOCK
    from nvfp4_kernels.triton.silu_mul import silu_mul_kernel

    regs, sass = _sm90a(silu_mul_kernel, {"GU": "*bf16", "OUT": "*bf16", "stride_gu": "i32", "stride_o": "i32",
                                          "n_cols": "i32"}, {"BLOCK": _SILU_BLOCK}, 4, tmp_path)
    print(f"silu_mul_kernel: {regs} registers")
    assert "STL" not in sass and "LDL" not in sass and regs <= 128


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize(("hq", "hk"), [(32, 8), (8, 2), (64, 8)])
def test_qk_norm_rope_kernel_compiles_for_sm90a_without_spills(tmp_path, hq, hk, rotate):
    from nvfp4_kernels.fused_ops import _qk_warps
    from nvfp4_kernels.triton.qk_norm_rope import qk_norm_rope_kernel

    hq_p, hk_p = (max(16, h) if rotate else h for h in (hq, hk))
    consts = {"HQ": hq, "HK": hk, "HQ_P": hq_p, "HK_P": hk_p, "D": 128, "HALF_P": 64, "V_P": hk * 128,
              "HAS_NORM": True, "ROTATE": rotate}
    regs, sass = _sm90a(qk_norm_rope_kernel, _QK_SIG, consts, _qk_warps(hq_p * 64, rotate), tmp_path)
    print(f"qk_norm_rope_kernel ({hq}/{hk} heads, head_dim 128, rotate={rotate}): {regs} registers")
    assert "STL" not in sass and "LDL" not in sass and regs <= 128
    assert ("HMMA" in sass) == rotate  # the rotation's products on tensor cores


@pytest.mark.gpu
def test_fused_kernels_on_gpu_match_the_references():
    """The kernels on the GPU (its rsqrt, exp and FMA contraction) within the same bounds as in the interpreter."""
    from engine.rope import rope_tables
    from nvfp4_kernels import fused_ops
    from nvfp4_kernels import model_ops as ref

    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    for t in (1, 7, 64):
        x = (torch.randn(t, 4096, device=dev) * torch.exp(torch.randn(t, 4096, device=dev))).to(bf)
        r, w = torch.randn_like(x), (1 + 0.3 * torch.randn(4096, device=dev)).to(bf)
        out, s = fused_ops.add_rms_norm(x, r, w, 1e-6)
        eout, es = ref.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, es)
        torch.testing.assert_close(out, eout, rtol=2**-7, atol=2**-8 * float(eout.abs().max()))
        gu = torch.randn(t, 2 * 12288, device=dev, dtype=bf) * 4
        torch.testing.assert_close(fused_ops.silu_mul(gu), ref.silu_mul(gu), rtol=2**-7, atol=2**-8 * 4)
        cos, sin = (tab.to(dev) for tab in rope_tables(128, 1e6, None, 40960, 8192))
        for hq, hk in ((32, 8), (8, 2)):
            qkv = torch.randn(t, (hq + 2 * hk) * 128, device=dev, dtype=bf)
            pos = torch.randint(0, 8192, (t,), device=dev)
            nw = (1 + 0.3 * torch.randn(128, device=dev)).to(bf)
            got = fused_ops.qk_norm_rope(qkv, pos, cos, sin, nw, nw, 1e-6, hq, hk)
            exp = ref.qk_norm_rope(qkv, pos, cos, sin, nw, nw, 1e-6, hq, hk)
            for g, e in zip(got[:2], exp[:2]):
                torch.testing.assert_close(g, e, rtol=2**-7, atol=2**-8 * float(e.abs().max()))
            assert torch.equal(got[2], exp[2])


@pytest.mark.gpu
@pytest.mark.parametrize(("kv_dtype", "rotation"), [("nvfp4", "none"), ("fp8_e4m3", "none"), ("nvfp4", "hadamard")])
def test_engine_greedy_tokens_with_fused_ops_equal_those_without(tmp_path, kv_dtype, rotation):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from offline.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=2,
                                    head_dim=128, intermediate_size=1024, seed=4))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 9, 40, 2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for disabled in (False, True):
        eng = Engine(EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16", disable_fused_ops=disabled,
                                  cache=CacheConfig(kv_dtype=kv_dtype, kv_rotation=rotation, page_size=16,
                                                    max_total_tokens=4096),
                                  scheduler=SchedulerConfig(chunk_size=64)))
        assert eng.model.fused_ops is not disabled and eng.runner.graphs is not None
        tokens[disabled] = [o.token_ids for o in eng.generate(prompts, greedy)]
        del eng
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
