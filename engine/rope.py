"""Rotary position embeddings (neox style, as HF Llama/Qwen): default, linear, llama3, yarn, dynamic NTK.

The head dimension is split in halves, element i pairs with element i + D/2 and the pair is
rotated by angle ``pos * inv_freq[i]``:

    out[:D/2] = x[:D/2] * cos - x[D/2:] * sin
    out[D/2:] = x[D/2:] * cos + x[:D/2] * sin

Tables ``cos/sin [max_positions, D/2]`` (float32, already multiplied by the YaRN attention
factor) are built once per device on first use, on the CPU and then copied, so that every
device sees bit-identical tables. The rotation itself is done in float32 (``nvfp4_kernels.model_ops.rotate_neox``;
the model applies it fused with the q/k norm through ``ModelOps.qk_norm_rope`` on these tables).

Dynamic NTK is made cache friendly: the rotation of position p depends on p only, with
the NTK base of a sequence of length p + 1 (so positions inside the original length use
plain RoPE, and a cached key never needs re-rotating). HF instead re-derives one base per
forward call from the longest position in the batch; for decode steps the two agree.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.model_config import ROPE_TYPES
from nvfp4_kernels.model_ops import rotate_neox


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, linear ramp between."""
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or max_pos)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    truncate = bool(scaling.get("truncate", True))

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp  # 1: keep the trained frequency, 0: interpolate by factor
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by ``factor``, keep short ones, blend the band between."""
    factor = float(scaling["factor"])
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    inv_freq = _base_inv_freq(head_dim, theta)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = original / low_ff, original / high_ff
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int,
    num_positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 ``[num_positions, head_dim/2]`` on the CPU for position ids 0..num_positions-1."""
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    pos = torch.arange(num_positions, dtype=torch.float32)
    attention_factor = 1.0
    if rope_type == "default":
        angles = torch.outer(pos, _base_inv_freq(head_dim, rope_theta))
    elif rope_type == "linear":
        assert rope_scaling is not None
        angles = torch.outer(pos, _base_inv_freq(head_dim, rope_theta) / float(rope_scaling["factor"]))
    elif rope_type == "llama3":
        assert rope_scaling is not None
        angles = torch.outer(pos, _llama3_inv_freq(head_dim, rope_theta, rope_scaling))
    elif rope_type == "yarn":
        assert rope_scaling is not None
        inv_freq, attention_factor = _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
        angles = torch.outer(pos, inv_freq)
    elif rope_type == "dynamic":
        assert rope_scaling is not None
        factor = float(rope_scaling["factor"])
        original = int(rope_scaling.get("original_max_position_embeddings") or max_position_embeddings)
        seq_len = (pos + 1).clamp(min=original).double()
        # NTK base of a sequence of length seq_len (== rope_theta while seq_len <= original)
        base = rope_theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim
        inv_freq = (1.0 / base[:, None] ** exponents[None, :]).float()
        inv_freq[: min(original, num_positions)] = _base_inv_freq(head_dim, rope_theta)
        angles = pos[:, None] * inv_freq
    else:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}"
        )
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class RotaryEmbedding:
    """Applies RoPE to q and k; tables cover ``max_positions`` positions and are built lazily per device."""

    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
        max_position_embeddings: int, max_positions: int | None = None,
    ) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim (got {head_dim})")
        rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rope_type not in ROPE_TYPES:
            raise NotImplementedError(
                f"rope_scaling type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}"
            )
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.max_position_embeddings = max_position_embeddings
        self.max_positions = max_positions or max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[max_positions, head_dim/2]`` float32 on ``device``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._tables:
            cos, sin = rope_tables(self.head_dim, self.rope_theta, self.rope_scaling,
                                   self.max_position_embeddings, self.max_positions)
            self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    def check_positions(self, positions: torch.Tensor) -> None:
        """Refuse positions past the tables (checked for CPU positions only: a CUDA check would sync)."""
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is beyond the {self.max_positions} positions the model's "
                f"rotary embedding covers; cap requests at ModelConfig.max_context_len"
            )

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` by ``positions [T]``; results keep the input dtype."""
        self.check_positions(positions)
        cos, sin = self.tables(positions.device)
        cos = cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = sin[positions].unsqueeze(1)
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
