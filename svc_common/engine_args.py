"""Engine command-line options shared by every service and the launcher (names follow SGLang).

Each flag is declared once, as ``Flag`` metadata on its engine config field (engine/config.py); the parser, the
config of parsed flags and the argv forwarded to child services are generated from those fields."""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterator
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

from engine.config import CacheConfig, EngineConfig, Flag


def default_model_dir() -> str:
    from svc_common.default_model import default_model_dir as d

    return d()


def _flags(cls: type = EngineConfig) -> Iterator[tuple[Field, Any, Flag]]:
    """(field, resolved type, flag) of every field of ``cls`` with a flag, nested configs in place, in field order."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            yield from _flags(hints[f.name])
        elif "flag" in f.metadata:
            yield f, hints[f.name], f.metadata["flag"]


def _flag_name(f: Field, spec: Flag) -> str:
    return spec.name or "--" + f.name.replace("_", "-")


def _default(f: Field, spec: Flag) -> Any:
    if spec.has_default:
        return spec.default
    return None if f.default is MISSING else f.default


def _scalar(kind: Any) -> Any:
    """``int | None`` -> int."""
    args = [t for t in get_args(kind) if t is not type(None)]
    return args[0] if isinstance(kind, types.UnionType) and len(args) == 1 else kind


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per ``Flag`` of the engine config's fields (engine/config.py), in field order."""
    g = p.add_argument_group("engine")
    for f, kind, spec in _flags():
        kw: dict[str, Any] = {"dest": spec.attr(f.name), "default": _default(f, spec), "help": spec.help}
        if spec.parse is None and _scalar(kind) is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = spec.parse or _scalar(kind)
        if spec.choices is not None:
            kw["choices"] = list(spec.choices() if callable(spec.choices) else spec.choices)
        if spec.metavar:
            kw["metavar"] = spec.metavar
        g.add_argument(_flag_name(f, spec), *spec.aliases, **kw)


def kv_scales_for(path: str, model_dir: str, kv_dtype: str, num_layers: int | None = None,
                  kv_rotation: str = "none") -> dict[str, tuple[float, ...]]:
    """``CacheConfig`` scale arguments from a ``--kv-scales`` file checked against the model's fingerprint and
    the ``--kv-rotation`` it was calibrated under (rotated K/V have other amax).

    The file is calibrated on the whole checkpoint; with ``num_layers`` its first N layers' scales are kept
    (layer i's K/V depend only on layers < i, so they are the truncated model's own scales)."""
    from engine.kv_scales import KVScales
    from engine.loader import model_fingerprint

    calibrated = KVScales.load(path, model_fingerprint(model_dir))
    if calibrated.kv_rotation != kv_rotation:
        raise ValueError(f"--kv-scales file {path} was calibrated with --kv-rotation {calibrated.kv_rotation}, "
                         f"this server runs --kv-rotation {kv_rotation}: recalibrate with `nvfp4-serve calibrate "
                         f"--kv-rotation {kv_rotation}`")
    scales = calibrated.cache_scales(kv_dtype)
    if num_layers is None:
        return scales
    return {key: values[:num_layers] for key, values in scales.items()}


def _build(cls: type, a: argparse.Namespace, overrides: dict[type, dict[str, Any]]) -> Any:
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        spec = f.metadata.get("flag")
        if is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], a, overrides)
        elif spec is not None:
            value = getattr(a, spec.attr(f.name))
            kwargs.update(spec.to_fields(value) if spec.to_fields else {f.name: value})
    return cls(**{**kwargs, **overrides.get(cls, {})})


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine config of parsed engine options. Scale precedence (per layer, K and V): the
    ``--kv-scales`` file, else the checkpoint's k_scale/v_scale, else 1.0 (``engine.engine``)."""
    model_dir = a.model or default_model_dir()
    scales = (kv_scales_for(a.kv_scales, model_dir, a.kv_cache_dtype, a.num_layers, a.kv_rotation)
              if a.kv_scales else {})
    return _build(EngineConfig, a, {EngineConfig: {"model_dir": model_dir}, CacheConfig: scales})


def engine_args_to_argv(a: argparse.Namespace) -> list[str]:
    """The engine options of a parsed namespace as argv (the launcher passes them to child services)."""
    out: list[str] = []
    for f, _, spec in _flags():
        value = getattr(a, spec.attr(f.name))
        if value is None or value is False or (not spec.forward_default and value == _default(f, spec)):
            continue
        if value is True:
            out.append(_flag_name(f, spec))
        else:  # children may run elsewhere in the tree: a file is passed as an absolute path
            out += [_flag_name(f, spec), str(Path(value).resolve()) if spec.is_path else str(value)]
    return out
