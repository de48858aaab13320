"""CausalLM forward contract, the reference no-cache attention, and RoPE variants against direct formulas."""

from __future__ import annotations

import math

import pytest
import torch

from engine.loader import load_model
from engine.model import CausalLM, causal_attention_no_cache
from engine.model_config import ModelConfig
from engine.rope import RotaryEmbedding
from offline.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen3", num_layers=3, seed=3)).model


def _rand_ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_ragged_batch_equals_each_sequence_alone(qwen3):
    lens = [5, 1, 9, 3]
    seqs = [_rand_ids(n, i) for i, n in enumerate(lens)]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n) for n in lens])
    batched = qwen3.compute_logits(qwen3(ids, pos, causal_attention_no_cache(lens)))
    assert batched.dtype == torch.float32 and batched.shape == (sum(lens), 512)
    start = 0
    for seq, n in zip(seqs, lens):
        alone = qwen3.compute_logits(qwen3(seq, torch.arange(n), causal_attention_no_cache([n])))
        torch.testing.assert_close(batched[start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


class _CachingAttn:
    """A test AttnFn with a per-layer growing K/V cache for one sequence (what the engine does with pages)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        prev = self.k.get(layer, k[:0]).shape[0]
        self.k[layer] = torch.cat([self.k.get(layer, k[:0]), k])
        self.v[layer] = torch.cat([self.v.get(layer, v[:0]), v])
        keys = self.k[layer].repeat_interleave(q.shape[1] // k.shape[1], 1)
        vals = self.v[layer].repeat_interleave(q.shape[1] // k.shape[1], 1)
        s = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
        visible = torch.arange(keys.shape[0])[None, :] <= (prev + torch.arange(q.shape[0]))[:, None]
        return torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vals)


def test_prefill_then_decode_through_a_cache_equals_full_recompute(qwen3):
    ids = _rand_ids(12, 7)
    full = qwen3.compute_logits(qwen3(ids, torch.arange(12), causal_attention_no_cache([12])))
    attn = _CachingAttn()
    step = [qwen3.compute_logits(qwen3(ids[:7], torch.arange(7), attn))]
    for p in range(7, 12):
        step.append(qwen3.compute_logits(qwen3(ids[p:p + 1], torch.tensor([p]), attn)))
    torch.testing.assert_close(torch.cat(step), full, rtol=1e-5, atol=1e-5)


def test_attn_fn_receives_model_dtype_and_shapes(qwen3):
    seen = []

    def attn(layer, q, k, v):
        seen.append((layer, q.shape, k.shape, v.shape, q.dtype, v.is_contiguous()))
        return causal_attention_no_cache([4])(layer, q, k, v)

    qwen3(_rand_ids(4, 1), torch.arange(4), attn)
    assert seen == [(i, (4, 4, 16), (4, 2, 16), (4, 2, 16), torch.float32, True) for i in range(3)]


def test_attn_fn_returning_wrong_shape_is_reported(qwen3):
    with pytest.raises(ValueError, match="attention function returned shape"):
        qwen3(_rand_ids(3, 1), torch.arange(3), lambda layer, q, k, v: q[:, :1])


def test_forward_rejects_batched_or_mismatched_inputs(qwen3):
    with pytest.raises(ValueError, match="flat input_ids"):
        qwen3(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), causal_attention_no_cache([6]))
    with pytest.raises(ValueError, match="flat input_ids"):
        qwen3(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), causal_attention_no_cache([3]))


def test_no_cache_attention_matches_per_head_formula_with_gqa():
    g = torch.Generator().manual_seed(0)
    lens, hq, hk, d = [3, 6], 6, 2, 8
    q = torch.randn(9, hq, d, generator=g)
    k = torch.randn(9, hk, d, generator=g) * 3  # outlier-ish scale
    v = torch.randn(9, hk, d, generator=g)
    out = causal_attention_no_cache(lens, sm_scale=0.3)(0, q, k, v)
    start = 0
    for n in lens:
        for t in range(n):
            for h in range(hq):
                kv = h // (hq // hk)
                s = [0.3 * float(q[start + t, h] @ k[start + j, kv]) for j in range(t + 1)]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                want = sum(e[j] / sum(e) * v[start + j, kv] for j in range(t + 1))
                torch.testing.assert_close(out[start + t, h], want, rtol=1e-5, atol=1e-5)
        start += n
    with pytest.raises(ValueError, match="sum to"):
        causal_attention_no_cache([4, 4])(0, q, k, v)


def test_bf16_model_tracks_fp32_model(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=5)
    ids = _rand_ids(10, 2)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype).model
        hidden = model(ids, torch.arange(10), causal_attention_no_cache([10]))
        assert hidden.dtype == dtype
        out[dtype] = model.compute_logits(hidden)
    assert out[torch.bfloat16].dtype == torch.float32
    assert (out[torch.bfloat16] - out[torch.float32]).abs().max() < 0.05
    assert (out[torch.bfloat16].argmax(-1) == out[torch.float32].argmax(-1)).float().mean() > 0.8


def test_model_allocates_fused_parameters_without_initialising():
    cfg = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 32,
                                 "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "tie_word_embeddings": True})
    model = CausalLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (32 + 2 * 16, 32)
    assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == (64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes  # Qwen2: q/k/v bias only
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (96, 32)
    assert "lm_head.weight" not in shapes
    assert not any(p.requires_grad for p in model.parameters())
    targets = model.checkpoint_targets()
    assert targets["model.layers.0.self_attn.v_proj.bias"] == ("model.layers.0.self_attn.qkv_proj.bias", 48, 64)
    assert targets["model.layers.0.mlp.up_proj.weight"] == ("model.layers.0.mlp.gate_up_proj.weight", 48, 96)


# -- RoPE --------------------------------------------------------------------------------------------

D, THETA = 16, 10000.0


def _direct_rope(x: torch.Tensor, positions: list[int], freq: list[float] | None = None,
                 freq_at=None, scale: float = 1.0) -> torch.Tensor:
    """Neox rotation element by element: pair (i, i + D/2) turned by pos * freq[i]."""
    out = torch.empty_like(x, dtype=torch.float64)
    half = x.shape[-1] // 2
    for t, p in enumerate(positions):
        f = freq_at(p) if freq_at is not None else freq
        for h in range(x.shape[1]):
            for i in range(half):
                c, s = math.cos(p * f[i]) * scale, math.sin(p * f[i]) * scale
                a, b = float(x[t, h, i]), float(x[t, h, i + half])
                out[t, h, i] = a * c - b * s
                out[t, h, i + half] = b * c + a * s
    return out


BASE = [THETA ** (-2 * i / D) for i in range(D // 2)]


def _llama3_freq(factor=8.0, low=1.0, high=4.0, orig=64):
    out = []
    for f in BASE:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _yarn_freq(factor=4.0, orig=64, beta_fast=32, beta_slow=1):
    def dim_of(rot):
        return D * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(THETA))

    lo, hi = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), D - 1)
    hi = hi + 0.001 if lo == hi else hi
    out = []
    for i, f in enumerate(BASE):
        keep = 1 - min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(f / factor * (1 - keep) + f * keep)
    return out


def _dynamic_freq(p, factor=2.0, orig=64):
    n = max(p + 1, orig)
    base = THETA * ((factor * n / orig) - (factor - 1)) ** (D / (D - 2))
    return [base ** (-2 * i / D) for i in range(D // 2)]


ROPE_CASES = {
    "default": (None, {"freq": BASE}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"freq": [f / 4 for f in BASE]}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, {"freq": _llama3_freq()}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
             {"freq": _yarn_freq(), "scale": 0.1 * math.log(4.0) + 1.0}),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, {"freq_at": _dynamic_freq}),
}


@pytest.mark.parametrize("kind", list(ROPE_CASES))
def test_rope_matches_direct_formula(kind):
    scaling, expect = ROPE_CASES[kind]
    rope = RotaryEmbedding(D, THETA, scaling, max_position_embeddings=64, max_positions=256)
    g = torch.Generator().manual_seed(1)
    positions = [0, 1, 5, 63, 64, 100, 255]
    q = torch.randn(len(positions), 2, D, generator=g)
    k = torch.randn(len(positions), 1, D, generator=g) * 10
    rq, rk = rope(torch.tensor(positions), q, k)
    torch.testing.assert_close(rq.double(), _direct_rope(q, positions, **expect), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rk.double(), _direct_rope(k, positions, **expect), rtol=1e-4, atol=1e-3)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    freq = _llama3_freq()
    assert freq[0] == BASE[0] and freq[-1] == pytest.approx(BASE[-1] / 8)


def test_dynamic_rope_is_plain_rope_inside_the_original_length():
    plain = RotaryEmbedding(D, THETA, None, 64)
    dyn = RotaryEmbedding(D, THETA, {"rope_type": "dynamic", "factor": 2.0}, 64, max_positions=128)
    assert torch.equal(dyn.tables("cpu")[0][:64], plain.tables("cpu")[0])
    assert not torch.allclose(dyn.tables("cpu")[0][64:], RotaryEmbedding(D, THETA, None, 128).tables("cpu")[0][64:])


def test_rope_keeps_dtype_and_rejects_positions_past_the_table():
    rope = RotaryEmbedding(D, THETA, None, 32)
    q = torch.randn(2, 2, D, dtype=torch.bfloat16)
    rq, rk = rope(torch.tensor([0, 31]), q, q[:, :1])
    assert rq.dtype == rk.dtype == torch.bfloat16 and torch.equal(rq[0], q[0])
    with pytest.raises(ValueError, match="max_context_len"):
        rope(torch.tensor([32]), q[:1], q[:1, :1])


def test_unknown_rope_type_is_not_implemented():
    with pytest.raises(NotImplementedError, match="longrope"):
        RotaryEmbedding(D, THETA, {"rope_type": "longrope", "factor": 2.0}, 64)
