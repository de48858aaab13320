"""What the page copies between a pool and the wire share (``svc_common/page_export.py``, the prefill's side,
and ``svc_common/page_import.py``, the decode's): the parts of a pool layer (k, k_sf, v, v_sf; the scales absent
for fp8/bf16 pools) and their bytes per page, the side stream a copy runs on, device page ids, and the summed
timings of a transfer's log line.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Sequence

import numpy as np
import torch

from engine.kv_pool import KVPool
from svc_common.kv_transfer_ipc import PoolView

PARTS = ("k", "k_sf", "v", "v_sf")
# a GPU pool's export, and a message written into the decode's pool: up to this many runs of consecutive pages move
# run by run (one copy per part and run, on the copy engine); more take a kernel (a gather, a page-copy launch). A
# kernel runs in this process's CUDA context, which the GPU time-slices with the other services' on one GPU
MAX_COPY_RUNS = 4


def pool_parts(pool: KVPool, layer: int) -> list[torch.Tensor | None]:
    """Layer ``layer``'s tensors of ``pool`` in ``PARTS`` order (None: absent scales)."""
    lkv = pool.layers[layer]
    return [lkv.k, lkv.k_sf, lkv.v, lkv.v_sf]


def view_parts(view: PoolView, layer: int) -> list[torch.Tensor | None]:
    """``pool_parts`` of a pool seen through a ``PoolView`` (another process's, opened here)."""
    return [view.layers[layer].get(name) for name in PARTS]


def page_bytes_of(parts: Sequence[torch.Tensor | None]) -> list[int]:
    """Bytes of one page of each of ``parts`` (0 for an absent part)."""
    return [0 if t is None else math.prod(t.shape[1:]) * t.element_size() for t in parts]


def part_page_bytes(pool: KVPool) -> list[int]:
    """Bytes of one page of each part (k, k_sf, v, v_sf; 0 for absent scales)."""
    return page_bytes_of(pool_parts(pool, 0))


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of its own on a GPU (None for a host pool)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream: torch.cuda.Stream | None):
    """``stream`` made current for a block (nothing for None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def device_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor on ``device``, copied without blocking the host (pinned source) on a GPU."""
    t = torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=len(ids)))  # 4x torch.tensor(list)'s speed
    return t if device.type != "cuda" else t.pin_memory().to(device, non_blocking=True)


class SummedTimes:
    """Seconds of a transfer's steps summed over the threads that run them (one ``add`` per unit of work), for
    the transfer's log line: ``STEPS`` name the fields, ``UNIT`` the work, ``LABELS`` the summary's words."""

    STEPS: tuple[str, ...] = ()
    UNIT = ""
    LABELS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.count = 0
        for name in self.STEPS:
            setattr(self, name, 0.0)
        self._lock = threading.Lock()

    def add(self, *seconds: float) -> None:
        with self._lock:
            for name, x in zip(self.STEPS, seconds, strict=True):
                setattr(self, name, getattr(self, name) + x)
            self.count += 1

    def summary(self) -> str:
        if not self.count:
            return ""
        steps = ", ".join(f"{getattr(self, n) * 1e3:.1f} ms {label}" for n, label in zip(self.STEPS, self.LABELS,
                                                                                        strict=True))
        return f" ({self.count} {self.UNIT}: {steps})"
