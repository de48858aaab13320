"""The parts TritonBackend is composed of (nvfp4_kernels/backends/composition.py): which part serves each phase for
each pool KV dtype, fixed at construction, and the CPU dispatch of the fp8 / bf16 parts to the reference."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from nvfp4_kernels.backends.base import DecodeOptions
from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.backends.registry import get_backend
from tests.test_reference_backend import make_layer, page_table_for

ROOT = Path(__file__).resolve().parents[1]
FP8_BF16 = {"write_kv": "triton-kv-write", "gather_workspace": "reference", "prefill": "flashinfer-prefill, else reference",
            "plan_decode": "triton-nvfp4-decode", "decode": "flashinfer-decode, else reference"}


@pytest.mark.parametrize("name, quantize", [("triton", "triton-nvfp4-quantize"),
                                            ("triton-block-select", "triton-nvfp4-quantize-block-select")])
def test_the_backend_names_the_part_of_every_phase_per_kv_dtype(name, quantize):
    backend = get_backend(name)
    assert backend.name == name
    assert backend.parts.table() == {
        "nvfp4": {"write_kv": quantize, "gather_workspace": "triton-nvfp4-to-fp8",
                  "prefill": "flashinfer-prefill, else reference", "plan_decode": "triton-nvfp4-decode",
                  "decode": "triton-nvfp4-decode"},
        "fp8_e4m3": FP8_BF16,
        "bf16": FP8_BF16,
    }


def test_parts_are_shared_where_they_are_one_and_the_composition_is_fixed():
    parts = get_backend("triton").parts
    assert parts.planner is parts.pool("nvfp4").decode  # one part plans every decode and decodes nvfp4
    assert parts.pool("fp8_e4m3") is parts.pool("bf16") is parts.pool("int4") is parts.other
    reference = parts.pool("bf16").gather_workspace
    assert isinstance(reference, ReferenceBackend)
    assert parts.prefill.fallback is parts.pool("bf16").decode.fallback is reference
    assert parts.pool("bf16").write_kv.name == "triton-kv-write"  # its CPU rows go to a reference of its own
    assert [p.name for p in parts.decode_parts()] == ["triton-nvfp4-decode", "flashinfer-decode"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.prefill = None
    with pytest.raises(TypeError):
        parts.pools["nvfp4"] = parts.other
    assert get_backend("triton").parts.prefill is not parts.prefill  # each backend builds its own parts


def test_constructing_the_backend_imports_no_flashinfer():
    code = ("import sys\nfrom nvfp4_kernels.backends.triton_backend import TritonBackend\nTritonBackend()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flashinfer' or m.endswith('flashinfer_backend')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_on_the_cpu_the_fp8_and_bf16_phases_give_the_reference_results(kv_dtype):
    gen = torch.Generator().manual_seed(7)
    tb, rb = get_backend("triton"), ReferenceBackend()
    ours, ref = (make_layer(kv_dtype, 12, 4, 2, 64, torch.Generator().manual_seed(1)) for _ in range(2))
    slots = torch.randperm(48, generator=gen)[:40]
    k, v = torch.randn(40, 2, 64, generator=gen), torch.randn(40, 2, 64, generator=gen)
    tb.write_kv(ours, slots, k, v)
    rb.write_kv(ref, slots, k, v)
    for n in ("k", "v"):
        assert torch.equal(getattr(ours, n).view(torch.uint8), getattr(ref, n).view(torch.uint8))
    ws = [torch.zeros(40, 2, 64, dtype=ours.workspace_dtype) for _ in range(4)]
    tb.gather_workspace(ours, slots, ws[0], ws[1])
    rb.gather_workspace(ref, slots, ws[2], ws[3])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((ws[0], ws[2]), (ws[1], ws[3])))
    q = torch.randn(40, 4, 64, generator=gen).to(torch.bfloat16)
    plan = tb.plan_prefill([10, 30], [10, 30], 4, 2, 64, torch.device("cpu"))
    assert torch.equal(tb.prefill(plan, q, ws[0], ws[1], ours.ws_k_scale, ours.ws_v_scale, 0.125),
                       rb.prefill(plan, q, ws[0], ws[1], ours.ws_k_scale, ours.ws_v_scale, 0.125))
    table, lens = page_table_for([9, 1, 30], 4, 12, gen), torch.tensor([9, 1, 30], dtype=torch.int32)
    tb.write_kv(ours, torch.arange(48), torch.randn(48, 2, 64, generator=gen), torch.randn(48, 2, 64, generator=gen))
    for static in (False, True):
        tplan = tb.plan_decode(table, lens, 4, 2, 64, 4,
                               options=DecodeOptions(kv_dtype, torch.bfloat16, 0.125, static=static))
        assert tplan.backend_state.fallback is None  # FlashInfer's wrapper is made on CUDA only
        tb.refresh_decode_plan(tplan, table.numpy(), lens.numpy())
        qd = q[:3]
        assert torch.equal(tb.decode(tplan, qd, ours, 0.125), rb.decode(rb.plan_decode(table, lens, 4, 2, 64, 4),
                                                                        qd, ours, 0.125))
    assert tb.warm_decode(ours, [(1, 16), (2, 16)], 4, torch.bfloat16, 0.125, 0) == 0


def test_warm_decode_runs_nothing_for_a_cpu_nvfp4_pool_and_plans_check_their_inputs():
    tb = get_backend("triton")
    layer = make_layer("nvfp4", 4, 16, 2, 64, torch.Generator().manual_seed(2))
    assert tb.warm_decode(layer, [(1, 16)], 4, torch.bfloat16, 0.125, 0) == 0
    with pytest.raises(ValueError, match="int32"):
        tb.plan_decode(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, dtype=torch.int32), 4, 2, 64, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tb.plan_decode(torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 3, 2, 64, 16)
    with pytest.raises(TypeError, match="plan from TritonBackend.plan_decode"):
        tb.decode(ReferenceBackend().plan_decode(torch.zeros(1, 1, dtype=torch.int32),
                                                 torch.ones(1, dtype=torch.int32), 4, 2, 64, 16),
                  torch.zeros(1, 4, 64, dtype=torch.bfloat16), layer, 0.125)
    st = tb.plan_decode(torch.zeros(2, 40, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 4, 2, 64, 16
                        ).backend_state
    assert (st.num_splits, tuple(st.o_part.shape)) == (3, (2, 4, 3, 64))


def test_the_plans_of_one_backend_share_one_pair_of_split_buffers_grown_by_doubling():
    """An engine keeps a plan per (batch, width) bucket it captured; their split outputs are views of one pair
    (a decode writes them and its merge reads them within the one call, decodes run one after another)."""
    tb = get_backend("triton")

    def plan(batch: int, pages: int):
        return tb.plan_decode(torch.zeros(batch, pages, dtype=torch.int32), torch.ones(batch, dtype=torch.int32),
                              4, 2, 64, 16).backend_state

    big, small = plan(2, 40), plan(1, 20)
    assert tuple(small.o_part.shape) == (1, 4, small.num_splits, 64) and small.lse_part.shape == (1, 4, small.num_splits)
    assert small.o_part.data_ptr() == big.o_part.data_ptr() and small.lse_part.data_ptr() == big.lse_part.data_ptr()
    grown = plan(8, 40)  # 8 x 4 heads x 3 splits: past the pair, which doubles (at least)
    assert grown.o_part.data_ptr() != big.o_part.data_ptr() and grown.o_part.is_contiguous()
    assert big.o_part.shape == (2, 4, 3, 64)  # an earlier plan keeps the pair it viewed
    assert plan(2, 40).o_part.data_ptr() == grown.o_part.data_ptr()


_POOL = {"num_kv_heads": 8, "page_size": 16}  # Qwen3-8B's pool: 8 KV heads in 16-token pages


def test_the_backend_names_its_decode_kernel_per_kv_dtype_and_gpu():
    """/server_info's decode_kernel: the NVFP4 decode's config follows the GPU (Gluon on Hopper), the
    fp8/bf16 decode is FlashInfer's (the reference where it cannot run)."""
    from nvfp4_kernels.backends.triton_backend import DeviceTarget, TritonBackend

    cpu = torch.device("cpu")
    assert TritonBackend().decode_kernel("nvfp4", 128, 4, cpu, **_POOL) == "triton-nvfp4-decode:triton_nw4_bw32_st2_p8"
    hopper = TritonBackend(target=DeviceTarget(132, (9, 0)))
    # Hopper: the TMA-fed Gluon kernel where the pool's geometry takes it, else the cp.async one
    assert hopper.decode_kernel("nvfp4", 128, 4, cpu, **_POOL) == "triton-nvfp4-decode:gluon-tma_nw1_bw32_st2_p12"
    assert hopper.decode_kernel("nvfp4", 128, 4, cpu, num_kv_heads=1, page_size=16).endswith(":gluon_nw1_bw32_st2_p24")
    assert hopper.decode_kernel("nvfp4", 128, 4, cpu, num_kv_heads=8, page_size=64).endswith(":gluon_nw1_bw32_st2_p24")
    assert hopper.decode_kernel("nvfp4", 96, 4, cpu, **_POOL).startswith("triton-nvfp4-decode:triton_")  # no Gluon tiling
    blackwell = TritonBackend(target=DeviceTarget(148, (10, 0)))
    assert blackwell.decode_kernel("nvfp4", 128, 4, cpu, **_POOL).startswith("triton-nvfp4-decode:triton_")
    assert TritonBackend().decode_kernel("fp8_e4m3", 128, 4, cpu, **_POOL).startswith("flashinfer-decode")
    # groups whose accumulators take many more registers than the measured case stay on the Triton kernel
    assert hopper.decode_kernel("nvfp4", 128, 16, cpu, **_POOL).startswith("triton-nvfp4-decode:triton_")
    assert hopper.decode_kernel("nvfp4", 256, 4, cpu, **_POOL).startswith("triton-nvfp4-decode:triton_")
    assert hopper.decode_kernel("nvfp4", 64, 16, cpu, **_POOL).startswith("triton-nvfp4-decode:gluon-tma_")


