"""The training script (a few CPU steps of a tiny config), the corpus split, and the shipped default model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.model import causal_attention_no_cache
from offline.corpus import SPLITS, split_of, stdlib_files
from offline.train import (
    ModelShape,
    TrainConfig,
    build_model,
    export_checkpoint,
    load_tokens,
    prepare,
    sdpa_attention,
    train,
)
from svc_common.default_model import DEFAULT_MODEL_DIR

TINY = ModelShape(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare(out, vocab_size=320, max_files=4)
    return out


def test_corpus_splits_are_disjoint_and_depend_only_on_the_relative_path():
    files = {s: {f.rel_path for f in stdlib_files(s)} for s in SPLITS}
    assert not files["train"] & files["held_out"] and not files["train"] & files["validation"]
    assert len(files["held_out"]) > 20 and len(files["train"]) > 20 * len(files["held_out"])
    assert all(split_of(p) == "held_out" for p in files["held_out"])
    assert split_of("json/decoder.py") == split_of("json/decoder.py")


def test_prepare_writes_token_ids_that_the_tokenizer_decodes_back(data_dir):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["vocab_size"] == 320 and set(manifest["splits"]) == set(SPLITS)
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(data_dir)
    ids = load_tokens(data_dir, "held_out")
    assert ids.numel() == manifest["splits"]["held_out"]["num_tokens"] and int(ids.max()) < 320
    first_doc = tok.decode(ids[: int((ids == 0).nonzero()[0])].tolist())
    held_out = stdlib_files("held_out")[0].path.read_text(encoding="utf-8")
    assert first_doc == held_out


def test_sdpa_training_attention_equals_the_reference_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3 * 10, h, 16, generator=g) for h in (4, 2, 2))
    torch.testing.assert_close(
        sdpa_attention(3, 10)(0, q, k, v),
        causal_attention_no_cache([10] * 3)(0, q, k, v),
        atol=1e-5,
        rtol=1e-5,
    )


def test_exported_checkpoint_loads_into_the_engine_with_identical_logits(data_dir, tmp_path):
    model = build_model(TINY, torch.device("cpu"), seed=3)
    assert not model.fused_ops  # on CUDA too: the fused Triton ops have no backward
    export_checkpoint(model, TINY, data_dir, tmp_path / "m", {"test": True}, dtype=torch.float32)
    loaded = load_model(tmp_path / "m", dtype="float32")
    assert loaded.config.architecture == "Qwen3ForCausalLM" and loaded.config.tie_word_embeddings
    ids = torch.tensor([5, 17, 200, 3, 99, 250, 7])
    with torch.no_grad():
        a = model.compute_logits(model(ids, torch.arange(7), causal_attention_no_cache([7])))
        b = loaded.model.compute_logits(loaded.model(ids, torch.arange(7), causal_attention_no_cache([7])))
    assert torch.equal(a, b)
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert cfg["model_max_length"] == 128 and "<|im_start|>" in cfg["chat_template"]


def test_a_few_training_steps_lower_the_validation_loss_and_write_a_servable_model(data_dir, tmp_path):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    tc = TrainConfig(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=4, eval_every=12, eval_batches=1)
    log = train(data_dir, tmp_path / "m", TINY, tc, steps=24, device="cpu", log=lambda _: None)
    curve = log["curve"]
    assert [c["step"] for c in curve] == [12, 24] and log["best_step"] == 24
    assert curve[-1]["val_loss"] < curve[0]["val_loss"] < math.log(320) + 0.5
    saved = json.loads((tmp_path / "m" / "training_log.json").read_text())
    assert saved["steps"] == 24 and saved["data"]["vocab_size"] == 320
    eng = Engine(
        EngineConfig(
            model_dir=str(tmp_path / "m"),
            device="cpu",
            dtype="float32",
            cache=CacheConfig(kv_dtype="nvfp4", max_total_tokens=256),
        )
    )
    out = eng.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="exactly one of --steps and --time-budget-s"):
        train(data_dir, tmp_path / "x", TINY, tc, device="cpu")


def test_shipped_default_model_is_a_trained_python_model():
    """The embedded model: Qwen3, head_dim % 16 == 0, >= 10M parameters, context >= 2K, <= 30 MB, and it
    predicts held-out Python far better than chance (ln 8192 = 9.0 nats)."""
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir())
    assert size <= 30 * 2**20
    loaded = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    mc = loaded.config
    assert mc.architecture == "Qwen3ForCausalLM" and mc.head_dim % 16 == 0 and mc.max_context_len >= 2048
    assert sum(p.numel() for p in loaded.model.parameters()) >= 10_000_000
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    ids = tok.encode(stdlib_files("held_out")[1].path.read_text(encoding="utf-8"))[:256]
    with torch.no_grad():
        logits = loaded.model.compute_logits(
            loaded.model(torch.tensor(ids), torch.arange(len(ids)), causal_attention_no_cache([len(ids)]))
        )
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert float(nll) < 3.5
