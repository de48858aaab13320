"""Pages of a pool (every layer, every part) to and from page-major rows: the host tier's copies
(engine/host_pool.py) move a batch of pages as one launch, whatever the number of layers and parts.

    plan = StagePlan.of(parts)          parts: each layer's k, k_sf, v, v_sf tensors ([num_pages, ...], any dtype)
    gather(plan, ids, stage)            stage [n, plan.page_bytes] uint8 <- pages ``ids`` of every part, in order
    gather(plan, ids, stage, rows)      stage [R, plan.page_bytes]: page ids[i] into row rows[i]
    scatter(plan, ids, stage[, rows])   the inverse: pages ``ids`` of every part <- stage (rows)

A staged page is the concatenation of its bytes in every part, in ``parts`` order. On CUDA one Triton launch
(nvfp4_kernels/triton/page_stage.py); elsewhere, and as the reference the kernel is tested against, ``index_select`` /
``index_copy_`` per part. With a CUDA plan, ``stage`` is device memory or pinned host memory the GPU maps: the
host tier's pages themselves, so a batch crosses the bus in the one launch, with no staging copy.

Ids and rows index raw addresses in the kernel: the caller checks them against the pool and ``stage``.
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


def _check(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, rows: torch.Tensor | None) -> None:
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device != plan.device:
        raise ValueError(f"page ids must be int64 [n] on {plan.device}, got {ids.dtype} {tuple(ids.shape)}")
    if rows is not None and (rows.dtype != torch.int64 or rows.shape != ids.shape or rows.device != plan.device):
        raise ValueError(f"rows must be int64 [{ids.numel()}] on {plan.device}, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    if stage.dtype != torch.uint8 or stage.dim() != 2 or stage.shape[1] != plan.page_bytes or \
            (rows is None and stage.shape[0] != ids.numel()) or not stage.is_contiguous():
        want = f"[{ids.numel()}, {plan.page_bytes}]" if rows is None else f"[R, {plan.page_bytes}]"
        raise ValueError(f"stage must be contiguous uint8 {want}, got {stage.dtype} {tuple(stage.shape)}")
    # host memory with a CUDA plan: the kernel reads or writes it over the bus (Triton refuses a pointer the GPU
    # does not map; Tensor.is_pinned() cannot tell, as it reads False for cudaHostRegister'ed memory)
    if stage.device != plan.device and not (plan.device.type == "cuda" and stage.device.type == "cpu"):
        raise ValueError(f"stage on {stage.device}, pool parts on {plan.device}")


def _rows(stage: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | slice:
    return slice(None) if rows is None else rows.to(stage.device)


def gather_reference(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor,
                     rows: torch.Tensor | None = None) -> None:
    """MUTATES ``stage``: row rows[i] (or i) = page ids[i] of every part, concatenated."""
    r = _rows(stage, rows)
    for v, off in zip(plan.views, plan.offsets, strict=True):
        stage[r, off:off + v.shape[1]] = v.index_select(0, ids).to(stage.device)


def scatter_reference(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor,
                      rows: torch.Tensor | None = None) -> None:
    """MUTATES the parts: page ids[i] of every part = its bytes in stage row rows[i] (or i)."""
    r = _rows(stage, rows)
    for v, off in zip(plan.views, plan.offsets, strict=True):
        v.index_copy_(0, ids, stage[r, off:off + v.shape[1]].to(v.device))


def _launch(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, gather: bool,
            rows: torch.Tensor | None = None) -> None:
    import triton  # only where it runs: a CPU install has no triton

    from nvfp4_kernels.triton.page_stage import page_stage_kernel

    n = ids.numel()
    if n == 0:
        return
    elem = torch.int32 if plan.word_bytes == 4 else torch.uint8
    block = _BLOCK_BYTES // plan.word_bytes
    most = max(v.shape[1] for v in plan.views) // plan.word_bytes
    page_stage_kernel[(n, len(plan.views), triton.cdiv(most, block))](
        plan.table, ids, ids if rows is None else rows, stage.view(elem), plan.page_bytes // plan.word_bytes,
        BLOCK=block, GATHER=gather, HAS_ROWS=rows is not None, num_warps=4)


def _move(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, rows: torch.Tensor | None, to_stage: bool) -> None:
    _check(plan, ids, stage, rows)
    if plan.device.type == "cuda":
        _launch(plan, ids, stage, to_stage, rows)
    else:
        (gather_reference if to_stage else scatter_reference)(plan, ids, stage, rows)


def gather(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """MUTATES ``stage``: the pages ``ids`` of every part into rows ``rows`` (default 0..n-1; one launch on CUDA)."""
    _move(plan, ids, stage, rows, to_stage=True)


def scatter(plan: StagePlan, ids: torch.Tensor, stage: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """MUTATES the parts: pages ``ids`` of every part from rows ``rows`` of ``stage`` (default 0..n-1; one
    launch on CUDA). Each id once."""
    _move(plan, ids, stage, rows, to_stage=False)
