"""ModelConfig parsing and the safetensors loader: round trips, KV scales, fingerprint, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.loader import load_model, model_fingerprint
from engine.model import causal_attention_no_cache
from engine.model_config import ModelConfig
from offline.tiny_model import make_tiny_model
from tests.model_fixtures import read_checkpoint, reference_logits

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}


def _rewrite(model_dir: Path, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to every safetensors file of a checkpoint."""
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = read_checkpoint_file(path)
        save_file(edit(tensors), str(path), metadata={"format": "pt"})


def read_checkpoint_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


# -- config ------------------------------------------------------------------------------------------

def test_config_defaults_and_derived_sizes():
    cfg = ModelConfig.from_dict({**QWEN3, "eos_token_id": [5, 7], "rope_theta": 1e6})
    assert (cfg.qk_norm, cfg.attention_bias, cfg.o_proj_bias) == (True, False, False)
    assert (cfg.num_q_per_kv, cfg.q_size, cfg.kv_size) == (4, 512, 128)
    assert cfg.eos_token_ids == (5, 7) and cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    llama = ModelConfig.from_dict({**QWEN3, "architectures": ["LlamaForCausalLM"], "head_dim": None,
                                   "num_key_value_heads": None})
    assert (llama.head_dim, llama.num_key_value_heads, llama.qk_norm) == (32, 8, False)
    qwen2 = ModelConfig.from_dict({**QWEN3, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.attention_bias, qwen2.o_proj_bias) == (True, False)
    biased = ModelConfig.from_dict({**QWEN3, "architectures": ["LlamaForCausalLM"], "attention_bias": True})
    assert (biased.attention_bias, biased.o_proj_bias) == (True, True)


def test_config_rope_scaling_forms_are_normalised():
    old = ModelConfig.from_dict({**QWEN3, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32768}})
    assert old.rope_type == "yarn" and old.max_rope_positions == 131072
    new = ModelConfig.from_dict({**QWEN3, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert new.rope_scaling is None and new.rope_theta == 5e5
    with pytest.raises(NotImplementedError, match="'longrope'"):
        ModelConfig.from_dict({**QWEN3, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_sliding_window_caps_the_context():
    mistral = ModelConfig.from_dict({**QWEN3, "architectures": ["MistralForCausalLM"], "sliding_window": 1024,
                                     "max_position_embeddings": 32768})
    assert mistral.max_context_len == 1024
    qwen = ModelConfig.from_dict({**QWEN3, "sliding_window": 1024, "use_sliding_window": False})
    assert qwen.sliding_window is None and qwen.max_context_len == 4096


def test_config_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: Qwen3ForCausalLM"):
        ModelConfig.from_dict({**QWEN3, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) must be divisible by num_key_value_heads \(3\)"):
        ModelConfig.from_dict({**QWEN3, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="missing required fields: hidden_size"):
        ModelConfig.from_dict({k: v for k, v in QWEN3.items() if k != "hidden_size"})
    with pytest.raises(NotImplementedError, match="gelu"):
        ModelConfig.from_dict({**QWEN3, "hidden_act": "gelu"})
    with pytest.raises(FileNotFoundError, match=f"no config.json in {tmp_path}: expected a Hugging Face"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")


# -- loading -----------------------------------------------------------------------------------------

def _perturb_norms(model_dir: Path) -> None:
    """Random norm weights, so that a swapped or ignored norm shows up in the logits."""
    def edit(tensors):
        g = torch.Generator().manual_seed(len(tensors))
        for name, t in tensors.items():
            if name.endswith("norm.weight"):
                tensors[name] = (1 + 0.5 * torch.randn(t.shape, generator=g)).to(t.dtype)
        return tensors
    _rewrite(model_dir, edit)


@pytest.mark.parametrize("arch,tied,sharded", [
    ("qwen3", False, False), ("qwen3", True, True), ("llama", False, True), ("llama", True, False),
    ("qwen2", False, True), ("mistral", True, False),
])
def test_round_trip_matches_checkpoint_and_reference_forward(tmp_path, arch, tied, sharded):
    path = make_tiny_model(tmp_path / "m", arch=arch, tie_word_embeddings=tied, seed=11, num_layers=2,
                           shard_size_bytes=40_000 if sharded else None)
    assert len(list(path.glob("*.safetensors"))) > 1 if sharded else (path / "model.safetensors").is_file()
    _perturb_norms(path)
    loaded = load_model(path)
    model, ckpt = loaded.model, read_checkpoint(path)
    assert loaded.config.architecture.lower().startswith(arch) and loaded.kv_scales is None
    assert (model.lm_head is None) == tied
    params = dict(model.named_parameters())
    for hf_name, (param, start, stop) in model.checkpoint_targets().items():
        dst = params[param] if start is None else params[param][start:stop]
        assert torch.equal(dst, ckpt[hf_name].float()), hf_name

    ids = [1, 17, 300, 42, 5, 99, 256, 3]
    got = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), causal_attention_no_cache([8])))
    torch.testing.assert_close(got.double(), reference_logits(path, ids), rtol=1e-4, atol=1e-4)


def test_dtype_defaults_to_float32_on_cpu_and_accepts_names(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    assert load_model(path).model.dtype == torch.float32
    model = load_model(path, dtype="bfloat16").model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown model dtype 'int8'"):
        load_model(path, dtype="int8")


def test_kv_scales_are_returned_per_layer(tmp_path):
    path = make_tiny_model(tmp_path / "m", num_layers=3, kv_scales={"k": [0.5, 1.0, 2.0], "v": [3.0, 4.0, 5.0]})
    assert load_model(path).kv_scales == {"k": [0.5, 1.0, 2.0], "v": [3.0, 4.0, 5.0]}

    def nest(tensors):  # the ".attn." spelling used by some quantization tools
        return {k.replace("self_attn.k_scale", "self_attn.attn.k_scale")
                .replace("self_attn.v_scale", "self_attn.attn.v_scale"): v for k, v in tensors.items()}
    _rewrite(path, nest)
    assert load_model(path).kv_scales == {"k": [0.5, 1.0, 2.0], "v": [3.0, 4.0, 5.0]}

    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.attn.v_scale"})
    with pytest.raises(ValueError, match=r"no v_scale for layers \[1\]"):
        load_model(path)


def test_fingerprint_is_stable_and_tracks_config_and_tensors(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=0)
    fp = model_fingerprint(a)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert model_fingerprint(a) == fp == load_model(a).fingerprint
    # weights are not hashed (headers only): another seed or sharding keeps the fingerprint
    assert model_fingerprint(make_tiny_model(tmp_path / "b", seed=1, shard_size_bytes=50_000)) == fp
    assert model_fingerprint(make_tiny_model(tmp_path / "c", rope_theta=500.0)) != fp
    assert model_fingerprint(make_tiny_model(tmp_path / "d", intermediate_size=96)) != fp
    cfg = json.loads((a / "config.json").read_text())
    (a / "config.json").write_text(json.dumps(cfg, indent=4))  # formatting alone does not matter
    assert model_fingerprint(a) == fp


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    path = make_tiny_model(tmp_path / "m")
    (path / "model.safetensors").rename(path / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights in .*\.bin checkpoints are not supported"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_model(path)


def test_missing_shard_is_named(tmp_path):
    path = make_tiny_model(tmp_path / "m", shard_size_bytes=50_000)
    shard = max(path.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(path)


def test_unknown_architecture_in_checkpoint(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


def test_missing_misshaped_and_unexpected_tensors_are_listed(tmp_path):
    path = make_tiny_model(tmp_path / "m")

    def damage(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        del tensors["lm_head.weight"]
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64, dtype=torch.bfloat16)
        tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(1)
        return tensors
    _rewrite(path, damage)
    with pytest.raises(ValueError) as err:
        load_model(path)
    msg = str(err.value)
    assert msg.count("model.layers.0.self_attn.k_proj.weight") == 1  # mis-shaped, not also "missing"
    assert "model.layers.1.mlp.up_proj.weight" in msg and "lm_head.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected (32, 64), got (8, 64)" in msg
    assert "unexpected tensors" in msg and "down_proj.weight_scale" in msg


HF_CASES = {
    "qwen3": ("qwen3", False, None),
    "qwen2-tied": ("qwen2", True, None),
    "mistral": ("mistral", False, None),
    "llama-llama3": ("llama", True, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3-yarn": ("qwen3", False, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear": ("llama", False, {"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_match_hf_transformers(tmp_path, case):
    """Parity with the HF implementation (runs where transformers is installed, e.g. the GPU image)."""
    transformers = pytest.importorskip("transformers")
    arch, tied, scaling = HF_CASES[case]
    path = make_tiny_model(tmp_path / "m", arch=arch, tie_word_embeddings=tied, rope_scaling=scaling,
                           dtype="float32", max_position_embeddings=256, seed=3)
    _perturb_norms(path)
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(0))
    ours = load_model(path).model
    got = ours.compute_logits(ours(ids, torch.arange(200), causal_attention_no_cache([200])))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
