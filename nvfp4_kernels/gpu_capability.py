"""The compute capability of the NVIDIA GPU a tensor lives on, cached per device index: launch decisions ask it for
every kernel they launch (programmatic dependent launch, the skinny linear)."""

from __future__ import annotations

import torch

_cache: dict[int, tuple[int, int] | None] = {}


def nvidia_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) of ``t``'s NVIDIA GPU; None for a CPU tensor and for a ROCm build's "cuda" devices."""
    if not t.is_cuda:
        return None
    index = t.get_device()
    if index not in _cache:
        _cache[index] = None if torch.version.hip is not None else torch.cuda.get_device_capability(index)
    return _cache[index]
