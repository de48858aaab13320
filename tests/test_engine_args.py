"""The engine flags, generated from the config fields' Flag metadata: parser, config and the launcher's argv."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from svc_common.engine_args import add_engine_args, engine_args_to_argv, engine_config_from_args
from svc_common.fault_injection import FaultInjection, add_fault_args, faults_from_args

EVERY_FLAG = ["--model", "m", "--device", "cpu", "--dtype", "float32", "--attention-backend", "reference",
              "--context-length", "512", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "8",
              "--max-total-tokens", "1024", "--mem-fraction-static", "0.5", "--host-cache-size", "64Ktokens",
              "--workspace-tokens", "256", "--chunk-size", "128", "--max-running-requests", "3",
              "--max-waiting-requests", "9", "--local-extend-min-cached-ratio", "0.25", "--seed", "7",
              "--num-layers", "2", "--disable-cuda-graph", "--cuda-graph-max-bs", "4"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_flag_reaches_the_config_and_survives_the_launcher_argv():
    p = _parser()
    cfg = engine_config_from_args(p.parse_args(EVERY_FLAG))
    assert (cfg.model_dir, cfg.device, cfg.dtype, cfg.attention_backend, cfg.context_length) == \
        ("m", "cpu", "float32", "reference", 512)
    assert (cfg.cache.kv_dtype, cfg.cache.page_size, cfg.cache.max_total_tokens, cfg.cache.mem_fraction_static,
            cfg.cache.host_cache_tokens, cfg.cache.host_cache_bytes, cfg.cache.workspace_tokens) == \
        ("fp8_e4m3", 8, 1024, 0.5, 64_000, 0, 256)
    assert (cfg.scheduler.chunk_size, cfg.scheduler.max_running_requests, cfg.scheduler.max_waiting_requests,
            cfg.scheduler.local_extend_min_cached_ratio) == (128, 3, 9, 0.25)
    assert (cfg.seed, cfg.num_layers, cfg.disable_cuda_graph, cfg.cuda_graph_max_bs) == (7, 2, True, 4)
    assert engine_config_from_args(p.parse_args(engine_args_to_argv(p.parse_args(EVERY_FLAG)))) == cfg


def test_defaults_are_the_dataclass_defaults_and_unset_values_are_not_forwarded():
    a = _parser().parse_args(["--model", "m"])
    assert engine_config_from_args(a) == EngineConfig(model_dir="m")
    argv = engine_args_to_argv(a)
    for unset in ("--host-cache-size", "--kv-scales", "--num-layers", "--context-length", "--disable-cuda-graph",
                  "--max-total-tokens", "--workspace-tokens"):
        assert unset not in argv
    assert argv[argv.index("--page-size") + 1] == "16"


def test_bad_values_are_argparse_errors(capsys):
    for argv, said in ((["--page-size", "x"], "argument --page-size: invalid int value: 'x'"),
                       (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
                       (["--host-cache-size", "8parsecs"], "unknown unit")):
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
        assert said in capsys.readouterr().err


def test_fault_injection_is_off_and_leaves_the_callback_alone_by_default():
    def callback(ev):
        return None

    assert FaultInjection().stall_after_tokens(callback) is callback
    assert FaultInjection(token_delay_s=0.5).stall_after_tokens(callback) is not callback
    with pytest.raises(ValueError, match="--debug-token-delay-s must be >= 0"):
        FaultInjection(token_delay_s=-1)
    p = argparse.ArgumentParser()
    add_fault_args(p, "prefill")
    assert faults_from_args(p.parse_args(["--debug-transfer-delay-s", "2"])) == FaultInjection(transfer_delay_s=2)
    with pytest.raises(SystemExit):
        p.parse_args(["--debug-token-delay-s", "1"])  # a decode's knob, not a prefill's
