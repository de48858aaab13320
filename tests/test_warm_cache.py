"""`nvfp4-serve warm-cache`: compiled without a GPU, the kernels are the ones the engine asks for on the GPU.

* CPU (needs only triton): for a tiny model, sm_90a cubins of the decode kernels (one Triton launch per shape of
  ``DecodeGraphRunner.shapes()``, one cubin per variant those launches specialize into) and of the quantize and
  workspace kernels land in TRITON_CACHE_DIR, with each variant's host launcher stub where gcc is found (linked
  against a libcuda.so.1 made here, as the GPU image links them against the toolkit's stub); a second run adds
  nothing; bad flags give one-line errors.
* GPU: warm-cache run with CUDA hidden for the real GPU's arch and SM count, then an Engine on that GPU
  (triton backend, nvfp4 and fp8_e4m3) generates tokens and adds no compiled artifact to either cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
_TINY = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "hidden_size": 256, "max_position_embeddings": 2048}
_FLAGS = ["--context-length", "1024", "--cuda-graph-max-bs", "16"]


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from offline.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("model")
    make_tiny_model(out, **_TINY)
    return out


def _cubins(cache: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for meta in cache.rglob("*.json"):
        if meta.name.startswith("__grp__"):
            continue
        m = json.loads(meta.read_text())
        assert (meta.parent / f"{m['name']}.cubin").is_file(), meta
        out.setdefault(m["name"], []).append(m)
    return out


def _link_only_libcuda(tmp_path: Path) -> Path:
    """A directory with a libcuda.so.1 that the launcher stubs link against and never call (no GPU here; the
    GPU image links them against the CUDA toolkit's stub library the same way). Empty where there is no gcc."""
    out = tmp_path / "libcuda"
    out.mkdir()
    src = out / "empty.c"
    src.write_text("int nvfp4_serve_link_only;\n")
    if shutil.which("gcc"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out / "libcuda.so.1"),
                        str(src)], check=True, capture_output=True)
    return out


def _stub_toolchain(libcuda: Path) -> str | None:
    """What a warm-cache subprocess with TRITON_LIBCUDA_PATH=libcuda finds: None when it can build launcher
    stubs, else why not."""
    from triton.backends.nvidia import driver

    from offline.triton_host_launchers import why_not

    before = os.environ.get("TRITON_LIBCUDA_PATH")
    os.environ["TRITON_LIBCUDA_PATH"] = str(libcuda)
    driver.libcuda_dirs.cache_clear()
    try:
        return why_not()
    finally:
        if before is None:
            del os.environ["TRITON_LIBCUDA_PATH"]
        else:
            os.environ["TRITON_LIBCUDA_PATH"] = before
        driver.libcuda_dirs.cache_clear()


def test_why_not_names_a_missing_libcuda(tmp_path):
    why = _stub_toolchain(tmp_path)  # a directory without libcuda.so.1
    assert why is not None and ("libcuda.so.1" in why or "compiler" in why or "Python.h" in why)


def _merge_tiles(shapes: list[tuple[int, int]]) -> set[int]:
    """The merge's split tiles of the tiny model's decode plans on the default sm_90a target, both TMA steps."""
    import torch

    from nvfp4_kernels.backends.triton_backend import DeviceTarget, TritonBackend
    from nvfp4_kernels.triton.nvfp4_decode import merge_tile
    from offline.warm_cache import DEFAULT_NUM_SMS

    hq, hk, d = _TINY["num_heads"], _TINY["num_kv_heads"], _TINY["head_dim"]
    tiles = set()
    for lean in (False, True):
        backend = TritonBackend(target=DeviceTarget(DEFAULT_NUM_SMS, (9, 0), lean_step=lean))
        for b, w in shapes:
            plan = backend.plan_decode(torch.zeros(b, w, dtype=torch.int32), torch.ones(b, dtype=torch.int32), hq, hk,
                                       d, 16)
            tiles.add(merge_tile(plan.backend_state.num_splits, d))
    return tiles


