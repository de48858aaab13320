"""Calibrated per-layer KV-cache global scales: the scales file and its loader (what a served engine reads).

The tool that writes it is ``offline.calibration``: ``calibrate`` runs calibration text (default: the train split of the stdlib corpus, see ``offline.corpus``)
through the model with exact, cache-free attention whose ``AttnFn`` is wrapped by ``AmaxRecorder``: the
K it sees is the cached K (after k_norm and RoPE), so its amax is what the cache must represent. From
the per-layer amax come the global scales:

    nvfp4 pool      g = amax / (6 * 448)     the largest block scale lands on E4M3's max, 448
    fp8_e4m3 pool   s = amax / 448           (and the FP8 prefill/extend workspace of an nvfp4 pool)

Scales file (``nvfp4-serve calibrate --out FILE``), JSON, version 1::

    {
      "format": "nvfp4-serve/kv-scales",
      "version": 1,
      "model_fingerprint": "16 hex digits (engine.loader.model_fingerprint of the calibrated checkpoint)",
      "num_layers": L,
      "calibration": {"num_tokens": N, "source": "where the text came from", "kv_rotation": "none"},
      "amax":  {"k": [L floats], "v": [L floats]},            the source of truth
      "nvfp4": {"k_scales": [L floats], "v_scales": [L floats]},  amax / 2688 (1.0 where amax is 0)
      "fp8":   {"k_scales": [L floats], "v_scales": [L floats]}   amax / 448  (1.0 where amax is 0)
    }

The ``nvfp4`` and ``fp8`` sections are derived (written for other tools to read); loading checks that
they still match ``amax``. A file is refused for a model with another fingerprint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "nvfp4-serve/kv-scales"
VERSION = 1
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_REL_TOL = 1e-6


def _scales(amax: Sequence[float], divisor: float) -> tuple[float, ...]:
    # A layer whose K or V never left 0 in calibration keeps the uncalibrated 1.0 (a scale must be > 0).
    return tuple(a / divisor if a > 0 else 1.0 for a in amax)


@dataclass(frozen=True)
class KVScales:
    """Per-layer amax of K and V from calibration, and the global scales derived from them."""

    model_fingerprint: str
    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]
    num_tokens: int = 0
    source: str = ""
    kv_rotation: str = "none"  # --kv-rotation the amax was recorded under (rotated K/V have other amax)

    def __post_init__(self) -> None:
        if len(self.k_amax) != len(self.v_amax) or not self.k_amax:
            raise ValueError(
                f"KV scales need one K and one V amax per layer (got {len(self.k_amax)} K and "
                f"{len(self.v_amax)} V values)"
            )
        for name, values in (("k", self.k_amax), ("v", self.v_amax)):
            if not all(math.isfinite(a) and a >= 0 for a in values):
                raise ValueError(f"{name} amax values must be finite and >= 0, got {list(values)}")

    @property
    def num_layers(self) -> int:
        return len(self.k_amax)

    def nvfp4_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(k, v) NVFP4 global scales: amax / (6 * 448)."""
        return _scales(self.k_amax, E2M1_MAX * E4M3_MAX), _scales(self.v_amax, E2M1_MAX * E4M3_MAX)

    def fp8_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(k, v) FP8 E4M3 per-tensor scales: amax / 448."""
        return _scales(self.k_amax, E4M3_MAX), _scales(self.v_amax, E4M3_MAX)

    def cache_scales(self, kv_dtype: str) -> dict[str, tuple[float, ...]]:
        """``CacheConfig`` keyword arguments for a pool of ``kv_dtype``.

        nvfp4: pool scales from the nvfp4 section, FP8 workspace scales from the fp8 section;
        fp8_e4m3: the fp8 section (its workspace holds the pool's own bytes); bf16: none (no scales).
        """
        if kv_dtype == "nvfp4":
            (k, v), (wk, wv) = self.nvfp4_scales(), self.fp8_scales()
            return {"k_scales": k, "v_scales": v, "ws_k_scales": wk, "ws_v_scales": wv}
        if kv_dtype == "fp8_e4m3":
            k, v = self.fp8_scales()
            return {"k_scales": k, "v_scales": v}
        if kv_dtype == "bf16":
            return {}
        raise ValueError(f"unknown kv dtype {kv_dtype!r}")

    # -- the file ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        (nk, nv), (fk, fv) = self.nvfp4_scales(), self.fp8_scales()
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "calibration": {"num_tokens": self.num_tokens, "source": self.source, "kv_rotation": self.kv_rotation},
            "amax": {"k": list(self.k_amax), "v": list(self.v_amax)},
            "nvfp4": {"k_scales": list(nk), "v_scales": list(nv)},
            "fp8": {"k_scales": list(fk), "v_scales": list(fv)},
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "scales file") -> KVScales:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(
                f'{where} is not an nvfp4-serve KV scales file (needs "format": "{FORMAT}"); '
                "make one with `nvfp4-serve calibrate --model DIR --out FILE`"
            )
        if data.get("version") != VERSION:
            raise ValueError(
                f"{where} has version {data.get('version')!r}; this build reads version {VERSION}"
            )
        try:
            amax, cal = data["amax"], data.get("calibration", {})
            scales = cls(
                str(data["model_fingerprint"]),
                tuple(float(a) for a in amax["k"]),
                tuple(float(a) for a in amax["v"]),
                int(cal.get("num_tokens", 0)),
                str(cal.get("source", "")),
                str(cal.get("kv_rotation", "none")),  # files written before rotation existed: unrotated
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where} misses a field of the version {VERSION} schema: {e}") from e
        if data.get("num_layers", scales.num_layers) != scales.num_layers:
            raise ValueError(
                f"{where}: num_layers is {data['num_layers']} but amax has {scales.num_layers} entries"
            )
        derived = scales.to_json()
        for section in ("nvfp4", "fp8"):
            for key in ("k_scales", "v_scales"):
                got = data.get(section, {}).get(key)
                want = derived[section][key]
                if got is not None and (
                    len(got) != len(want)
                    or any(not math.isclose(float(a), b, rel_tol=_REL_TOL) for a, b in zip(got, want))
                ):
                    raise ValueError(
                        f"{where}: {section}.{key} does not follow from amax (amax / "
                        f"{'2688' if section == 'nvfp4' else '448'}); edit amax, not the derived "
                        "scales, or recalibrate"
                    )
        return scales

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, model_fingerprint: str | None = None) -> KVScales:
        """Read and validate a scales file; with ``model_fingerprint``, refuse a file of another model."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ValueError(f"--kv-scales file {path} does not exist") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--kv-scales file {path} is not JSON: {e}") from e
        scales = cls.from_json(data, f"--kv-scales file {path}")
        if model_fingerprint is not None and scales.model_fingerprint != model_fingerprint:
            raise ValueError(
                f"--kv-scales file {path} was calibrated for model {scales.model_fingerprint}, but the "
                f"model served has fingerprint {model_fingerprint}: recalibrate for this model"
            )
        return scales
