"""Shared helpers for the model/loader tests: an independent HF-formula forward over raw checkpoint tensors.

The reference reads the safetensors files by HF tensor name (no fused parameters, no shared code
with engine.model or engine.rope) and runs the textbook computation in float64 for one sequence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (single file or shards) by HF name, as stored."""
    model_dir = Path(model_dir)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def reference_logits(model_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` (float64) of one sequence at positions 0..T-1, plain RoPE only."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert not cfg.get("rope_scaling"), "reference covers plain RoPE only"
    w = {k: v.double() for k, v in read_checkpoint(model_dir).items()}
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    qwen3 = cfg["architectures"][0] == "Qwen3ForCausalLM"
    n = len(token_ids)

    angles = torch.tensor([[p / theta ** (2 * i / d) for i in range(d // 2)] for p in range(n)], dtype=torch.float64)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    h = w["model.embed_tokens.weight"][token_ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = lin(x, p + "self_attn.q_proj").view(n, heads, d)
        k = lin(x, p + "self_attn.k_proj").view(n, kv_heads, d)
        v = lin(x, p + "self_attn.v_proj").view(n, kv_heads, d)
        if qwen3:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        out = torch.empty(n, heads, d, dtype=torch.float64)
        for hq in range(heads):
            hk = hq // (heads // kv_heads)
            s = q[:, hq] @ k[:, hk].T / math.sqrt(d)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[:, hq] = s.softmax(-1) @ v[:, hk]
        h = h + lin(out.reshape(n, heads * d), p + "self_attn.o_proj")
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = lin(x, p + "mlp.gate_proj"), lin(x, p + "mlp.up_proj")
        h = h + lin(gate * torch.sigmoid(gate) * up, p + "mlp.down_proj")
    h = _rms(h, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T
