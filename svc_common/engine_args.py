"""Engine command-line options shared by every service and the launcher (names follow SGLang).

Each flag is declared once, as ``Flag`` metadata on its engine config field (engine/config.py); the parser, the
config of parsed flags and the argv forwarded to child services are generated from those fields by
``svc_common/config_flags.py``, the generator the services' own flags use too."""

from __future__ import annotations

import argparse

from engine.config import CacheConfig, EngineConfig
from svc_common.config_flags import add_flags, config_from_flags, flags_to_argv


def default_model_dir() -> str:
    from svc_common.default_model import default_model_dir as d

    return d()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per ``Flag`` of the engine config's fields (engine/config.py), in field order, in the group
    "engine"."""
    add_flags(p, EngineConfig, group="engine")


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


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine config of parsed engine options. Scale precedence (per layer, K and V): the
    ``--kv-scales`` file, else the checkpoint's k_scale/v_scale, else 1.0 (``engine.engine``)."""
    model_dir = a.model or default_model_dir()
    scales = (kv_scales_for(a.kv_scales, model_dir, a.kv_cache_dtype, a.num_layers, a.kv_rotation)
              if a.kv_scales else {})
    return config_from_flags(EngineConfig, a, {EngineConfig: {"model_dir": model_dir}, CacheConfig: scales})


def engine_args_to_argv(a: argparse.Namespace) -> list[str]:
    """The engine options of a parsed namespace as argv (the launcher passes them to child services)."""
    return flags_to_argv(EngineConfig, a)
