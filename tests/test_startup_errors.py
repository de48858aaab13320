"""User mistakes at start-up end in one line that says what to change, never a traceback: `--device cuda` on a
CPU-only PyTorch, a model directory missing files, an unsupported architecture or head_dim, a context length
past the model's, too little GPU memory for the KV pool."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.startup_error import StartupError
from offline.tiny_model import make_tiny_model
from svc_common.preflight import check_decode_kernel, check_device, check_model

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY_TORCH = torch.version.cuda is None


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _one_line_error(r: subprocess.CompletedProcess, prog: str) -> str:
    """The single stderr line of a refused start-up (and no traceback anywhere)."""
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(prog), lines[0]
    return lines[0]


def up_error(*argv: str, monkeypatch) -> str:
    """The message `nvfp4-serve up ARGV` exits with in-process (no service may be started first)."""
    from nvfp4_serve import launcher

    def no_spawn(*args, **kwargs):
        raise AssertionError("a service was started before the flags were checked")

    monkeypatch.setattr(launcher, "_spawn", no_spawn)
    with pytest.raises(SystemExit) as exit_:
        launcher.up(list(argv))
    message = str(exit_.value.code)
    assert message.startswith("nvfp4-serve up: ") and "\n" not in message, message
    return message


def service_error(service: str, *argv: str, capsys, code: int = 2) -> str:
    """The one stderr line `nvfp4-serve SERVICE ARGV` exits with, run in-process through its real main."""
    import importlib

    main = importlib.import_module(f"{service}_svc.__main__").main
    assert main(list(argv)) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nvfp4-serve {service}: error: "), err
    return err.strip()


@pytest.fixture(autouse=True)
def _keep_the_event_loop_policy():
    """run_service installs uvloop's policy process-wide; the in-process runs here put the default one back."""
    import asyncio

    policy = asyncio.get_event_loop_policy()
    yield
    asyncio.set_event_loop_policy(policy)


@pytest.fixture()
def model_copy(tmp_path, tiny_model_dir):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


# -- --device cuda without CUDA --------------------------------------------------------------------
@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs the CPU-only PyTorch build (this one has CUDA)")
@pytest.mark.parametrize("argv,prog,code", [
    (["-m", "nvfp4_serve.cli", "up", "--device", "cuda"], "nvfp4-serve up:", 1),
    (["-m", "prefill_svc", "--device", "cuda"], "nvfp4-serve prefill: error:", 2),
])
def test_device_cuda_on_a_cpu_only_torch_is_one_line_naming_the_fix(argv, prog, code):
    r = _run(*argv)
    line = _one_line_error(r, prog)
    assert r.returncode == code
    assert "CPU-only build" in line and "--device cpu" in line and "torch==2.13.0" in line


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs the CPU-only PyTorch build (this one has CUDA)")
@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs the CPU-only PyTorch build (this one has CUDA)")
def test_decode_device_cuda_n_on_a_cpu_only_torch(capsys):
    line = service_error("decode", "--device", "cuda:1", capsys=capsys)
    assert "--device cuda:1: this PyTorch" in line and "CPU-only build" in line


def test_check_device_keeps_cpu_and_auto_on_a_cpu_only_torch():
    assert check_device("cpu") == "cpu" and check_device("auto") == "cpu"
    for bad in ("tpu", "cuda:x", "cuda1"):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            check_device(bad)


def test_up_checks_every_engine_flag_before_it_starts_a_service(tiny_model_dir, monkeypatch):
    line = up_error("--model", tiny_model_dir, "--page-size", "16", "--max-total-tokens", "8", monkeypatch=monkeypatch)
    assert "--max-total-tokens (8) must hold at least one page (16)" in line


@pytest.mark.parametrize("value", ["-1", "1500"])
def test_up_refuses_a_decode_interval_outside_0_to_1000_ms(tiny_model_dir, monkeypatch, value):
    line = up_error("--model", tiny_model_dir, "--shared-gpu-decode-interval-ms", value, monkeypatch=monkeypatch)
    assert "--shared-gpu-decode-interval-ms must be in [0, 1000]" in line and value in line


def test_an_unbalanced_service_args_string_is_one_line(tiny_model_dir, monkeypatch):
    line = up_error("--model", tiny_model_dir, "--decode-args", "--between-tokens-timeout '300", monkeypatch=monkeypatch)
    assert "--decode-args" in line and "No closing quotation" in line and "one shell-quoted string" in line


# -- the model directory -----------------------------------------------------------------------------
def test_a_directory_without_weights_names_what_is_missing(model_copy):
    (model_copy / "model.safetensors").unlink()
    line = _one_line_error(_run("-m", "nvfp4_serve.cli", "up", "--model", str(model_copy)), "nvfp4-serve up:")
    assert f"--model {model_copy}" in line and "no safetensors weights" in line


