"""Programmatic dependent launch (PDL, SM90 and later) for the small kernels of a decode step (norms with the
residual add, SiLU-and-multiply, q/k norm + RoPE, the K/V pool writes).

A kernel launched with PDL may be scheduled while the kernel before it on the stream still finishes: its
launch and block start-up overlap that kernel's tail instead of following its completion. Inside a CUDA graph
the capture keeps it as a programmatic edge. A decode step runs a few hundred small kernels, so these gaps
add up (the "launch gaps" column of docs/benchmarks/engine_decode.md); FlashInfer launches its attention and
merge kernels this way by default on SM90.

The NVFP4 decode and its merge are launched without it: on the H200, the 36 layers' decode loop alone took
0.91 / 8.16 / 22.31 ms with it against 0.80 / 7.71 / 21.70 without at 1 / 16 / 44 x 32K, while FlashInfer's
fp8 loop, which the switch does not touch, moved by at most 4% in the same run (docs/benchmarks/engine_decode.md).

Invariant: a kernel launched with ``launch_pdl=uses_pdl(t)`` passes the same value as its ``PDL`` constexpr, and
with it calls ``pdl_enter`` (nvfp4_kernels/triton/pdl.py) before it touches any memory another kernel writes or
reads: the wait there returns once the kernel before it has completed and its writes are visible, so the order
of the stream holds as without PDL. Waits chain: that kernel completed only after its own wait returned.

``set_enabled(False)`` launches every later kernel without it (the benchmarks' before/after, the engine's
``--disable-pdl``); a CUDA graph keeps what was in force when it was captured. The switch is process-wide: the
last engine built in a process sets it. ``for_target`` gives the launch keywords of a named GPU whatever the
tensors' device (warm-cache compiles the GPU's variants from CPU tensors: the constexpr and the launch option
are both in Triton's cache key).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nvfp4_kernels.gpu_capability import nvidia_capability

_state: dict = {"enabled": True, "target": None}


def set_enabled(enabled: bool) -> None:
    """Whether kernels launched from now on use PDL where the GPU supports it (process-wide)."""
    _state["enabled"] = bool(enabled)


def enabled() -> bool:
    return _state["enabled"]


def uses_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` is launched with PDL: enabled, ``t`` on an NVIDIA GPU of compute capability 9+
    (a ROCm build's "cuda" devices have no such launch). Called per launch: cheap checks first, the GPU's answer
    cached per device index (``gpu_capability``)."""
    if not _state["enabled"]:
        return False
    if _state["target"] is not None:
        return _state["target"] >= (9, 0)
    capability = nvidia_capability(t)
    return capability is not None and capability[0] >= 9


@contextmanager
def for_target(capability: tuple[int, int], enabled: bool = True) -> Iterator[None]:
    """Inside: every launch's keywords as on an NVIDIA GPU of ``capability`` with PDL ``enabled``, whatever the
    tensors' device; the previous state after."""
    before = dict(_state)
    _state.update(enabled=bool(enabled), target=tuple(capability))
    try:
        yield
    finally:
        _state.update(before)


_WITH = {"PDL": True, "launch_pdl": True}
_WITHOUT = {"PDL": False, "launch_pdl": False}


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """The launch keywords of a kernel with a ``PDL`` constexpr over ``t``: its constexpr and Triton's launch option,
    always equal (the invariant above). A shared dict: unpack it (``**``), never change it."""
    return _WITH if uses_pdl(t) else _WITHOUT