def test_warm_cache_compiles_every_decode_shape_and_the_write_kernels_for_sm90a(tiny_model, tmp_path):
    import torch

    from engine.config import CacheConfig, EngineConfig
    from engine.decode_graphs import DecodeGraphRunner, max_width_pages
    from engine.engine import Engine

    cache = tmp_path / "triton"
    libcuda = _link_only_libcuda(tmp_path)
    env = {"TRITON_CACHE_DIR": str(cache), "TRITON_LIBCUDA_PATH": str(libcuda)}
    res = _run(["-m", "nvfp4_serve.cli", "warm-cache", "--model", str(tiny_model), *_FLAGS, "--kv-cache-dtype",
                "nvfp4", "fp8_e4m3"], env)
    assert res.returncode == 0, res.stderr[-4000:]
    launches = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"(\w+_kernel): (\d+) launches, (\d+) variants",
                                                                    res.stdout)}
    eng = Engine(EngineConfig(model_dir=str(tiny_model), device="cpu", context_length=1024,
                              cache=CacheConfig(max_total_tokens=256)))
    runner = DecodeGraphRunner(eng.model, eng.paths, torch.device("cpu"), 16, max_width_pages(1024, 16), capture=False)
    shapes = runner.shapes()
    # on sm_90a the engine decodes with the TMA-fed Gluon kernel (2 KV heads x 128 / 16 = a 16-byte scale row:
    # nvfp4_kernels.backends.decode_choice.default_decode_config), with the H100's step and with the H200's (lean)
    assert launches["nvfp4_decode_tma_kernel"][0] == 2 * len(shapes) == launches["merge_kernel"][0] - 2
    # and the cp.async kernel that eager launches use instead (decode_choice.eager_config), once per step's warm-up
    assert launches["nvfp4_decode_gluon_kernel"] == (2, 1)
    # one compile per step serves every (batch, width): nothing the plan derives from the shape is specialized;
    # the merge compiles once per split tile its plans take (merge_tile: powers of two from 16)
    assert launches["nvfp4_decode_tma_kernel"][1] == 2, res.stdout
    assert launches["merge_kernel"][1] == len(_merge_tiles(shapes)), res.stdout
    cubins = _cubins(cache)
    for name in ("nvfp4_decode_tma_kernel", "nvfp4_decode_gluon_kernel", "merge_kernel", "nvfp4_quantize_kernel", "nvfp4_to_fp8_kernel",
                 "rmsnorm_kernel", "silu_mul_kernel", "qk_norm_rope_kernel", "kv_write_kernel", "skinny_linear_kernel"):
        assert len(cubins[name]) == launches[name][1] >= 1, (name, launches, res.stdout)
        assert all(m["target"]["arch"] == 90 and m["target"]["backend"] == "cuda" for m in cubins[name])
    assert len(cubins["nvfp4_quantize_kernel"]) >= 2  # row counts divisible by 16 and not
    # the variants an SM90 GPU launches: the small kernels with programmatic dependent launch, the decode without
    for name in ("rmsnorm_kernel", "silu_mul_kernel", "qk_norm_rope_kernel", "kv_write_kernel",
                 "nvfp4_quantize_kernel", "skinny_linear_kernel"):
        assert all(m["launch_pdl"] is True for m in cubins[name]), name
    # the decode's projections on Hopper (q/k/v, o, gate/up gated, down; none has a bias here), each at every row
    # class the skinny kernel takes it, compiled as the GPU runs them: bf16 operands on the tensor cores
    from nvfp4_kernels.skinny_linear import skinny_row_classes, skinny_shape

    h, q, kv, i = _TINY["hidden_size"], _TINY["num_heads"] * 128, _TINY["num_kv_heads"] * 128, eng.model_config.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    assert launches["skinny_linear_kernel"][0] == sum(skinny_shape(m, n, k) for n, k in shapes
                                                      for m in skinny_row_classes())
    for ptx in cache.rglob("skinny_linear_kernel.ptx"):
        assert "f32.bf16.bf16" in ptx.read_text() and ".tf32" not in ptx.read_text(), ptx
    for name in ("nvfp4_decode_tma_kernel", "nvfp4_decode_gluon_kernel", "merge_kernel", "nvfp4_to_fp8_kernel"):
        assert all(not m.get("launch_pdl") for m in cubins[name]), name
    # Triton's host launcher stubs: one per distinct launcher source (variants of one signature share it)
    stubs = sorted(cache.rglob("__triton_launcher*.so"))
    if (why := _stub_toolchain(libcuda)) is None:
        built = re.search(r"host launcher stubs: (\d+) \(one per kernel variant\)", res.stdout)
        assert built and int(built.group(1)) == sum(v for _, v in launches.values()), res.stdout
        assert 1 <= len(stubs) <= int(built.group(1)) and len(list(cache.rglob("cuda_utils*.so"))) == 1
    else:
        assert f"host launcher stubs: not built ({why})" in res.stdout and not stubs

    before = _files(cache)
    again = _run(["-m", "nvfp4_serve.cli", "warm-cache", "--model", str(tiny_model), *_FLAGS, "--kv-cache-dtype",
                  "nvfp4", "fp8_e4m3"], env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert _files(cache) == before, "a second warm-cache compiled again"
    assert " 0 new files" in again.stdout


@pytest.mark.parametrize("args, message", [
    (["--arch", "ampere"], "--arch must name an NVIDIA GPU architecture like sm_90a, got 'ampere'"),
    (["--num-sms", "0"], "--num-sms must be >= 1, got 0"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs must be >= 1, got 0"),
    (["--preset", "qwen3-8b", "--model", "/tmp"], "give --model or --preset, not both"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no config.json there"),
    (["--preset", "qwen3-8b", "--context-length", "99999999"], "--context-length 99999999 is longer than"),
    (["--arch", "sm_80", "--nvfp4-decode-kernel", "gluon"],
     "--nvfp4-decode-kernel gluon needs a GPU of compute capability 8.9 or newer, got compute capability 8.0"),
    (["--arch", "sm_89", "--preset", "qwen3-8b", "--nvfp4-decode-kernel", "gluon-tma"],
     "--nvfp4-decode-kernel gluon-tma needs a GPU of compute capability 9.0 or newer"),
    (["--preset", "qwen3-8b", "--page-size", "64", "--nvfp4-decode-kernel", "gluon-tma"],
     "gluon-tma needs KV heads x head_dim / 16 a multiple of 16 bytes and 32-token steps of whole pages"),
])
def test_bad_flags_give_one_line_errors(args, message, tmp_path):
    res = _run(["-m", "nvfp4_serve.cli", "warm-cache", *args], {"TRITON_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not any(tmp_path.iterdir())


def test_help_states_the_target_defaults():
    res = _run(["-m", "nvfp4_serve.cli", "warm-cache", "--help"], {})
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "default: sm_90a" in text and "default: 132" in text and "--kv-cache-dtype" in text


_ENGINE = textwrap.dedent("""
    import sys
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    for kv in ("nvfp4", "fp8_e4m3"):
        eng = Engine(EngineConfig(model_dir=sys.argv[1], device="cuda", attention_backend="triton",
                                  context_length=1024, cuda_graph_max_bs=16,
                                  cache=CacheConfig(kv_dtype=kv, max_total_tokens=8192)))
        outs = eng.generate(["def fib(n):", "hello " * 40, "x"], SamplingParams(temperature=0, max_tokens=8))
        outs += eng.generate(["def fib(n):" + " return" * 3], SamplingParams(temperature=0, max_tokens=4))
        assert all(len(o.token_ids) > 0 for o in outs), outs
        print(kv, "ok")
""")
_ARTIFACT = re.compile(r"\.(cubin|so|o|ptx|json)$")  # Triton's host launcher stubs (.so) included


@pytest.mark.gpu
def test_a_server_on_the_gpu_compiles_nothing_after_warm_cache(tiny_model, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")}
    warm = _run(["-m", "nvfp4_serve.cli", "warm-cache", "--model", str(tiny_model), *_FLAGS, "--kv-cache-dtype",
                 "nvfp4", "fp8_e4m3", "--attention-backend", "triton", "--arch", arch, "--num-sms", str(sms)],
                {**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=1800)
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-4000:]
    roots = [tmp_path / "triton", tmp_path / "fi"]
    before = [_files(r) if r.is_dir() else {} for r in roots]
    assert before[0], warm.stdout
    served = _run(["-c", _ENGINE, str(tiny_model)], env, timeout=1800)
    assert served.returncode == 0 and "fp8_e4m3 ok" in served.stdout, served.stdout[-3000:] + served.stderr[-4000:]
    new = [sorted(p for p in (_files(r) if r.is_dir() else {}).keys() - b.keys() if _ARTIFACT.search(p))
           for r, b in zip(roots, before)]
    assert new == [[], []], f"compiled at serving time after warm-cache: triton {new[0]}, flashinfer {new[1]}\n" \
                            f"{warm.stdout}"
