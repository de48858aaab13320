"""A backend composed of named parts: which part serves each phase, per pool KV dtype, fixed at construction.

    Composition
      prefill      ragged causal attention over workspace K/V (one part: prefill never sees the pool)
      planner      ``plan_decode``: the checks and per-plan state every decode plan gets
      pools        kv dtype -> PoolParts(write_kv, gather_workspace, decode)
      other        PoolParts for a kv dtype the table does not name

``ComposedBackend`` is the ``AttentionBackend`` over a ``Composition``: each method looks up the part of its
phase (by ``layer.kv_dtype``, or ``options.kv_dtype`` when planning a decode) and calls it; it holds no kernel
code. ``Composition.table()`` names the part of every phase per dtype (what ``TritonBackend`` runs where).

A part is any object with a ``name`` and its phase's method: ``write_kv`` / ``gather_workspace`` / ``prefill``
with the ``AttentionBackend`` signatures (so ``ReferenceBackend`` serves as one), and for decode ``prepare``
(after ``planner.plan``, with the ``DecodeOptions``), ``refresh`` (before a CUDA-graph replay), ``warm`` and
``decode``; a decode part may name the kernel it runs for a head dim and device (``kernel_for``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from nvfp4_kernels.backends.base import AttentionBackend, DecodeOptions, DecodePlan, PrefillPlan
from nvfp4_kernels.kv_layout import LayerKV


class WritePart(Protocol):
    name: str

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


class GatherPart(Protocol):
    name: str

    def gather_workspace(self, layer: LayerKV, slots: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor
                         ) -> None: ...


class PrefillPart(Protocol):
    name: str

    def prefill(self, plan: PrefillPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: float, v_scale: float, sm_scale: float) -> torch.Tensor: ...


class PlannerPart(Protocol):
    name: str

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int) -> DecodePlan: ...


class DecodePart(Protocol):
    name: str

    def prepare(self, plan: DecodePlan, options: DecodeOptions) -> None: ...

    def refresh(self, plan: DecodePlan, page_table: np.ndarray, seq_lens: np.ndarray) -> None: ...

    def warm(self, layer: LayerKV, shapes: list[tuple[int, int]], num_qo_heads: int,
             q_dtype: torch.dtype, sm_scale: float, fill_page: int) -> int: ...

    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class PoolParts:
    """The parts that read or write one pool dtype."""

    write_kv: WritePart  # quantize-on-write: fresh K/V rows -> pool slots
    gather_workspace: GatherPart  # pool pages -> workspace rows (the cached prefix of an extend)
    decode: DecodePart  # one query token per sequence, read straight from the pool


@dataclass(frozen=True)
class Composition:
    prefill: PrefillPart
    planner: PlannerPart
    pools: Mapping[str, PoolParts]
    other: PoolParts

    def pool(self, kv_dtype: str) -> PoolParts:
        return self.pools.get(kv_dtype, self.other)

    def decode_parts(self) -> list[DecodePart]:
        """Every distinct decode part, in table order (``other`` last)."""
        out: list[DecodePart] = []
        for parts in (*self.pools.values(), self.other):
            if not any(parts.decode is d for d in out):
                out.append(parts.decode)
        return out

    def table(self) -> dict[str, dict[str, str]]:
        """kv dtype -> phase -> part name ("<part>, else <fallback>" for a part that may hand a call on)."""
        return {dtype: {"write_kv": _label(p.write_kv), "gather_workspace": _label(p.gather_workspace),
                        "prefill": _label(self.prefill), "plan_decode": _label(self.planner),
                        "decode": _label(p.decode)}
                for dtype, p in self.pools.items()}


def _label(part: object) -> str:
    fallback = getattr(part, "fallback", None)
    return part.name if fallback is None else f"{part.name}, else {fallback.name}"


class ComposedBackend(AttentionBackend):
    """Dispatches every ``AttentionBackend`` method to the part of its phase (``self.parts``)."""

    def __init__(self, parts: Composition) -> None:
        self.parts = parts

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.parts.pool(layer.kv_dtype).write_kv.write_kv(layer, slots, k, v)

    def gather_workspace(self, layer: LayerKV, slots: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor) -> None:
        self.parts.pool(layer.kv_dtype).gather_workspace.gather_workspace(layer, slots, ws_k, ws_v)

    def prefill(self, plan: PrefillPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: float, v_scale: float, sm_scale: float) -> torch.Tensor:
        return self.parts.prefill.prefill(plan, q, k, v, k_scale, v_scale, sm_scale)

    def plan_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, page_size: int, *,
                    options: DecodeOptions | None = None) -> DecodePlan:
        plan = self.parts.planner.plan(page_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size)
        if options is not None:
            self.parts.pool(options.kv_dtype).decode.prepare(plan, options)
        return plan

    def refresh_decode_plan(self, plan: DecodePlan, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        for part in self.parts.decode_parts():
            part.refresh(plan, page_table, seq_lens)

    def warm_decode(self, layer: LayerKV, shapes: list[tuple[int, int]], num_qo_heads: int,
                    q_dtype: torch.dtype, sm_scale: float, fill_page: int) -> int:
        return self.parts.pool(layer.kv_dtype).decode.warm(layer, shapes, num_qo_heads, q_dtype, sm_scale,
                                                           fill_page)

    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        return self.parts.pool(layer.kv_dtype).decode.decode(plan, q, layer, sm_scale)

    def decode_kernel(self, kv_dtype: str, head_dim: int, group: int, device: torch.device, *, num_kv_heads: int,
                      page_size: int) -> str:
        part = self.parts.pool(kv_dtype).decode
        kernel_for = getattr(part, "kernel_for", None)  # optional: parts whose kernel depends on the GPU
        if kernel_for is None:
            return _label(part)
        return kernel_for(head_dim, group, device, num_kv_heads=num_kv_heads, page_size=page_size)
