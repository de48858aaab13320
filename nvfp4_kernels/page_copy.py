"""Pages of one pool layer copied into another's, and the NaN/inf check of the prompt's slots: the reference.

    dst[p][dst_ids[i]] = src[p][src_ids[i]]   for every present part p of (k, k_sf, v, v_sf), every i
    flag |= any checked value of the first num_tokens token slots of the pages is NaN/inf

Page i (0-based within the call) holds the sequence's token slots [i*S, (i+1)*S); only those < num_tokens are
checked, each part as what its bytes hold (``check_kind``): nvfp4 E2M1 codes (uint8) cannot be NaN and are not
checked, their E4M3 block scales are; fp8_e4m3 values are E4M3; bf16 values are bf16. A part is
``[P, S, Hk, X]`` contiguous, so a page's first t token slots are its first t * (page bytes / S) bytes.

``copy_pages_reference`` is the pure-PyTorch definition (CPU pools use it); ``nvfp4_kernels.page_copy_triton`` is
the one-launch CUDA version, held to it byte for byte. ``move_pages_reference`` is the same over the same pages
of several layers (a cuda-ipc batch; or the check alone of pages another agent wrote, e.g. a NIXL READ). Pure
torch: importable without triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_CHECKED = (torch.float8_e4m3fn, torch.bfloat16)


def check_kind(t: torch.Tensor) -> torch.dtype | None:
    """What a part's values are checked as: E4M3, bf16, or None (E2M1 codes: every byte is finite)."""
    return t.dtype if t.dtype in _CHECKED else None


def nan_or_inf(raw: torch.Tensor, kind: torch.dtype) -> torch.Tensor:
    """A 0-d bool tensor (on ``raw``'s device, no sync): whether uint8 bytes ``raw`` of ``kind`` hold a NaN/inf."""
    if kind == torch.float8_e4m3fn:  # E4M3 (fn): NaN is S.1111.111, there is no inf
        return ((raw & 0x7F) == 0x7F).any()
    # bf16 NaN/inf: exponent all ones, read off the bytes (a message's payload need not be 2-aligned)
    pairs = raw.reshape(-1, 2)  # little-endian: [low byte, high byte]
    return (((pairs[:, 1] & 0x7F) == 0x7F) & ((pairs[:, 0] & 0x80) != 0)).any()


def page_rows(t: torch.Tensor) -> torch.Tensor:
    """A pool part ``[P, S, Hk, X]`` as bytes ``[P, page bytes]`` (a view)."""
    return t.view(torch.uint8).view(t.shape[0], -1)


def flag_prompt_slots(rows: torch.Tensor, page_size: int, num_tokens: int, kind: torch.dtype | None,
                      flag: torch.Tensor) -> None:
    """``flag |= nan_or_inf`` over the first ``num_tokens`` token slots of page bytes ``rows`` [n, page bytes]
    (sequence pages 0..n-1 of the call). MUTATES ``flag`` (int32, one element)."""
    slots = max(0, min(rows.shape[0] * page_size, num_tokens))
    if kind is not None and slots:
        flag.bitwise_or_(nan_or_inf(rows.reshape(rows.shape[0] * page_size, -1)[:slots], kind))


def copy_pages_reference(src: Sequence[torch.Tensor | None], dst: Sequence[torch.Tensor | None],
                         src_ids: torch.Tensor, dst_ids: torch.Tensor, num_tokens: int, flag: torch.Tensor,
                         copy: bool = True) -> None:
    """MUTATES ``dst`` (with ``copy``) and ``flag``: the module docstring's function. ``src``/``dst`` are the
    parts (k, k_sf, v, v_sf; None where absent) of one layer; ids int64 on their device; without ``copy`` only
    ``src``'s pages are checked (``dst`` names the kinds)."""
    for s, d in zip(src, dst, strict=True):
        if d is None:
            continue
        rows = page_rows(s).index_select(0, src_ids)
        flag_prompt_slots(rows, d.shape[1], num_tokens, check_kind(d), flag)
        if copy:
            page_rows(d).index_copy_(0, dst_ids, rows)


def move_pages_reference(src_layers: Sequence[Sequence[torch.Tensor | None]],
                         dst_layers: Sequence[Sequence[torch.Tensor | None]], src_ids: torch.Tensor,
                         dst_ids: torch.Tensor, num_tokens: int, flag: torch.Tensor, copy: bool = True) -> None:
    """MUTATES the destinations (with ``copy``) and ``flag``: ``copy_pages_reference`` of each layer pair, the
    same pages of every layer (pages another agent wrote are checked with the same layers twice, no copy)."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        copy_pages_reference(src, dst, src_ids, dst_ids, num_tokens, flag, copy)
