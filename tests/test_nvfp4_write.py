"""The NVFP4 pool write (``nvfp4_quantize_kernel`` in nvfp4_kernels/triton/nvfp4_quantize.py, its launches in
nvfp4_kernels/backends/triton_nvfp4.py) against the references: the bytes of ``ReferenceBackend.write_kv``
(nvfp4_kernels.nvfp4.quantize) and, with block select, of ``BlockSelectBackend.write_kv``
(nvfp4_kernels.nvfp4_block_select) in the named slots, every other slot untouched; K and V of a layer in one launch.

The cases run under Triton's CPU interpreter (a subprocess: the interpreter is chosen before kernels are defined)
and on a GPU. Inputs cover what the pool sees and the edges of the format: bf16 / fp16 / fp32 rows, K and V as
strided views of one projection output, shuffled slots, heavy-tailed values, an all-zero block (scale 0), blocks
whose scale saturates at 448 or falls into the E4M3 subnormals, -0.0, and a block of exact E2M1 ties (its scale
is exactly 1 under a power-of-two global scale). The launch count is taken from Triton's own runtime, compiling
for sm_90a with the launches counted instead of run (offline/triton_target_driver.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nvfp4_kernels.backends.block_select import BlockSelectBackend
from nvfp4_kernels.backends.reference import ReferenceBackend
from tests.test_reference_backend import make_layer
from tests.triton_interpreter import interpreted_cases

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (page size, KV heads, head_dim, k_scale, v_scale, row dtype, block select)
CASES = [(4, 2, 64, 0.5, 0.25, torch.bfloat16, False), (16, 8, 128, 0.004, 0.5, torch.bfloat16, False),
         (4, 2, 128, 0.0371, 0.05, torch.float16, False), (4, 1, 256, 0.3, 2.5, torch.float32, False),
         (4, 2, 64, 0.5, 0.011, torch.bfloat16, True), (16, 8, 128, 0.004, 0.5, torch.bfloat16, True)]
# tokens a write. Under the interpreter (~30 ms a program of 1024 values, ~270 ms with block select) 17: more
# than a 16-slot page, and several programs with a partial last one at Hk < 8 (one token a program at 8 x 128);
# the GPU run keeps 40
TOKENS = (1, 7, 17)
GPU_TOKENS = (1, 7, 40)
# |y| at the E2M1 midpoints (ties to the even code), then 6 so that the block's scale is amax/6/g = 1 exactly
_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0)


def _plant(x: torch.Tensor, g: float) -> None:
    """Edge blocks in the first token's heads of ``x`` [n, hk, d] (fp32), global scale ``g``."""
    x[0, 0, :16] = 0.0  # scale 0: codes 0
    x[0, 0, 16:32] = torch.tensor(_TIES) * g
    x[0, -1, :16] = 1e4 * g  # amax / 6 / g > 448: the scale saturates
    x[0, -1, 16:32] = torch.linspace(-3e-3, 3e-3, 16) * g  # a scale in the E4M3 subnormals
    x[0, -1, 32] = -0.0