def test_a_directory_without_tokenizer_or_config_names_what_is_missing(model_copy, capsys):
    (model_copy / "tokenizer.json").unlink()
    assert "no tokenizer.json" in service_error("prefill", "--model", str(model_copy), capsys=capsys)
    (model_copy / "config.json").unlink()
    assert "no config.json" in service_error("decode", "--model", str(model_copy), capsys=capsys)


def test_an_unsupported_architecture_lists_the_supported_ones(model_copy, monkeypatch):
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    line = up_error("--model", str(model_copy), monkeypatch=monkeypatch)
    assert "unsupported architecture 'GPT2LMHeadModel'" in line and "Qwen3ForCausalLM" in line


def test_a_checkpoint_whose_tensors_do_not_match_its_config_is_one_line_from_the_engine(model_copy, capsys):
    """Found only when the engine loads the weights (after the pre-flight checks): StartupError, exit 1."""
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    line = service_error("prefill", "--model", str(model_copy), "--device", "cpu", "--port", "0", capsys=capsys, code=1)
    assert f"cannot serve {model_copy}" in line and "missing tensors" in line


def test_up_repeats_the_error_line_of_the_service_that_refused_to_start(model_copy):
    """Under `up` the failing service's one line ends the launcher's output too (e.g. too little GPU memory)."""
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    r = _run("-m", "nvfp4_serve.cli", "up", "--model", str(model_copy), "--device", "cpu")
    line = _one_line_error(r, "nvfp4-serve: prefill exited with code 1 during start-up: ")
    assert f"nvfp4-serve prefill: error: cannot serve {model_copy}" in line and "missing tensors" in line


def test_nvfp4_refuses_a_head_dim_not_divisible_by_16_and_names_the_dtypes_that_work(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "hd24", head_dim=24)
    line = up_error("--model", str(model), monkeypatch=monkeypatch)
    assert "head_dim divisible by 16" in line and "has 24" in line and "--kv-cache-dtype fp8_e4m3" in line
    check_model(str(model), "fp8_e4m3", "cpu", "auto", None)  # the suggested dtype passes


def test_the_triton_nvfp4_kernels_need_a_power_of_two_head_dim_on_cuda(tiny_model_dir):
    """head_dim 16 is fine on the CPU (reference backend) but not for the Triton NVFP4 kernels on CUDA."""
    check_model(tiny_model_dir, "nvfp4", "cpu", "auto", None)
    check_model(tiny_model_dir, "nvfp4", "cuda", "reference", None)
    with pytest.raises(ValueError, match=r"power of two >= 64 \(.* has 16\).*--attention-backend reference"):
        check_model(tiny_model_dir, "nvfp4", "cuda", "auto", None)


@pytest.mark.parametrize("backend", ["triton", "triton-block-select"])
def test_a_triton_backend_on_the_cpu_is_refused_naming_the_cpu_backends(tiny_model_dir, backend):
    with pytest.raises(ValueError, match=rf"--attention-backend {backend} runs CUDA kernels.*reference-block-select"):
        check_model(tiny_model_dir, "nvfp4", "cpu", backend, None)


def test_a_decode_kernel_other_than_auto_needs_a_triton_backend_and_is_refused_in_one_line(tiny_model_dir):
    check_decode_kernel("auto", "auto", "cpu", 128)
    check_decode_kernel("triton", "triton", "cuda", 96)  # no GPU query for the triton kernel
    for backend, device in (("auto", "cpu"), ("reference", "cuda"), ("reference-block-select", "cpu")):
        with pytest.raises(ValueError, match=rf"triton backends, and the backend here is {backend} on {device}"):
            check_decode_kernel("gluon", backend, device, 128)
    for kernel in ("gluon", "gluon-tma"):
        with pytest.raises(ValueError, match=rf"{kernel} has tilings for head_dim \(64, 128, 256\), the model has 96"):
            check_decode_kernel(kernel, "triton", "cuda", 96)  # refused before the GPU is asked
    # the TMA kernel on a pool whose pages its boxes do not fit: refused at start-up, before the GPU is asked
    with pytest.raises(ValueError, match=r"gluon-tma needs .* got 8 KV heads, head_dim 128, page 64 on cuda"):
        check_decode_kernel("gluon-tma", "triton", "cuda", 128, num_kv_heads=8, page_size=64)
    r = _run("-m", "nvfp4_serve.cli", "up", "--model", tiny_model_dir, "--nvfp4-decode-kernel", "triton")
    assert "use --nvfp4-decode-kernel auto" in _one_line_error(r, "nvfp4-serve up")


