"""`nvfp4-serve make-model`: the Qwen3-8B-shaped preset (checked without writing its 16 GB), explicit flags
over the preset, and the GPU stream (deterministic, N(0, 0.02), same files as the CPU one)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model_config import ModelConfig
from nvfp4_serve.cli import main as cli
from offline.tiny_model import PRESETS, checkpoint_nbytes, main, make_config, make_tiny_model
from tests.model_fixtures import read_checkpoint


def _dry_run(capsys, *argv: str) -> dict:
    assert cli(["make-model", "out", "--dry-run", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_8b_preset_is_the_published_shape_with_a_1m_context(capsys):
    plan = _dry_run(capsys, "--preset", "qwen3-8b")
    cfg = ModelConfig.from_dict(plan["config"])
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        "Qwen3ForCausalLM", 36, 4096, 32, 8, 128, 12288, 151936)
    assert (cfg.rope_theta, cfg.max_context_len, cfg.tie_word_embeddings, cfg.qk_norm) == (1e6, 1048576, False, True)
    assert plan["config"]["torch_dtype"] == "bfloat16" and plan["shard_size_bytes"] == 4 << 30
    # 8.19 B parameters in bf16 (Qwen3-8B's count: untied 151936 x 4096 embeddings and head)
    assert plan["weight_bytes"] == 2 * 8_190_735_360
    assert (plan["device"], plan["seed"]) == ("cpu", 0)


def test_explicit_flags_override_the_preset(capsys):
    plan = _dry_run(capsys, "--preset", "qwen3-8b", "--layers", "2", "--seed", "7", "--device", "cuda",
                    "--shard-mb", "512", "--tie-word-embeddings")
    cfg = ModelConfig.from_dict(plan["config"])
    assert cfg.num_hidden_layers == 2 and plan["config"]["max_window_layers"] == 2
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == (
        4096, 8, 151936, True)
    assert (plan["seed"], plan["device"], plan["shard_size_bytes"]) == (7, "cuda", 512 << 20)
    per_layer = (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128) * 2
    assert plan["weight_bytes"] == 151936 * 4096 * 2 + 2 * per_layer + 4096 * 2
    assert plan["weight_bytes"] == checkpoint_nbytes(make_config(**{
        **{k: v for k, v in PRESETS["qwen3-8b"].items() if k != "shard_size_bytes"},
        "num_layers": 2, "tie_word_embeddings": True}))


def test_bad_options_exit_with_the_reason_and_write_nothing(tmp_path, capsys):
    assert main([str(tmp_path / "x"), "--preset", "qwen3-8b", "--kv-heads", "5"]) == 2
    assert "must be divisible" in capsys.readouterr().err and not (tmp_path / "x").exists()
    if not torch.cuda.is_available():
        assert main([str(tmp_path / "y"), "--device", "cuda"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_make_model_writes_what_the_engine_loads(tmp_path, capsys):
    assert cli(["make-model", str(tmp_path / "m"), "--layers", "1", "--seed", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(tmp_path / "m") and "cpu stream, seed 2" in out.err
    ref = read_checkpoint(make_tiny_model(tmp_path / "ref", num_layers=1, seed=2))
    got = read_checkpoint(tmp_path / "m")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)


@pytest.mark.gpu
def test_cuda_stream_is_deterministic_normal_and_only_changes_the_drawn_weights(tmp_path):
    kw = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024, "num_layers": 2}
    a = make_tiny_model(tmp_path / "a", device="cuda", seed=1, **kw)
    b = make_tiny_model(tmp_path / "b", device="cuda", seed=1, shard_size_bytes=300_000, **kw)
    cpu = make_tiny_model(tmp_path / "c", seed=1, **kw)
    ta, tb, tc = read_checkpoint(a), read_checkpoint(b), read_checkpoint(cpu)
    assert ta.keys() == tb.keys() == tc.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (a / name).read_bytes() == (cpu / name).read_bytes()
    for name, t in ta.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, tc[name]), name
        else:
            assert not torch.equal(t, tc[name]), name
            assert abs(t.float().std().item() - 0.02) < 0.002 and abs(t.float().mean().item()) < 0.002, name
    other = read_checkpoint(make_tiny_model(tmp_path / "d", device="cuda", seed=2, **kw))
    assert not torch.equal(ta["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
