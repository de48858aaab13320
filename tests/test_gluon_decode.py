"""The Gluon NVFP4 decodes (nvfp4_kernels/triton/nvfp4_decode_gluon.py, cp.async; nvfp4_decode_tma.py, TMA): CPU
cross-compile checks, the kernel each GPU and pool gets, and GPU correctness.

* Without a GPU: the kernel compiles for sm_90a at every supported head_dim and step size, with tensor-core
  HMMA fed by ldmatrix (LDSM, and its transposed form for V), cp.async copies, no local-memory spills, and a
  register count that lets several one-warp programs share an SM; the scale broadcast is a layout identity
  (the kernel asserts it at compile time, so compiling is the test). Its config is validated, and a launch
  on CPU tensors fails with an error that names the Triton kernel instead.
* The TMA-fed kernel compiles for sm_90a with TMA loads and ldmatrix, no spills; Hopper picks it where the pool's
  geometry fits TMA's boxes and the cp.async kernel where not; a forced kernel that cannot run is refused.
* On a GPU (marked ``gpu``): outputs of both match the reference backend for short, page-straddling and split
  sequences, G in {1, 4, 8} and D in {64, 128, 256}, and match the Triton kernel; NaN scales in the slots past a
  prompt (whatever a reused page holds) never reach the output.
"""

from __future__ import annotations

import math
import os
import re
import subprocess

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from nvfp4_kernels.backends.decode_choice import RESIDENT_PROGRAMS
from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel, TritonBackend
from nvfp4_kernels.kv_layout import LayerKV

_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_SIG = {"Q": "*bf16", "K16": "*i16", "KSF": "*u8", "V16": "*i16", "VSF": "*u8", "PAGE_TABLE": "*i32",
        "SEQ_LENS": "*i32", "O_PART": "*fp32", "LSE_PART": "*fp32", "qk_scale": "fp32", "out_scale": "fp32",
        **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_ptb", "stride_pb", "stride_ph", "stride_ps",
                              "stride_lb", "stride_lh", "chunk_tokens")}}
_ALIGNED = ("stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh")


def _compile(d: int, bt: int, stages: int, group: int, max_registers: int | None = None):
    from nvfp4_kernels.triton.nvfp4_decode_gluon import nvfp4_decode_gluon_kernel

    cx = {"HK": 8, "G": group, "GN": max(8, triton.next_power_of_2(group)), "D": d, "PAGE": 16, "BT": bt,
          "STAGES": stages}
    names = list(_SIG)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if _SIG[n].startswith("*") or n in _ALIGNED}
    src = GluonASTSource(fn=nvfp4_decode_gluon_kernel, signature=dict(_SIG, **{k: "constexpr" for k in cx}),
                         constexprs=cx, attrs=attrs)
    cap = {} if max_registers is None else {"maxnreg": max_registers}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, **cap})


@pytest.mark.parametrize("d,bt,stages,group,cap", [(128, 32, 3, 4, None), (128, 64, 3, 4, None), (128, 16, 4, 1, None),
                                                   (64, 32, 3, 8, None), (256, 16, 2, 4, None), (128, 32, 2, 4, 112),
                                                   (128, 32, 2, 16, None), (64, 32, 2, 32, None)])
def test_gluon_decode_compiles_for_sm90a_with_ldmatrix_cp_async_and_no_spills(tmp_path, d, bt, stages, group, cap):
    k = _compile(d, bt, stages, group, cap)
    path = tmp_path / "k.cubin"
    path.write_bytes(k.asm["cubin"])
    res = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-res-usage", str(path)], capture_output=True,
                         text=True, check=True).stdout
    sass = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-sass", str(path)], capture_output=True,
                          text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert "LOCAL:0" in res and "STACK:0" in res, res  # no spills, also under a register cap
    # <= 168 registers: 12 one-warp programs per SM (the 4-warp Triton kernel holds 226: 8 warps per SM)
    if max(8, group) * d <= 1024:  # G <= 8 at D 128: the serving shapes of GQA models
        assert regs <= 168, f"{regs} registers: too few one-warp programs would share an SM"
    assert "HMMA.16816.F32" in sass
    assert "LDSM.16.M88" in sass and "LDSM.16.MT88" in sass  # K as is, V transposed, straight from smem
    assert "LDGSTS" in sass  # cp.async ring
    assert "STL" not in sass