def test_nvfp4_decode_kernel_flag_picks_the_kernel_and_other_backends_refuse_it():
    from engine.config import EngineConfig
    from nvfp4_kernels.backends.registry import get_backend

    cpu = torch.device("cpu")
    assert get_backend("triton", cpu, "gluon").decode_kernel("nvfp4", 128, 4, cpu, **_POOL).endswith(":gluon_nw1_bw32_st2_p24")
    assert get_backend("triton", cpu, "triton").decode_kernel("nvfp4", 128, 4, cpu, **_POOL).endswith(":triton_nw4_bw32_st2_p8")
    assert get_backend("triton", cpu, "gluon-tma").decode_kernel("nvfp4", 128, 4, cpu, **_POOL).endswith(
        ":gluon-tma_nw1_bw32_st2_p12")
    assert get_backend("triton-block-select", cpu, "gluon").decode_kernel("nvfp4", 128, 4, cpu, **_POOL).endswith(":gluon_nw1_bw32_st2_p24")
    with pytest.raises(ValueError, match="picks a kernel of the triton backends"):
        get_backend("auto", cpu, "gluon")  # auto on the CPU is the reference backend
    with pytest.raises(ValueError, match="--nvfp4-decode-kernel must be one of"):
        get_backend("triton", cpu, "cuda")
    with pytest.raises(ValueError, match="--nvfp4-decode-kernel must be one of"):
        EngineConfig(model_dir="m", nvfp4_decode_kernel="marlin")