# -- context length ----------------------------------------------------------------------------------
def test_context_length_past_the_models_is_refused_before_and_at_start_up(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--context-length 5000 is longer than .* \(4096 tokens\)"):
        check_model(tiny_model_dir, "nvfp4", "cpu", "auto", 5000)
    with pytest.raises(StartupError, match="pass at most 4096"):
        Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", context_length=5000,
                            cache=CacheConfig(max_total_tokens=256, page_size=4)))
    with pytest.raises(ValueError, match="--context-length must be >= 1"):
        EngineConfig(model_dir=tiny_model_dir, context_length=0)


def test_context_length_caps_the_engine_context_and_its_workspace(tiny_model_dir):
    from engine.outcome import FinishReason
    from engine.sampling import SamplingParams
    from engine.scheduler import RequestRejected

    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32", context_length=64,
                              cache=CacheConfig(max_total_tokens=1024, page_size=4)))
    assert eng.max_context_len == 64 and eng.scheduler.max_context_len == 64
    assert eng.paths.workspace_tokens == 64  # the workspace defaults to the context length
    out = eng.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason is FinishReason.LENGTH  # 60 + 4 = the 64-token context
    with pytest.raises(RequestRejected, match="does not fit the model context of 64 tokens"):
        eng.generate([[5] * 64], SamplingParams(max_tokens=1))


# -- GPU memory ----------------------------------------------------------------------------------------
def test_not_enough_gpu_memory_says_how_much_and_which_flags_to_change(tiny_model_dir, monkeypatch):
    """``_size_pool`` on a (faked) 80 GiB GPU with 5 GiB free: the message carries the numbers and the flags."""
    eng = Engine.__new__(Engine)
    ref = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", cache=CacheConfig(max_total_tokens=64)))
    eng.model_config, eng.max_context_len = ref.model_config, 4096
    eng.config = EngineConfig(model_dir=tiny_model_dir, cache=CacheConfig(mem_fraction_static=0.9))
    eng.device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 2**30, 80 * 2**30))
    with pytest.raises(StartupError) as err:
        eng._size_pool()
    msg = str(err.value)
    assert "5.0 of 80.0 GiB free" in msg and "--mem-fraction-static 0.9 keeps 8.0 GiB back" in msg
    assert "workspace of 4096 tokens" in msg and "--max-total-tokens" in msg and "\n" not in msg
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    num_pages, ws_tokens = eng._size_pool()  # 32 GiB over the reserve: a pool, and the whole workspace
    assert num_pages > 1000 and ws_tokens == 4096


def test_a_service_prints_a_start_up_error_as_one_line_and_exits_1(tiny_model_dir, capsys):
    from prefill_svc.config import build_arg_parser, config_from_args
    from svc_common.service_main import run_service

    async def serve(config):
        raise StartupError("not enough GPU memory for the KV pool: raise --mem-fraction-static")

    code = run_service(build_arg_parser(), config_from_args, serve, ["--model", tiny_model_dir, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == "nvfp4-serve prefill: error: not enough GPU memory for the KV pool: raise --mem-fraction-static\n"


def test_a_bad_flag_value_is_one_line_not_the_usage(tiny_model_dir, capsys):
    from prefill_svc.config import build_arg_parser, config_from_args
    from svc_common.service_main import run_service

    async def serve(config):  # never reached
        raise AssertionError

    code = run_service(build_arg_parser(), config_from_args, serve,
                       ["--model", tiny_model_dir, "--device", "cpu", "--page-size", "0"])
    assert code == 2 and capsys.readouterr().err == "nvfp4-serve prefill: error: --page-size must be >= 1, got 0\n"


def test_prepare_engine_args_resolves_the_model_in_place(tiny_model_dir):
    from svc_common.preflight import prepare_engine_args

    a = SimpleNamespace(model=None, device="cpu", kv_cache_dtype="nvfp4", attention_backend="auto", kv_rotation="none",
                        context_length=None, nvfp4_decode_kernel="auto", page_size=16)
    prepare_engine_args(a)
    assert Path(a.model, "config.json").is_file() and Path(a.model).name == "default"


@pytest.mark.parametrize("service,extra", [("prefill", ()), ("prefill", ("--kv-sender", "process")),
                                           ("decode", ())])
def test_a_port_another_process_listens_on_is_one_line_not_a_shared_port(tiny_model_dir, capsys, service, extra):
    """gRPC would otherwise bind beside the other listener (SO_REUSEPORT) and take half of its connections."""
    import socket
    import threading

    before = {t.ident for t in threading.enumerate()}
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        line = service_error(service, "--model", tiny_model_dir, "--device", "cpu", "--port", str(port), *extra,
                             capsys=capsys, code=1)
    assert f"cannot listen on 127.0.0.1:{port}: the port is taken" in line and "--port" in line
    left = [t.name for t in threading.enumerate() if t.ident not in before and "_poll_wrapper" not in t.name]
    assert not left  # its engine loop is stopped (gRPC's poller thread lives as long as the process)
