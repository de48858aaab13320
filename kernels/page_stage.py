"""Pages of a pool (every layer, every part) to and from one page-major staging buffer: the host tier's copies
(engine/host_pool.py) move a batch of pages as one gather, one device <-> host copy per run of host pages and
one scatter, whatever the number of layers and parts.

    plan = StagePlan.of(parts)        parts: each layer's k, k_sf, v, v_sf tensors ([num_pages, ...], any dtype)
    gather(plan, ids, stage)          stage [n, plan.page_bytes] uint8 <- pages ``ids`` of every part, in order
    scatter(plan, ids, stage)         the inverse: pages ``ids`` of every part <- stage

A staged page is the concatenation of its bytes in every part, in ``parts`` order. On CUDA one Triton launch
(kernels/triton/page_stage.py); elsewhere, and as the reference the kernel is tested against, ``index_select`` /
``index_copy_`` per part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_BLOCK_BYTES = 4096  # bytes one program moves (1024 int32 words)


@dataclass(frozen=True, eq=False)
class StagePlan:
    """The parts' byte views ([num_pages, page bytes] uint8), their offsets in a staged page, and the kernel's
    table (on the parts' device): one row (address, words per page, offset in words) per part."""

    views: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    page_bytes: int
    word_bytes: int  # 4 when every part's page is a multiple of 4 bytes, else 1
    table: torch.Tensor

    @classmethod
    def of(cls, parts: Sequence[torch.Tensor]) -> StagePlan:
        if not parts:
            raise ValueError("a stage plan needs at least one part")
        views = tuple(t.view(torch.uint8).reshape(t.shape[0], -1) for t in parts)
        if any(not t.is_contiguous() for t in parts) or len({v.shape[0] for v in views}) != 1:
            raise ValueError("stage plan parts must be contiguous with one page count")
        if len({v.device for v in views}) != 1:
            raise ValueError("stage plan parts must be on one device")
        sizes = [v.shape[1] for v in views]
        word = 4 if all(n % 4 == 0 for n in sizes) else 1
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        rows = [[v.data_ptr(), n // word, off // word] for v, n, off in zip(views, sizes, offsets, strict=True)]
        table = torch.tensor(rows, dtype=torch.int64).to(views[0].device)
        return cls(views, tuple(offsets), sum(sizes), word, table)

    @property
    def device(self) -> torch.device:
        return self.views[0].device


def _check(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor) -> None:
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device != plan.device:
        raise ValueError(f"page ids must be int64 [n] on {plan.device}, got {ids.dtype} {tuple(ids.shape)}")
    if stage.dtype != torch.uint8 or stage.shape != (ids.numel(), plan.page_bytes) or not stage.is_contiguous():
        raise ValueError(f"stage must be contiguous uint8 [{ids.numel()}, {plan.page_bytes}], got {stage.dtype} "
                         f"{tuple(stage.shape)}")
    if stage.device != plan.device:
        raise ValueError(f"stage on {stage.device}, pool parts on {plan.device}")


def gather_reference(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor) -> None:
    """MUTATES ``stage``: row i = page ids[i] of every part, concatenated."""
    for v, off in zip(plan.views, plan.offsets, strict=True):
        stage[:, off:off + v.shape[1]] = v.index_select(0, ids)


def scatter_reference(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor) -> None:
    """MUTATES the parts: page ids[i] of every part = its bytes in stage row i."""
    for v, off in zip(plan.views, plan.offsets, strict=True):
        v.index_copy_(0, ids, stage[:, off:off + v.shape[1]])


def _launch(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
    import triton  # only where it runs: a CPU install has no triton

    from kernels.triton.page_stage import page_stage_kernel

    n = ids.numel()
    if n == 0:
        return
    elem = torch.int32 if plan.word_bytes == 4 else torch.uint8
    block = _BLOCK_BYTES // plan.word_bytes
    most = max(v.shape[1] for v in plan.views) // plan.word_bytes
    page_stage_kernel[(n, len(plan.views), triton.cdiv(most, block))](
        plan.table, ids, stage.view(elem), plan.page_bytes // plan.word_bytes, BLOCK=block, GATHER=gather,
        num_warps=4)


def _move(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, to_stage: bool) -> None:
    _check(plan, ids, stage)
    if plan.device.type == "cuda":
        _launch(plan, ids, stage, gather=to_stage)
    else:
        (gather_reference if to_stage else scatter_reference)(plan, ids, stage)


def gather(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor) -> None:
    """MUTATES ``stage`` [n, page_bytes]: the pages ``ids`` of every part (one launch on CUDA)."""
    _move(plan, ids, stage, to_stage=True)


def scatter(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor) -> None:
    """MUTATES the parts: pages ``ids`` of every part from ``stage`` (one launch on CUDA). Each id once."""
    _move(plan, ids, stage, to_stage=False)
