"""Programmatic dependent launch of the decode step's small kernels (nvfp4_kernels/programmatic_launch.py).

CPU: each of those kernels takes a ``PDL`` constexpr that, when on, puts the grid-dependency wait and the early
launch of the next kernel first in its code (sm_90a PTX and SASS), and nothing when off; the NVFP4 decode kernels
never wait on a grid dependency (they are launched without PDL); the launch keywords follow the tensor's device
and the process switch. GPU: a step's kernels launched with PDL inside a CUDA graph give the outputs of launches
without it (the other GPU tests run with PDL, the default).
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from nvfp4_kernels import programmatic_launch
from tests.test_fused_ops import _NORM_SIG, _QK_SIG
from tests.test_gluon_decode import _compile as _compile_gluon
from tests.test_kernel_crosscompile import _DECODE_SIG, _QUANT_SIG, _compile, _sass


def _kernels(pdl: bool):
    """(name, compiled for sm_90a) of every kernel of a decode step launched with PDL where it is on."""
    from nvfp4_kernels.backends.triton_nvfp4 import quant_block_rows
    from nvfp4_kernels.triton.kv_write import kv_write_kernel
    from nvfp4_kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel
    from nvfp4_kernels.triton.qk_norm_rope import qk_norm_rope_kernel
    from nvfp4_kernels.triton.rmsnorm import rmsnorm_kernel
    from nvfp4_kernels.triton.silu_mul import silu_mul_kernel

    p = {"PDL": pdl}
    kv_sig = {"K": "*bf16", "V": "*bf16", "SLOTS": "*i64", "POOL_K": "*u8", "POOL_V": "*u8", "num_rows": "i32",
              "k_scale": "fp32", "v_scale": "fp32",
              **{n: "i32" for n in ("stride_kt", "stride_kh", "stride_vt", "stride_vh")}}
    yield "rmsnorm", _compile(rmsnorm_kernel, _NORM_SIG, {"BLOCK": 4096, "HAS_RESIDUAL": True, **p}, 90, 8)
    yield "silu_mul", _compile(silu_mul_kernel, {"GU": "*bf16", "OUT": "*bf16", "stride_gu": "i32",
                                                 "stride_o": "i32", "n_cols": "i32"}, {"BLOCK": 1024, **p}, 90)
    yield "qk_norm_rope", _compile(qk_norm_rope_kernel, _QK_SIG,
                                   {"HQ": 32, "HK": 8, "HQ_P": 32, "HK_P": 8, "D": 128, "HALF_P": 64, "V_P": 1024,
                                    "HAS_NORM": True, "ROTATE": False, **p}, 90)
    yield "kv_write", _compile(kv_write_kernel, kv_sig, {"HK": 8, "D": 128, "BLOCK_R": 8, "FP8": True,
                                                         "X_IS_BF16": True, **p}, 90)
    yield "nvfp4_quantize", _compile(nvfp4_quantize_kernel, _QUANT_SIG,
                                     {"HK": 8, "D": 128, "BLOCK_R": quant_block_rows(128, False), **p}, 90)


def test_each_small_step_kernel_waits_for_the_grid_first_when_launched_with_pdl(tmp_path):
    for name, k in _kernels(True):
        ptx = k.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") >= 1 and ptx.count("griddepcontrol.launch_dependents") >= 1, name
        # first in the code: no global load or store comes before the wait
        before = ptx[:ptx.index("griddepcontrol.wait")]
        assert not re.search(r"\b(ld|st|cp\.async)\.global", before), f"{name} touches memory before the wait"
        sass = _sass(k, tmp_path)  # ACQBULK: the wait; PREEXIT: the next kernel's early launch
        assert "ACQBULK" in sass and "PREEXIT" in sass, name
    # without PDL the same kernels compile to no grid-dependency control at all (one checked: the gate is shared)
    name, k = next(_kernels(False))
    assert "griddepcontrol" not in k.asm["ptx"] and "ACQBULK" not in _sass(k, tmp_path), name


def test_the_nvfp4_decode_kernels_never_wait_on_a_grid_dependency(tmp_path):
    from nvfp4_kernels.triton.nvfp4_decode import merge_kernel, nvfp4_decode_kernel

    kernels = [_compile(nvfp4_decode_kernel, _DECODE_SIG, {"HK": 8, "G": 4, "GP": 16, "D": 128, "PAGE": 16, "NW": 4,
                                                           "BW": 32, "MODE": 0}, 90),
               _compile(merge_kernel, {"O_PART": "*fp32", "LSE_PART": "*fp32", "O": "*bf16", "num_splits": "i32",
                                       "stride_ob": "i32", "stride_oh": "i32"}, {"D": 128, "SPLIT_TILE": 16}, 90),
               _compile_gluon(128, 32, 2, 4)]
    for k in kernels:
        assert "griddepcontrol" not in k.asm["ptx"]
        assert "ACQBULK" not in _sass(k, tmp_path)


def test_a_named_target_gives_its_launch_keywords_on_cpu_tensors_and_the_state_comes_back():
    cpu = torch.zeros(1)
    with programmatic_launch.for_target((9, 0)):
        assert programmatic_launch.pdl_args(cpu) == {"PDL": True, "launch_pdl": True}
    with programmatic_launch.for_target((9, 0), enabled=False):
        assert not programmatic_launch.uses_pdl(cpu)
    with programmatic_launch.for_target((8, 9)):
        assert not programmatic_launch.uses_pdl(cpu)
    assert not programmatic_launch.uses_pdl(cpu) and programmatic_launch.enabled()


def test_launch_keywords_follow_the_device_and_the_switch():
    cpu = torch.zeros(1)
    assert programmatic_launch.pdl_args(cpu) == {"PDL": False, "launch_pdl": False}
    assert programmatic_launch.enabled()
    with programmatic_launch.for_target((9, 0)):  # a GPU that takes PDL: the switch alone turns it off
        assert programmatic_launch.uses_pdl(cpu)
        programmatic_launch.set_enabled(False)
        assert not programmatic_launch.enabled() and not programmatic_launch.uses_pdl(cpu)
    assert programmatic_launch.enabled()  # for_target put the switch back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_kernels_under_a_graph_with_pdl_equal_launches_without_it():
    """A chain of dependent kernels (each reads the last one's output) captured with PDL gives the same bytes as
    the chain launched without it: every wait held the order of the stream."""
    from nvfp4_kernels import fused_ops

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs SM90+")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    gu_w = torch.randn(4096, 2 * 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64

    def chain(inp):
        h = inp
        res = torch.zeros_like(inp)
        for _ in range(6):
            normed, res = fused_ops.add_rms_norm(h, res, w, 1e-6)
            h = fused_ops.silu_mul(fused_ops.rms_norm(normed, w, 1e-6) @ gu_w)
        return h

    results = {}
    for on in (False, True):
        programmatic_launch.set_enabled(on)
        try:
            static = x.clone()
            chain(static)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(static)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            results[on] = out.clone()
        finally:
            programmatic_launch.set_enabled(True)
    assert torch.equal(results[True], results[False])
