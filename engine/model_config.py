"""Model geometry read from a Hugging Face ``config.json`` (Qwen3 / Qwen2 / Llama / Mistral family).

Only dense decoder-only models with SwiGLU MLPs, RMSNorm and neox-style RoPE are covered.
Anything else fails here, at load time, with a message naming what is unsupported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architecture -> (qk_norm, default attention_bias on q/k/v, o_proj follows attention_bias)
_ARCHITECTURES: dict[str, tuple[bool, bool, bool]] = {
    "Qwen3ForCausalLM": (True, False, True),
    "Qwen2ForCausalLM": (False, True, False),
    "LlamaForCausalLM": (False, False, True),
    "MistralForCausalLM": (False, False, True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint. Build with ``from_dir`` / ``from_dict``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF rope_scaling dict with the type under "rope_type"; None means plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # None when the model attends to the whole context
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer (got {value!r})")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"config.json: head_dim must be even for rotary embeddings (got {self.head_dim})")
        if self.hidden_act != "silu":
            raise NotImplementedError(
                f"config.json: hidden_act {self.hidden_act!r} is not implemented; only 'silu' (SwiGLU) is"
            )
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"config.json: rms_norm_eps must be a positive number (got {self.rms_norm_eps})")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"config.json: rope_theta must be a positive number (got {self.rope_theta})")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ROPE_TYPES:
                raise NotImplementedError(
                    f"config.json: rope_scaling type {rope_type!r} is not implemented; "
                    f"supported: {', '.join(ROPE_TYPES)}"
                )
            if rope_type != "default":
                factor = self.rope_scaling.get("factor")
                if not isinstance(factor, (int, float)) or factor < 1.0:
                    raise ValueError(
                        f"config.json: rope_scaling {rope_type!r} needs a numeric factor >= 1 (got {factor!r})"
                    )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"config.json: sliding_window must be positive or null (got {self.sliding_window})")

    # -- derived -------------------------------------------------------------------------------
    @property
    def num_q_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size); q head h reads kv head h // num_q_per_kv."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @property
    def max_rope_positions(self) -> int:
        """Positions the rotary tables cover: the trained length, extended by linear/dynamic/yarn scaling."""
        if self.rope_type in ("linear", "dynamic", "yarn"):
            assert self.rope_scaling is not None
            original = int(self.rope_scaling.get("original_max_position_embeddings") or self.max_position_embeddings)
            return max(self.max_position_embeddings, int(original * float(self.rope_scaling["factor"])))
        return self.max_position_embeddings

    @property
    def max_context_len(self) -> int:
        """Longest sequence the engine may run. A sliding window is not implemented by the attention
        paths, so it caps the context (full attention equals windowed attention up to the window)."""
        if self.sliding_window is not None:
            return min(self.max_rope_positions, self.sliding_window)
        return self.max_rope_positions

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json``."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist: expected a Hugging Face checkpoint directory")
        cfg = path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
        try:
            data = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the parsed content of a HF config.json."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError(
                f"config.json has no 'architectures' entry; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in _ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        qk_norm, default_bias, o_follows = _ARCHITECTURES[arch]
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing required fields: {', '.join(missing)}")

        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope_theta, rope_scaling = _rope_from_dict(d)

        attn_bias = bool(d.get("attention_bias", default_bias))
        if arch == "Qwen2ForCausalLM":
            attn_bias = True  # Qwen2 always has q/k/v biases and never an o_proj bias
        sliding = d.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
            sliding = None
        if sliding is not None and sliding >= d.get("max_position_embeddings", 4096):
            sliding = None

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            attention_bias=attn_bias,
            o_proj_bias=attn_bias and o_follows,
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        )


def _rope_from_dict(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either the classic fields or ``rope_parameters``."""
    params = d.get("rope_parameters")
    if isinstance(params, dict):  # newer transformers layout: theta and scaling in one dict
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None)
    scaling["rope_type"] = scaling.get("rope_type") or rope_type or "default"
    if scaling["rope_type"] == "default":
        return theta, None
    return theta, scaling
