"""Dense decoder-only transformer of the Qwen3 / Qwen2 / Llama / Mistral family, minus the attention.

The model computes everything except softmax(q k^T) v: for each layer it hands q, k, v (after
the optional per-head q/k RMSNorm and RoPE) to an ``AttnFn`` supplied by the caller, who owns the
KV cache. A forward pass runs over a flattened batch of T tokens from any number of sequences:

    input_ids [T] int64, positions [T] int64  -->  hidden [T, hidden_size] (after the final norm)
    attn(layer_id, q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) -> [T, Hq, D]     (model dtype)

After ``rotate_kv(R)`` (--kv-rotation) q, k, v arrive rotated (x @ R per head) and the output is taken rotated.

Query head h attends with KV head ``h // num_q_per_kv`` (HF ``repeat_kv`` grouping).

Parameters are fused where the math allows (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``);
``checkpoint_targets`` maps each HF tensor name to the rows of the fused parameter it fills.
The norms, SiLU-and-multiply, q/k norm + RoPE and the layers' projections go through a
``nvfp4_kernels.model_ops.ModelOps`` chosen per forward by the device of the hidden states: fused Triton kernels
on CUDA (unless ``fused_ops=False``; a projection of a decode step's few rows through the skinny linear where
``fused_ops.skinny_applies``, else cuBLAS), the PyTorch reference elsewhere. The residual stream is carried beside the hidden states so that each residual
add is fused into the RMSNorm after it (same bf16 roundings as adding first).
Weights are allocated uninitialised: use ``engine.loader.load_model`` to get a usable model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.rope import RotaryEmbedding
from nvfp4_kernels.model_ops import HeadRotation, ModelOps, rms_norm
from nvfp4_kernels.op_select import model_ops

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); weight ``[out, in]`` as in HF checkpoints, no initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """x / rms(x) computed in float32, cast back to the input dtype, then times weight (HF order)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.kv_rotation: HeadRotation | None = None  # CausalLM.rotate_kv

    def rotate_kv(self, rotation: HeadRotation) -> None:
        """q, k, v leave qk_norm_rope rotated (x @ R per head), so attention returns o R; o_proj's weight takes
        R^T back: o W^T = (o R) (W_h R)^T summed over heads h, i.e. W_h <- W_h R (fp32 product, rounded once)."""
        w = self.o_proj.weight
        heads = w.view(w.shape[0], self.num_heads, self.head_dim)
        w.copy_((heads.float() @ rotation.matrix().to(w.device)).to(w.dtype).view_as(w))
        self.kv_rotation = rotation

    def forward(self, layer_id: int, positions: torch.Tensor, x: torch.Tensor, attn: AttnFn,
                rope: RotaryEmbedding, ops: ModelOps) -> torch.Tensor:
        num_tokens = x.shape[0]
        rope.check_positions(positions)
        cos, sin = rope.tables(positions.device)
        q_w = None if self.q_norm is None else self.q_norm.weight
        k_w = None if self.k_norm is None else self.k_norm.weight
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        q, k, v = ops.qk_norm_rope(self.qkv_proj(x, ops), positions, cos, sin, q_w, k_w, eps, self.num_heads,
                                   self.num_kv_heads, self.kv_rotation)
        o = attn(layer_id, q, k, v)
        if o.shape != q.shape:
            raise ValueError(f"attention function returned shape {tuple(o.shape)}, expected {tuple(q.shape)}")
        return self.o_proj(o.reshape(num_tokens, self.q_size), ops)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        gate_up = self.gate_up_proj
        return self.down_proj(ops.gate_up_silu_mul(x, gate_up.weight, gate_up.bias), ops)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, layer_id: int, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                attn: AttnFn, rope: RotaryEmbedding, ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream it is to be added to); the next norm adds them.

        ``residual`` None: ``h`` is the embedding output (the stream itself); else the stream is h + residual.
        """
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            x, residual = ops.rms_norm(h, norm_in.weight, norm_in.eps), h
        else:
            x, residual = ops.add_rms_norm(h, residual, norm_in.weight, norm_in.eps)
        h = self.self_attn(layer_id, positions, x, attn, rope, ops)
        x, residual = ops.add_rms_norm(h, residual, norm_post.weight, norm_post.eps)
        return self.mlp(x, ops), residual


class Backbone(nn.Module):
    """The HF ``model.`` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """The language model; see the module docstring for the forward contract."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", fused_ops: bool = True):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.fused_ops = fused_ops  # False: the PyTorch ops on CUDA too (comparisons, benchmarks)
        self.dtype = dtype
        self.model = Backbone(config, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings, config.max_rope_positions)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def kv_rotation(self) -> HeadRotation | None:
        """The rotation q, k and v leave each layer's qk_norm_rope with (None: as the checkpoint computes them)."""
        layers = self.model.layers
        return layers[0].self_attn.kv_rotation if len(layers) else None

    @torch.no_grad()
    def rotate_kv(self, rotation: HeadRotation) -> None:
        """Serve attention in rotated coordinates (--kv-rotation): every layer hands q R, k R, v R to its AttnFn,
        which returns o R, and each o_proj weight is folded to take o R (``Attention.rotate_kv``). The model's
        outputs are unchanged in real arithmetic; what it hands attention, and so the KV cache, is rotated.
        Once per model: folding twice would rotate the weights twice."""
        if self.kv_rotation is not None:
            raise ValueError("this model's K/V are already rotated")
        if rotation.head_dim != self.config.head_dim:
            raise ValueError(f"a rotation of {rotation.head_dim}-value heads for a model of head_dim "
                             f"{self.config.head_dim}")
        for layer in self.model.layers:
            layer.self_attn.rotate_kv(rotation)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """hidden ``[T, hidden_size]`` (final norm applied) for ``input_ids`` / ``positions`` ``[T]`` int64."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"forward takes flat input_ids and positions of equal shape [T] "
                f"(got {tuple(input_ids.shape)} and {tuple(positions.shape)})"
            )
        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        ops = model_ops(h.device, self.fused_ops)
        residual = None
        for layer_id, layer in enumerate(self.model.layers):
            h, residual = layer(layer_id, positions, h, residual, attn, self.rotary, ops)
        norm = self.model.norm
        if residual is None:  # no decoder layers
            return ops.rms_norm(h, norm.weight, norm.eps)
        return ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """logits ``[N, vocab_size]`` float32 for hidden states ``[N, hidden_size]``."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def checkpoint_targets(self) -> dict[str, tuple[str, int | None, int | None]]:
        """HF tensor name -> (parameter name, first row, end row); rows are None for a whole parameter.

        Every entry must be present in a checkpoint; the fused parameters are filled row-block-wise:
        ``qkv_proj = [q_proj; k_proj; v_proj]`` and ``gate_up_proj = [gate_proj; up_proj]``.
        """
        cfg = self.config
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        targets: dict[str, tuple[str, int | None, int | None]] = {
            "model.embed_tokens.weight": ("model.embed_tokens.weight", None, None),
            "model.norm.weight": ("model.norm.weight", None, None),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = ("lm_head.weight", None, None)
        suffixes = ["weight"] + (["bias"] if cfg.attention_bias else [])
        mlp_suffixes = ["weight"] + (["bias"] if cfg.mlp_bias else [])
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            for s in suffixes:
                targets[f"{p}.self_attn.q_proj.{s}"] = (f"{p}.self_attn.qkv_proj.{s}", 0, q)
                targets[f"{p}.self_attn.k_proj.{s}"] = (f"{p}.self_attn.qkv_proj.{s}", q, q + kv)
                targets[f"{p}.self_attn.v_proj.{s}"] = (f"{p}.self_attn.qkv_proj.{s}", q + kv, q + 2 * kv)
            for s in ["weight"] + (["bias"] if cfg.o_proj_bias else []):
                targets[f"{p}.self_attn.o_proj.{s}"] = (f"{p}.self_attn.o_proj.{s}", None, None)
            if cfg.qk_norm:
                targets[f"{p}.self_attn.q_norm.weight"] = (f"{p}.self_attn.q_norm.weight", None, None)
                targets[f"{p}.self_attn.k_norm.weight"] = (f"{p}.self_attn.k_norm.weight", None, None)
            for s in mlp_suffixes:
                targets[f"{p}.mlp.gate_proj.{s}"] = (f"{p}.mlp.gate_up_proj.{s}", 0, inter)
                targets[f"{p}.mlp.up_proj.{s}"] = (f"{p}.mlp.gate_up_proj.{s}", inter, 2 * inter)
                targets[f"{p}.mlp.down_proj.{s}"] = (f"{p}.mlp.down_proj.{s}", None, None)
            targets[f"{p}.input_layernorm.weight"] = (f"{p}.input_layernorm.weight", None, None)
            targets[f"{p}.post_attention_layernorm.weight"] = (f"{p}.post_attention_layernorm.weight", None, None)
        return targets


def causal_attention_no_cache(seq_lens: list[int], sm_scale: float | None = None) -> AttnFn:
    """Reference ``AttnFn``: full causal attention inside each sequence of a ragged flat batch.

    ``out[t,h] = softmax(q[t,h] · K_s[:j+1]^T * sm_scale) · V_s[:j+1]`` for token t = the j-th
    token of its sequence s, in float32, GQA by ``h // (Hq/Hk)``; output in q's dtype. No cache:
    every call attends only over the k, v it is given, so it is "full recompute".
    """
    lens = [int(n) for n in seq_lens]
    if any(n <= 0 for n in lens):
        raise ValueError(f"sequence lengths must be positive (got {lens})")
    total = sum(lens)

    def attn(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if num_tokens != total or k.shape[0] != total or v.shape[0] != total:
            raise ValueError(f"attention got {num_tokens} tokens but the sequence lengths {lens} sum to {total}")
        group = num_heads // k.shape[1]
        scale = head_dim ** -0.5 if sm_scale is None else sm_scale
        out = torch.empty_like(q)
        start = 0
        for n in lens:
            qs = q[start:start + n].float()
            ks = k[start:start + n].float().repeat_interleave(group, dim=1)
            vs = v[start:start + n].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            out[start:start + n] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
            start += n
        return out

    return attn