def test_gluon_config_is_validated():
    DecodeConfig(1, 32, 3, 16, DecodeKernel.GLUON)
    with pytest.raises(ValueError, match="one warp"):
        DecodeConfig(4, 32, 3, 16, DecodeKernel.GLUON)
    with pytest.raises(ValueError, match="num_stages"):
        DecodeConfig(1, 32, 1, 16, DecodeKernel.GLUON)
    with pytest.raises(ValueError, match="max_registers"):
        DecodeConfig(1, 32, 2, 16, DecodeKernel.GLUON, 300)
    assert DecodeConfig(1, 32, 2, 24, DecodeKernel.GLUON, 112).launch_options == {"maxnreg": 112}
    assert DecodeConfig(1, 32, 3, 16, DecodeKernel.GLUON).label == "gluon_nw1_bw32_st3_p16"


def _layer(dev, pages: int, hk: int, d: int, seed: int) -> LayerKV:
    g = torch.Generator(device="cpu").manual_seed(seed)
    layer = LayerKV("nvfp4", 16, hk, d,
                    torch.zeros(pages, 16, hk, d // 2, dtype=torch.uint8, device=dev),
                    torch.zeros(pages, 16, hk, d // 2, dtype=torch.uint8, device=dev),
                    torch.zeros(pages, 16, hk, d // 16, dtype=torch.float8_e4m3fn, device=dev),
                    torch.zeros(pages, 16, hk, d // 16, dtype=torch.float8_e4m3fn, device=dev), 0.05, 0.03)
    k = torch.randn(pages * 16, hk, d, generator=g)
    k[:, :, 7] *= 40.0  # an outlier channel, as real K has
    v = torch.randn(pages * 16, hk, d, generator=g)
    ReferenceBackend().write_kv(layer, torch.arange(pages * 16, device=dev), k.to(dev), v.to(dev))
    return layer


def test_gluon_decode_on_cpu_tensors_is_refused_with_a_clear_error():
    layer = _layer(torch.device("cpu"), 3, 2, 128, 0)
    tb = TritonBackend(DecodeConfig(1, 32, 3, 16, DecodeKernel.GLUON))
    pt = torch.arange(3, dtype=torch.int32)[None]
    plan = tb.plan_decode(pt, torch.tensor([40], dtype=torch.int32), 8, 2, 128, 16)
    with pytest.raises(ValueError, match="compute capability 8.9 or newer, got no GPU.*DecodeKernel.TRITON"):
        tb.decode(plan, torch.zeros(1, 8, 128, dtype=torch.bfloat16), layer, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group,d,lens", [(4, 128, (5000, 17, 1, 33)), (1, 128, (3001, 640)), (8, 64, (2049, 100)),
                                          (4, 256, (1500, 16))])
@pytest.mark.parametrize("bt,stages,cap", [(32, 3, None), (64, 2, None), (16, 4, None), (32, 2, 112)])
@pytest.mark.parametrize("kernel,lean,hg", [(DecodeKernel.GLUON, False, 1), (DecodeKernel.GLUON_TMA, False, 1),
                                            (DecodeKernel.GLUON_TMA, True, 1), (DecodeKernel.GLUON_TMA, False, 4),
                                            (DecodeKernel.GLUON_TMA, True, 4)])
def test_gluon_decode_matches_the_reference_on_gpu(group, d, lens, bt, stages, cap, kernel, lean, hg):
    if hg != 1 and (d != 128 or cap is not None):
        pytest.skip("the grouped TMA decode is built for head_dim 128 under its own register cap")
    dev = torch.device("cuda")
    hk = 4
    maxp = max(-(-n // 16) for n in lens) + 1
    pages = len(lens) * maxp + 5
    layer = _layer(dev, pages, hk, d, seed=group * d)
    pt = torch.randperm(pages, device=dev)[: len(lens) * maxp].reshape(len(lens), maxp).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hk * group, d, device=dev).to(torch.bfloat16)
    sm = 1 / math.sqrt(d)
    # programs_per_sm 64: long rows get many splits, so split edges and empty splits are exercised too
    tb = TritonBackend(DecodeConfig(1, bt, stages, 64, kernel, cap, lean, head_group=hg))
    plan = tb.plan_decode(pt, seq, hk * group, hk, d, 16)
    ours = tb.decode(plan, q, layer, sm).float()
    ref = ReferenceBackend().decode(ReferenceBackend().plan_decode(pt, seq, hk * group, hk, d, 16), q, layer, sm).float()
    triton_out = TritonBackend().decode(TritonBackend().plan_decode(pt, seq, hk * group, hk, d, 16), q, layer, sm)
    assert torch.isfinite(ours).all()
    assert float((ours - ref).norm() / ref.norm()) < 5e-3
    assert float((ours - triton_out.float()).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("npg,stages", [(2, 2), (1, 3)])
@pytest.mark.parametrize("lean", [False, True])
def test_the_tma_fed_decode_compiles_for_sm90a_with_tma_and_ldmatrix_and_no_spills(npg, stages, lean):
    from benchmarks.kernels.probe_tma import compile_sm90, sass_report

    r = sass_report(compile_sm90(npg=npg, stages=stages, lean=lean))
    assert not r["spills"] and r["registers"] <= 168, r
    assert r["common_path_instructions"] < r["loop_instructions"], r  # the tail step's scale zeroing is branched around
    assert r["tma_loads"] >= 4 * npg and r["ldmatrix"] > 0, r  # four TMA copies per page of a step
    assert r["loop_ops"].get("HMMA", 0) == 16 * npg, r  # 8 QK + 8 PV products per page of 16 tokens


@pytest.mark.parametrize("npg,stages,lean", [(1, 4, True), (2, 2, True), (1, 4, False)])
def test_the_grouped_tma_decode_compiles_for_sm90a_with_a_copy_partition_that_gives_its_registers_up(npg, stages,
                                                                                                       lean):
    """4 KV heads per CTA (nvfp4_decode_tma_grouped): a 4-warp copy partition and a one-warp partition per head, 8
    warps; setmaxnreg moves the copy partition's registers to the heads' warps (24 and 136 a thread within the
    launch's cap of 80), no spills, and each partition's barriers stay inside its own warps (bar.warp.sync)."""
    from benchmarks.kernels.probe_tma import compile_sm90_grouped, sass_report

    k = compile_sm90_grouped(npg=npg, stages=stages, lean=lean)
    ptx = k.asm["ptx"]
    assert k.metadata.num_warps == 8
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t136" in ptx
    assert "bar.warp.sync" in ptx
    r = sass_report(k)
    assert not r["spills"] and r["registers"] <= 80 and r["tma_loads"] > 0 and r["ldmatrix"] > 0, r


def test_the_grouped_tma_config_is_validated_and_refused_where_its_heads_do_not_group():
    """head_group is the TMA kernel's, 1 or 4; a pool whose KV heads or head_dim do not group is refused at the
    launch with an error that names why."""
    from nvfp4_kernels.backends.triton_backend import DeviceTarget

    assert DecodeConfig(1, 16, 4, 12, DecodeKernel.GLUON_TMA, lean=True, head_group=4).label == (
        "gluon-tma_nw1_bw16_st4_p12_lean_hg4")
    assert DecodeConfig(1, 16, 4, 12, DecodeKernel.GLUON_TMA, head_group=4).launch_options == {"maxnreg": 80}
    with pytest.raises(ValueError, match="head_group must be 1 or 4, got 2"):
        DecodeConfig(1, 32, 2, 12, DecodeKernel.GLUON_TMA, head_group=2)
    with pytest.raises(ValueError, match="head_group is the TMA kernel's"):
        DecodeConfig(1, 32, 2, 12, DecodeKernel.GLUON, head_group=4)
    layer = _layer(torch.device("cpu"), 8, 2, 128, seed=1)
    pt = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    tb = TritonBackend(DecodeConfig(1, 32, 2, 12, DecodeKernel.GLUON_TMA, head_group=4),
                       target=DeviceTarget(132, (9, 0)))
    plan = tb.plan_decode(pt, torch.tensor([40], dtype=torch.int32), 8, 2, 128, 16)
    with pytest.raises(ValueError, match="needs head_dim 128 and KV heads a multiple of 4, got head_dim 128 and 2"):
        tb.decode(plan, torch.zeros(1, 8, 128, dtype=torch.bfloat16), layer, 0.1)


@pytest.mark.parametrize("key", sorted(RESIDENT_PROGRAMS, key=str), ids=str)
def test_each_default_gluon_tiling_fills_waves_of_the_programs_that_fit_on_an_sm90_sm(key):
    """The split-KV grid's wave (decode_choice.RESIDENT_PROGRAMS) is what the compiled kernel's registers and
    shared memory let run at once on one SM: a wrong figure leaves a grid of whole waves ragged at its end."""
    from benchmarks.kernels.probe_tma import compile_sm90, sass_report, sm90_resident_programs
    from nvfp4_kernels.backends.decode_choice import default_decode_config

    kernel, lean, d, gn = key

    def resident(group: int) -> int:
        k = compile_sm90(d=d, group=group, lean=lean) if kernel is DecodeKernel.GLUON_TMA else _compile(d, 32, 2, group)
        return sm90_resident_programs(sass_report(k)["registers"], k.metadata.shared)

    # the fewest over the groups of that padded size (GN 8: groups 1 to 8, the ends compiled)
    assert min(resident(g) for g in ((1, 8) if gn == 8 else (gn,))) == RESIDENT_PROGRAMS[key]
    forced = default_decode_config(d, (9, 0), gn, kernel, num_kv_heads=8, page_size=16, lean_step=lean)
    assert (forced.kernel, forced.lean) == (kernel, lean)
    # a wave: one round of them for the TMA kernel's kept step, two for its lean step and the cp.async kernel
    assert forced.programs_per_sm == (1 if kernel is DecodeKernel.GLUON_TMA and not lean else 2) * RESIDENT_PROGRAMS[key]


def test_the_split_kv_grid_fills_whole_waves():
    """A grid one program past a whole wave runs a program alone at its end; 1.5 waves run a third at half the
    SM's programs. The split count fills whole waves (of the programs per SM given) where one exists."""
    from nvfp4_kernels.backends.triton_decode import split_geometry

    sms = 132
    for batch, tokens, resident, splits in ((44, 32768, 16, 6), (10, 163840, 16, 26), (1, 1 << 20, 16, 263),
                                            (128, 4096, 16, 2), (84, 32768, 16, 3), (44, 32768, 12, 9)):
        chunk, n = split_geometry(batch, 8, tokens, 32, sms, resident)
        assert n == splits and chunk % 32 == 0 and (n - 1) * chunk < tokens <= n * chunk, (batch, tokens, chunk, n)
        waves = batch * 8 * n / (resident * sms)
        assert waves <= 1 or 0.9 <= waves % 1 or waves % 1 == 0, (batch, tokens, waves)
    assert split_geometry(1, 8, 300, 32, sms, 16) == (160, 2)  # short: splits of at least 256 tokens, at most 2
    assert split_geometry(256, 32, 4096, 32, sms, 16) == (4096, 1)  # more programs than a wave: no split
    assert split_geometry(1, 1, 16, 32, 4, 8) == (32, 1)


def test_hopper_gets_the_tma_kernel_where_the_pool_fits_its_boxes_and_the_cp_async_one_elsewhere():
    from nvfp4_kernels.backends.decode_choice import default_decode_config
    from nvfp4_kernels.backends.decode_kernels import kernel_unfit, tma_fits

    def kernel(d, cap, group, hk, page, forced=None):
        return default_decode_config(d, cap, group, forced, num_kv_heads=hk, page_size=page).kernel

    hopper = (9, 0)
    assert kernel(128, hopper, 4, 8, 16) is DecodeKernel.GLUON_TMA  # Qwen3-8B, Llama-3-8B
    assert kernel(128, hopper, 4, 2, 16) is DecodeKernel.GLUON_TMA  # 2 x 8 scale bytes: one 16-byte row
    assert kernel(128, hopper, 4, 1, 16) is DecodeKernel.GLUON  # an 8-byte scale row: not a TMA box row
    assert kernel(128, hopper, 4, 8, 64) is DecodeKernel.GLUON  # a 32-token step is not a whole 64-token page
    assert kernel(128, hopper, 4, 8, 4) is DecodeKernel.GLUON  # 4-token pages: boxes 64 bytes apart in smem
    assert kernel(128, hopper, 4, 8, 8) is DecodeKernel.GLUON  # not checked on a GPU
    assert kernel(128, (8, 9), 4, 8, 16) is DecodeKernel.TRITON  # Ada: the Gluon kernels are opt-in there
    assert kernel(128, (10, 0), 4, 8, 16) is DecodeKernel.TRITON  # Blackwell: the hardware-cvt Triton kernel
    assert kernel(128, None, 4, 8, 16) is DecodeKernel.TRITON  # the CPU interpreter
    assert kernel(128, hopper, 16, 8, 16) is DecodeKernel.TRITON  # accumulators past the measured registers
    assert kernel(128, (8, 9), 4, 8, 16, DecodeKernel.GLUON_TMA) is DecodeKernel.GLUON_TMA  # forced: checked later
    assert tma_fits(8, 128, 16, 32) and tma_fits(4, 64, 32, 32) and not tma_fits(8, 96, 16, 32)
    assert kernel_unfit(DecodeKernel.GLUON_TMA, 128, (9, 0), 8, 16) is None
    assert "compute capability 9.0 or newer, got compute capability 8.9" in kernel_unfit(DecodeKernel.GLUON_TMA, 128,
                                                                                          (8, 9))
    assert "got 1 KV heads, head_dim 128, page 16" in kernel_unfit(DecodeKernel.GLUON_TMA, 128, (9, 0), 1, 16)
    assert kernel_unfit(DecodeKernel.GLUON, 128, (9, 0), 1, 16) is None  # cp.async takes any pool
    assert kernel_unfit(DecodeKernel.TRITON, 96, None) is None
    with pytest.raises(ValueError, match="one warp"):
        DecodeConfig(4, 32, 2, 24, DecodeKernel.GLUON_TMA)


def test_a_forced_tma_decode_on_a_pool_it_cannot_take_is_refused_with_a_clear_error():
    from nvfp4_kernels.backends.triton_backend import DeviceTarget

    layer = _layer(torch.device("cpu"), 3, 1, 128, 0)  # one KV head: an 8-byte scale row
    tb = TritonBackend(DecodeConfig(1, 32, 2, 24, DecodeKernel.GLUON_TMA), target=DeviceTarget(132, (9, 0)))
    plan = tb.plan_decode(torch.arange(3, dtype=torch.int32)[None], torch.tensor([40], dtype=torch.int32), 4, 1, 128,
                          16)
    with pytest.raises(ValueError, match="multiple of 16 bytes.*got 1 KV heads.*DecodeKernel.TRITON"):
        tb.decode(plan, torch.zeros(1, 4, 128, dtype=torch.bfloat16), layer, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel,lean,hg", [(DecodeKernel.GLUON, False, 1), (DecodeKernel.GLUON_TMA, False, 1),
                                            (DecodeKernel.GLUON_TMA, True, 1), (DecodeKernel.GLUON_TMA, True, 4)])
def test_nan_scales_past_a_prompt_never_reach_the_output_on_gpu(kernel, lean, hg):
    """A reused page holds any bytes past a prompt's end (here NaN block scales, 0x7F): both kernels mask them."""
    dev = torch.device("cuda")
    hk, d, lens = 4, 128, (1001, 40, 17, 1)
    maxp = max(-(-n // 16) for n in lens) + 1
    pages = len(lens) * maxp + 5
    layer = _layer(dev, pages, hk, d, seed=3)
    pt = torch.randperm(pages, device=dev)[: len(lens) * maxp].reshape(len(lens), maxp).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hk * 4, d, device=dev).to(torch.bfloat16)
    ref = ReferenceBackend().decode(ReferenceBackend().plan_decode(pt, seq, hk * 4, hk, d, 16), q, layer, 0.1).float()
    for i, n in enumerate(lens):
        last = int(pt[i, (n - 1) // 16])
        layer.k_sf.view(torch.uint8)[last, (n - 1) % 16 + 1:] = 0x7F
        layer.v_sf.view(torch.uint8)[last, (n - 1) % 16 + 1:] = 0x7F
    tb = TritonBackend(DecodeConfig(1, 32, 2, 24, kernel, lean=lean, head_group=hg))
    ours = tb.decode(tb.plan_decode(pt, seq, hk * 4, hk, d, 16), q, layer, 0.1).float()
    assert torch.isfinite(ours).all()
    assert float((ours - ref).norm() / ref.norm()) < 5e-3


def test_eager_plans_of_the_default_tma_kernel_launch_the_cp_async_one_and_captured_plans_keep_it():
    """The TMA kernel's tensor maps are encoded on the host at each launch: an eager plan (not ``static``) of the
    GPU's default decodes with the cp.async kernel, same tiling and geometry; a forced kernel is always itself."""
    from nvfp4_kernels.backends.base import DecodeOptions
    from nvfp4_kernels.backends.triton_backend import DeviceTarget

    hopper = DeviceTarget(132, (9, 0))
    table, lens = torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, dtype=torch.int32)

    def kernel_of(backend: TritonBackend, static: bool) -> DecodeKernel:
        opts = DecodeOptions("nvfp4", torch.bfloat16, 0.1, static)
        st = backend.plan_decode(table, lens, 32, 8, 128, 16, options=opts).backend_state
        return st.config.kernel, st.num_splits

    auto = TritonBackend(target=hopper)
    assert kernel_of(auto, True) == (DecodeKernel.GLUON_TMA, kernel_of(auto, False)[1])
    assert kernel_of(auto, False)[0] is DecodeKernel.GLUON
    forced = TritonBackend(target=hopper, decode_kernel=DecodeKernel.GLUON_TMA)
    assert kernel_of(forced, False)[0] is DecodeKernel.GLUON_TMA


def test_the_lean_step_is_the_tma_kernels_and_h200s_get_it_by_default():
    """The TMA kernel's lean step (gluon_decode_step.attend, LEAN) measured faster on an H200 and slower on H100s:
    the default picks it by the GPU's name; eager launches (the cp.async kernel) never take it."""
    from nvfp4_kernels.backends.decode_choice import default_decode_config, eager_config, prefers_lean_step

    assert prefers_lean_step("NVIDIA H200") and not prefers_lean_step("NVIDIA H100 80GB HBM3")
    lean = default_decode_config(128, (9, 0), 4, num_kv_heads=8, page_size=16, lean_step=True)
    assert lean.kernel is DecodeKernel.GLUON_TMA and lean.lean and lean.label.endswith("_p32_lean")  # 2 x 16
    assert not default_decode_config(128, (9, 0), 4, num_kv_heads=8, page_size=16).lean
    # where the TMA kernel does not fit, the cp.async kernel runs its one step
    assert not default_decode_config(128, (9, 0), 4, num_kv_heads=8, page_size=4, lean_step=True).lean
    assert eager_config(lean) == DecodeConfig(1, 32, 2, 32, DecodeKernel.GLUON)  # the same plan geometry
    with pytest.raises(ValueError, match="lean step is the TMA kernel's"):
        DecodeConfig(1, 32, 2, 24, DecodeKernel.GLUON, lean=True)
    from nvfp4_kernels.backends.base import DecodeOptions
    from nvfp4_kernels.backends.triton_backend import DeviceTarget

    table, lens = torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for lean_gpu in (False, True):  # a target GPU says which step its plans take (warm-cache, or the GPU's name)
        tb = TritonBackend(target=DeviceTarget(132, (9, 0), lean_step=lean_gpu))
        opts = DecodeOptions("nvfp4", torch.bfloat16, 0.1, True)
        cfg = tb.plan_decode(table, lens, 32, 8, 128, 16, options=opts).backend_state.config
        assert cfg.kernel is DecodeKernel.GLUON_TMA and cfg.lean is lean_gpu


@pytest.mark.parametrize("args", [["--configs", "32:2:24:foo"], ["--configs", "32:2"], ["--configs", "48:2:24"],
                                  ["--launch-only", "4x"], ["--shapes", "1x100"], ["--rounds", "0"]])
def test_the_tma_probe_refuses_bad_arguments_before_any_gpu_work(args, capsys):
    from benchmarks.kernels.probe_tma import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
