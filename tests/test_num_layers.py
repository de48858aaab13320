"""`--num-layers N`: serve the first N decoder layers of a checkpoint (quick benchmark runs of a large model).

The truncated model must be exactly the model whose checkpoint holds only those layers, the layers past N
must not even be read, and the fingerprint must name N so that services with different N refuse each other.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.loader import load_model, model_fingerprint
from engine.model import causal_attention_no_cache
from offline.tiny_model import make_tiny_model
from svc_common.engine_args import add_engine_args, engine_args_to_argv, engine_config_from_args

SCALES = {"k": [0.5, 1.5, 2.5, 3.5], "v": [0.25, 0.75, 1.25, 1.75]}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("four") / "m", num_layers=4, seed=3, kv_scales=SCALES)


def test_first_n_layers_are_exactly_the_n_layer_checkpoint_of_the_same_seed(four_layers, tmp_path):
    # tensors are drawn per (seed, name): the 2-layer checkpoint holds the same embeddings, layers 0-1 and head
    two = make_tiny_model(tmp_path / "two", num_layers=2, seed=3, kv_scales={k: v[:2] for k, v in SCALES.items()})
    cut, ref = load_model(four_layers, num_layers=2), load_model(two)
    assert cut.config == ref.config and cut.config.num_hidden_layers == 2
    a, b = cut.model.state_dict(), ref.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cut.kv_scales == {"k": [0.5, 1.5], "v": [0.25, 0.75]}
    ids = torch.tensor([5, 17, 42, 99, 7])
    full = load_model(four_layers)
    assert full.config.num_hidden_layers == 4 and full.kv_scales == SCALES
    with torch.no_grad():
        logits = [m.model.compute_logits(m.model(ids, torch.arange(5), causal_attention_no_cache([5])))
                  for m in (cut, ref, full)]
    assert torch.equal(logits[0], logits[1]) and not torch.allclose(logits[0], logits[2])


def test_layers_past_n_are_not_read(four_layers, tmp_path):
    broken = make_tiny_model(tmp_path / "broken", num_layers=4, seed=3)
    path = broken / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["model.layers.3.mlp.down_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj\.weight: expected"):
        load_model(broken)
    assert load_model(broken, num_layers=3).config.num_hidden_layers == 3


def test_fingerprint_names_n_and_all_layers_is_the_checkpoint_itself(four_layers):
    base = model_fingerprint(four_layers)
    assert model_fingerprint(four_layers, 4) == base
    prints = {n: model_fingerprint(four_layers, n) for n in (1, 2, 3)}
    assert len({base, *prints.values()}) == 4
    assert load_model(four_layers, num_layers=2).fingerprint == prints[2]
    assert load_model(four_layers).fingerprint == base


@pytest.mark.parametrize("n", [0, 5, -1])
def test_n_outside_the_checkpoint_is_refused_with_the_range(four_layers, n):
    with pytest.raises(ValueError, match=r"--num-layers must be in 1\.\.4 \(the checkpoint .* has 4 decoder"):
        load_model(four_layers, num_layers=n)
    with pytest.raises(ValueError, match=r"--num-layers must be in 1\.\.4"):
        model_fingerprint(four_layers, n)


def test_engine_config_refuses_n_below_one():
    assert EngineConfig(model_dir="m").num_layers is None
    with pytest.raises(ValueError, match="--num-layers must be >= 1"):
        EngineConfig(model_dir="m", num_layers=0)


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_flag_reaches_the_engine_config_and_the_child_services_argv(four_layers):
    a = _parse("--model", str(four_layers), "--num-layers", "3")
    assert engine_config_from_args(a).num_layers == 3
    argv = engine_args_to_argv(a)
    assert argv[argv.index("--num-layers") + 1] == "3"
    assert "--num-layers" not in engine_args_to_argv(_parse("--model", str(four_layers)))
    assert engine_config_from_args(_parse("--model", str(four_layers))).num_layers is None


def test_a_whole_model_scales_file_gives_its_first_n_layers(four_layers, tmp_path):
    from engine.kv_scales import KVScales

    full = KVScales(model_fingerprint(four_layers), (1.0, 2.0, 3.0, 4.0), (5.0, 6.0, 7.0, 8.0), 100, "test")
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(full.to_json()))
    cfg = engine_config_from_args(_parse("--model", str(four_layers), "--num-layers", "2", "--kv-cache-dtype",
                                         "fp8_e4m3", "--kv-scales", str(path)))
    fp8_k, fp8_v = full.fp8_scales()
    assert cfg.cache.k_scales == tuple(fp8_k[:2]) and cfg.cache.v_scales == tuple(fp8_v[:2])

