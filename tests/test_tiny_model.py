"""The random-checkpoint maker: HF file set, determinism, sharding, weight statistics, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model_config import ModelConfig
from offline.tiny_model import main, make_tiny_model
from tests.model_fixtures import read_checkpoint
from tokenization.tokenizer import Tokenizer


def test_writes_a_complete_hf_directory(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    model_cfg = ModelConfig.from_dir(path)
    assert (model_cfg.num_hidden_layers, model_cfg.num_key_value_heads, model_cfg.head_dim) == (2, 2, 16)
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == 512 and tok.eos_token_ids == frozenset({0, 2})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("arch,expected", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                           ("mistral", "MistralForCausalLM")])
def test_architectures(tmp_path, arch, expected):
    path = make_tiny_model(tmp_path / arch, arch=arch)
    assert ModelConfig.from_dir(path).architecture == expected
    names = read_checkpoint(path)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert "model.layers.0.self_attn.q_norm.weight" not in names


def test_deterministic_from_seed_and_independent_of_sharding(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=4)
    b = make_tiny_model(tmp_path / "b", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    sharded = make_tiny_model(tmp_path / "s", seed=4, shard_size_bytes=30_000)
    ta, ts = read_checkpoint(a), read_checkpoint(sharded)
    assert ta.keys() == ts.keys() and all(torch.equal(ta[k], ts[k]) for k in ta)
    other = read_checkpoint(make_tiny_model(tmp_path / "c", seed=5))
    assert not torch.equal(ta["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_sharded_layout_and_index(tmp_path):
    path = make_tiny_model(tmp_path / "m", shard_size_bytes=30_000, num_layers=3)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = read_checkpoint(path)
    assert index["weight_map"].keys() == tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:  # a shard only overflows the limit when it holds a single larger tensor
        names = [n for n, f in index["weight_map"].items() if f == shard.name]
        size = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
        assert size <= 30_000 or len(names) == 1
    # re-making unsharded removes the stale shards and index
    make_tiny_model(path)
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]


def test_weight_statistics_keep_activations_sane(tmp_path):
    tensors = read_checkpoint(make_tiny_model(tmp_path / "m", hidden_size=128, intermediate_size=256))
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            assert torch.all(t == 1), name
        else:
            assert abs(t.float().std().item() - 0.02) < 0.002 and abs(t.float().mean().item()) < 0.002, name


def test_kv_scales_and_dtype_options(tmp_path):
    path = make_tiny_model(tmp_path / "m", dtype="float32", tie_word_embeddings=True,
                           kv_scales={"k": [0.5, 2.0], "v": [1.0, 4.0]})
    tensors = read_checkpoint(path)
    assert tensors["model.layers.1.self_attn.k_scale"].dtype == torch.float32
    assert tensors["model.layers.1.self_attn.k_scale"].shape == ()
    assert float(tensors["model.layers.1.self_attn.v_scale"]) == 4.0
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32 and "lm_head.weight" not in tensors


def test_invalid_arguments_are_explained(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        make_tiny_model(tmp_path / "x", vocab_size=100)
    with pytest.raises(ValueError, match="must be divisible"):
        make_tiny_model(tmp_path / "x", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"kv_scales\['k'\] must hold 2 positive floats"):
        make_tiny_model(tmp_path / "x", kv_scales={"k": [1.0], "v": [1.0, 1.0]})
    assert not (tmp_path / "x").exists()  # validation happens before anything is written


def test_cli(tmp_path, capsys):
    main([str(tmp_path / "cli"), "--layers", "3", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
          "--head-dim", "16", "--intermediate", "64", "--vocab", "300", "--arch", "llama", "--seed", "9",
          "--shard-mb", "0.02"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    cfg = ModelConfig.from_dir(tmp_path / "cli")
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (
        "LlamaForCausalLM", 3, 32, 300)
    assert (tmp_path / "cli" / "model.safetensors.index.json").is_file()