def _rows(n: int, hk: int, d: int, dtype: torch.dtype, scales: tuple[float, float], gen: torch.Generator,
          device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [n, hk, d] as strided views of one [n, 2 + hk + hk, d] output on ``device`` (as a QKV projection
    gives them), heavy-tailed, with the edge blocks planted."""
    qkv = torch.randn(n, 2 * hk + 2, d, generator=gen) * torch.exp(torch.randn(n, 2 * hk + 2, d, generator=gen) * 2)
    k, v = qkv[:, 2:2 + hk], qkv[:, 2 + hk:]
    _plant(k, scales[0])
    _plant(v, scales[1])
    qkv = qkv.clamp(-6e4, 6e4).to(dtype).to(device)
    return qkv[:, 2:2 + hk], qkv[:, 2 + hk:]


def check_cases(part_type, device: str, tokens=TOKENS) -> int:
    """Every case with each of ``tokens`` tokens through ``part_type(block_select).write_kv``; returns the
    number of (case, tokens) checked."""
    done = 0
    for s, hk, d, ks, vs, dt, select in CASES:
        for n in tokens:
            gen = torch.Generator().manual_seed(done)
            ours, ref = (make_layer("nvfp4", 12, s, hk, d, torch.Generator().manual_seed(1)) for _ in range(2))
            for layer in (ours, ref):
                layer.k_scale, layer.v_scale = ks, vs
            slots = torch.randperm(12 * s, generator=gen)[:n]
            k, v = _rows(n, hk, d, dt, (ks, vs), gen, device)
            assert k.stride(0) == (2 * hk + 2) * d  # strided views, as the model hands them over
            (BlockSelectBackend() if select else ReferenceBackend()).write_kv(ref, slots, k.cpu(), v.cpu())
            for name in ("k", "v", "k_sf", "v_sf"):
                setattr(ours, name, getattr(ours, name).to(device))
            part_type(select).write_kv(ours, slots.to(device), k, v)
            for name in ("k", "v", "k_sf", "v_sf"):
                got, want = getattr(ours, name).cpu().view(torch.uint8), getattr(ref, name).view(torch.uint8)
                assert torch.equal(got, want), (hk, d, dt, select, n, name)
            done += 1
    return done


def test_kernel_in_the_triton_interpreter_matches_the_references():
    pytest.importorskip("triton")
    cases, output = interpreted_cases("nvfp4_kernels.backends.triton_nvfp4:TritonNvfp4Write", "tests.test_nvfp4_write")
    assert cases == len(CASES) * len(TOKENS), output


_MIXED = textwrap.dedent("""
    import torch
    from nvfp4_kernels.backends.reference import ReferenceBackend
    from nvfp4_kernels.backends.triton_nvfp4 import TritonNvfp4Write
    from tests.test_reference_backend import make_layer
    gen = torch.Generator().manual_seed(4)
    ours, ref = (make_layer("nvfp4", 6, 4, 2, 64, torch.Generator().manual_seed(1)) for _ in range(2))
    k = torch.randn(9, 2, 64, generator=gen)  # fp32 K beside bf16 V: one launch each
    v = torch.randn(9, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(24, generator=gen)[:9]
    TritonNvfp4Write().write_kv(ours, slots, k, v)
    ReferenceBackend().write_kv(ref, slots, k, v)
    for n in ("k", "v", "k_sf", "v_sf"):
        assert torch.equal(getattr(ours, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)), n
    print("mixed ok")
""")


def test_k_and_v_of_different_dtypes_are_written_as_the_reference_writes_them():
    pytest.importorskip("triton")
    from tests.triton_interpreter import run_interpreted

    res = run_interpreted(_MIXED)
    assert res.returncode == 0 and "mixed ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


_LAUNCHES = textwrap.dedent("""
    from collections import Counter
    import torch
    from engine.kv_pool import KVPool
    from nvfp4_kernels.backends.triton_backend import TritonBackend, TritonBlockSelectBackend
    from nvfp4_kernels.backends.triton_kv_write import write_rows
    from offline.triton_target_driver import TritonTarget, compile_for

    def launches(drv, write, kv_dtype, k_dtype=torch.bfloat16):
        layer = KVPool(kv_dtype, 1, 4, 16, 8, 128, scratch_pages=1).layers[0]
        k = torch.zeros(3, 8, 128, dtype=k_dtype)
        before = Counter(drv.launches)
        write(layer, torch.arange(3), k, torch.zeros(3, 8, 128, dtype=torch.bfloat16))
        return dict(drv.launches - before)

    # one driver for the process: a kernel keeps the launcher of its first launch
    with compile_for(TritonTarget((9, 0))) as drv:
        print("nvfp4", launches(drv, TritonBackend().write_kv, "nvfp4"))
        print("select", launches(drv, TritonBlockSelectBackend().write_kv, "nvfp4"))
        print("mixed", launches(drv, TritonBackend().write_kv, "nvfp4", torch.float32))
        print("fp8", launches(drv, write_rows, "fp8_e4m3"))  # CPU rows: the launch itself, not the part
""")


def test_a_layer_write_is_one_launch_for_k_and_v(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _LAUNCHES], cwd=REPO, env=env, capture_output=True, text=True,
                         check=False, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert got["nvfp4"] == "{'nvfp4_quantize_kernel': 1}" and got["select"] == got["nvfp4"], got
    assert got["mixed"] == "{'nvfp4_quantize_kernel': 2}", got  # K and V of different dtypes: one launch each
    assert got["fp8"] == "{'kv_write_kernel': 1}", got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_the_gpu_matches_the_references_byte_for_byte():
    from nvfp4_kernels.backends.triton_nvfp4 import TritonNvfp4Write

    assert check_cases(TritonNvfp4Write, "cuda", GPU_TOKENS) == len(CASES) * len(GPU_TOKENS)
