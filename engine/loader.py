"""Load a Hugging Face safetensors checkpoint into ``CausalLM``, plus a cheap model fingerprint.

Tensors are read one at a time (``safe_open``), cast to the model dtype and copied into the
(possibly fused) parameter rows ``CausalLM.checkpoint_targets`` names, so peak extra memory is
one tensor. Every target must be filled exactly once; anything else in the checkpoint that is
not a known extra (rotary caches, KV-cache scales) is an error, so that e.g. a weight-quantized
checkpoint is refused instead of silently mis-loaded.

``num_layers=N`` serves only the first N decoder layers (quick benchmark runs of a large model): the
other layers' tensors and KV-cache scales are skipped unread, the returned config says N layers, and
the fingerprint names N, so a prefill and a decode service built with different N refuse each other.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import CausalLM
from engine.model_config import ModelConfig

_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# model.layers.{i}.self_attn[.attn].{k,v}_scale, or modelopt's ...self_attn.{k,v}_proj.output_scale
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:([kv])_scale|([kv])_proj\.output_scale)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|self_attn\.(?:attn\.)?(?:q|prob)_scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    kv_scales: dict[str, list[float]] | None  # {"k": [per layer], "v": [per layer]} from the checkpoint
    fingerprint: str


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None -> bf16 on CUDA, float32 elsewhere; strings like "bfloat16"/"bf16"/"float32" accepted."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unknown model dtype {dtype!r}; choose one of {', '.join(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[dtype]
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"model dtype must be one of {_FLOAT_DTYPES} (got {dtype})")
    return dtype


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of the index, or the single model.safetensors."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist: expected a Hugging Face checkpoint "
                                f"directory with config.json and *.safetensors")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index (needs a 'weight_map' object): {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    hint = " (PyTorch .bin checkpoints are not supported: convert them to safetensors)" \
        if any(model_dir.glob("*.bin")) else ""
    raise FileNotFoundError(
        f"no safetensors weights in {model_dir}: expected model.safetensors or model.safetensors.index.json "
        f"with its shards{hint}"
    )


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets), weights untouched."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * (1 << 20):
            raise ValueError(f"{path} is not a safetensors file (header length {size} is implausible)")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file (bad header: {e})") from e
    header.pop("__metadata__", None)
    return header


def served_num_layers(config: ModelConfig, num_layers: int | None, model_dir: str | Path) -> int:
    """The decoder layers served: ``num_layers`` (checked against the checkpoint's), or all of them."""
    if num_layers is None:
        return config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or \
            not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"--num-layers must be in 1..{config.num_hidden_layers} (the checkpoint {model_dir} has "
                         f"{config.num_hidden_layers} decoder layers), got {num_layers!r}")
    return num_layers


def model_fingerprint(model_dir: str | Path, num_layers: int | None = None) -> str:
    """16 hex digits over config.json (canonical JSON) and every tensor's (name, shape, dtype).

    ``num_layers`` fewer than the checkpoint's layers (see ``load_model``) enters the digest; all of them
    (or None) gives the checkpoint's own fingerprint."""
    model_dir = Path(model_dir)
    model_config = ModelConfig.from_dir(model_dir)  # same errors as load_model for a bad directory
    served = served_num_layers(model_config, num_layers, model_dir)
    digest = hashlib.sha256()
    if served != model_config.num_hidden_layers:
        digest.update(f"num_layers={served}\n".encode())
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    tensors = []
    for path in weight_files(model_dir):
        for name, info in read_safetensors_header(path).items():
            tensors.append((name, tuple(info["shape"]), info["dtype"]))
    for name, shape, dtype in sorted(tensors):
        digest.update(f"\n{name}|{','.join(map(str, shape))}|{dtype}".encode())
    return digest.hexdigest()[:16]


def load_model(model_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = None, num_layers: int | None = None,
               fused_ops: bool = True) -> LoadedModel:
    """Build ``CausalLM`` on ``device`` in ``dtype`` and fill it from the checkpoint in ``model_dir``;
    ``num_layers`` keeps only the first N decoder layers (None: all; see the module docstring); ``fused_ops``
    False keeps the model on the PyTorch norm/activation/RoPE ops on CUDA too."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    checkpoint_layers = config.num_hidden_layers
    config = replace(config, num_hidden_layers=served_num_layers(config, num_layers, model_dir))
    files = weight_files(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    model = CausalLM(config, dtype=dtype, device=device, fused_ops=fused_ops)
    params = dict(model.named_parameters())
    targets = model.checkpoint_targets()

    filled: set[str] = set()
    bad_shape: dict[str, str] = {}
    unexpected: list[str] = []
    scales: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer = _LAYER.match(name)
                if layer and config.num_hidden_layers <= int(layer.group(1)) < checkpoint_layers:
                    continue  # a layer past the --num-layers override: not read
                m = _KV_SCALE.match(name)
                if m:
                    value = f.get_tensor(name).float()
                    if value.numel() != 1:
                        bad_shape[name] = f"expected a scalar, got shape {tuple(value.shape)}"
                        continue
                    scales[m.group(2) or m.group(3)][int(m.group(1))] = float(value.reshape(()))
                    continue
                if name not in targets:
                    if not _IGNORED.search(name) and not (config.tie_word_embeddings and name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                param_name, start, stop = targets[name]
                dst = params[param_name].data
                if start is not None:
                    dst = dst[start:stop]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dst.shape):
                    bad_shape[name] = f"expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
                    continue
                if tensor.dtype not in _FLOAT_DTYPES:
                    raise NotImplementedError(
                        f"{path}: tensor {name} has dtype {tensor.dtype}; quantized weights are not supported, "
                        f"use a bf16/fp16/fp32 checkpoint"
                    )
                dst.copy_(tensor.to(dtype))
                filled.add(name)
                del tensor

    problems = []
    missing = [name for name in targets if name not in filled and name not in bad_shape]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if bad_shape:
        problems.append("mis-shaped tensors: " + "; ".join(f"{n}: {why}" for n, why in bad_shape.items()))
    if unexpected:
        problems.append(f"unexpected tensors (quantized or unsupported checkpoint?): {', '.join(sorted(unexpected))}")
    if problems:
        raise ValueError(f"checkpoint {model_dir} does not match {config.architecture}: " + " | ".join(problems))
    return LoadedModel(model, config, _kv_scales(scales, config, model_dir),
                       model_fingerprint(model_dir, num_layers))


def _kv_scales(scales: dict[str, dict[int, float]], config: ModelConfig,
               model_dir: Path) -> dict[str, list[float]] | None:
    if not scales["k"] and not scales["v"]:
        return None
    n = config.num_hidden_layers
    out: dict[str, list[float]] = {}
    for key in ("k", "v"):
        missing = [i for i in range(n) if i not in scales[key]]
        if missing:
            raise ValueError(f"checkpoint {model_dir} has KV-cache scales for some layers but no {key}_scale for "
                             f"layers {missing}: provide all or none")
        values = [scales[key][i] for i in range(n)]
        bad = [i for i, s in enumerate(values) if not (s > 0 and math.isfinite(s))]
        if bad:
            raise ValueError(f"checkpoint {model_dir}: {key}_scale of layers {bad} is not a positive finite number")
        out[key] = values
    return out
