"""The typed launches of ``nvfp4_kernels.triton.page_copy``: ``copy_pages``, one layer's pages, every part, one
launch; ``move_pages``, the same pages of several layers (copied and checked, or checked alone), one launch
per kind of part (values; block scales) through the ``PageTables`` of those layers.

``copy_staged_pages`` is ``copy_pages`` from a received message copied to the device whole.

``copy_pages`` computes ``nvfp4_kernels.page_copy.copy_pages_reference`` byte for byte (copies and flag), with the
host work of one kernel launch instead of a gather, a scatter and a check per part: the cuda-ipc transfer's
copies are many small ones, bound by per-op host time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from nvfp4_kernels.page_copy import check_kind
from nvfp4_kernels.triton.page_copy import page_copy_kernel, page_table_kernel, staged_copy_kernel

ACCESS_BYTES = 16  # every page of every part is moved in whole accesses of this many bytes
_MAX_BLOCK_WORDS = 2048  # int32 words per program and iteration: 8 KiB, 4 16-byte accesses per thread
_KIND_CODE = {None: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2}


class PageGeometry(NamedTuple):
    page_size: int
    val_words: int  # int32 words of one page of k (= of v)
    val_check: int  # the kernel's VAL_CHECK: 0 E2M1 codes, 1 E4M3, 2 bf16
    sf_words: int  # int32 words of one page of k_sf (= of v_sf); 0 without block scales


def page_geometry(src: Sequence[torch.Tensor | None], dst: Sequence[torch.Tensor | None]) -> PageGeometry:
    """What the kernel relies on, checked: parts (k, k_sf, v, v_sf) contiguous ``[P, S, Hk, X]`` tensors on one
    device (CUDA; the CPU only under Triton's interpreter), each source part shaped and typed like its
    destination page for page, k like v, scales both present (E4M3, nvfp4) or both absent, every page part a
    multiple of 16 bytes (whole 16-byte accesses)."""
    k, k_sf, v, v_sf = dst
    if k is None or v is None or k.shape[1:] != v.shape[1:] or k.dtype != v.dtype:
        raise ValueError("page copy needs destination k and v of one shape and dtype, "
                         f"got {None if k is None else (tuple(k.shape), k.dtype)} / "
                         f"{None if v is None else (tuple(v.shape), v.dtype)}")
    if (k_sf is None) != (v_sf is None) or (k_sf is not None and (
            k_sf.shape[1:] != v_sf.shape[1:] or k_sf.dtype != torch.float8_e4m3fn or k.dtype != torch.uint8)):
        raise ValueError("page copy needs both block-scale parts (float8_e4m3fn, beside uint8 codes) or neither")
    for name, s, d in zip(("k", "k_sf", "v", "v_sf"), src, dst, strict=True):
        if d is None:
            continue
        if s is None or s.dtype != d.dtype or s.shape[1:] != d.shape[1:]:
            raise ValueError(f"source part {name} {None if s is None else (tuple(s.shape), s.dtype)} does not hold "
                             f"pages of the destination's {(tuple(d.shape[1:]), d.dtype)}")
        for t in (s, d):
            if t.dim() != 4 or not t.is_contiguous() or t.device != k.device:
                raise ValueError(f"page copy part {name} must be a contiguous [P, S, Hk, X] tensor on {k.device}, "
                                 f"got {tuple(t.shape)} strides {t.stride()} on {t.device}")
        nbytes = math.prod(d.shape[1:]) * d.element_size()
        if nbytes % ACCESS_BYTES:
            raise ValueError(f"page copy moves {ACCESS_BYTES}-byte words: a page of part {name} has {nbytes} bytes "
                             f"(shape {tuple(d.shape[1:])}); use the reference copy for this pool shape")
    words = [0 if t is None else math.prod(t.shape[1:]) * t.element_size() // 4 for t in (k, k_sf)]
    return PageGeometry(k.shape[1], words[0], _KIND_CODE[check_kind(k)], words[1])


def copy_pages(src: Sequence[torch.Tensor | None], dst: Sequence[torch.Tensor | None], src_ids: torch.Tensor,
               dst_ids: torch.Tensor, num_tokens: int, flag: torch.Tensor, copy: bool = True) -> None:
    """``dst[p][dst_ids[i]] = src[p][src_ids[i]]`` for every present part p of (k, k_sf, v, v_sf), and
    ``flag |= NaN/inf among the first num_tokens token slots`` (``nvfp4_kernels.page_copy``), in one launch on the
    current stream. Without ``copy`` only ``src``'s pages are checked (pass the pool's parts as both).

    ids: 1-D int32/int64 on the parts' device, each < its pool's pages (the caller checks peers' ids: the
    kernel does not); flag: int32, one element, on the device. MUTATES ``dst`` (with ``copy``) and ``flag``."""
    g = page_geometry(src, dst)
    n = _check_ids(src_ids, dst_ids, flag, dst[0].device)
    if n == 0:
        return
    ks, kss, vs, vss, kd, ksd, vd, vsd = [dst[0] if t is None else t for t in (*src, *dst)]  # absent: never read
    page_copy_kernel[(n, 4 if g.sf_words else 2)](
        ks, kd, vs, vd, kss, ksd, vss, vsd, src_ids, dst_ids, flag, int(num_tokens), PAGE_SIZE=g.page_size,
        VAL_WORDS=g.val_words, VAL_BLOCK=_block(g.val_words), VAL_CHECK=g.val_check, SF_WORDS=g.sf_words,
        SF_BLOCK=_block(g.sf_words), COPY=copy, num_warps=4)


def copy_staged_pages(staged: torch.Tensor, offsets: Sequence[int], num_pages: int, dst: Sequence[torch.Tensor | None],
                      geometry: PageGeometry, num_tokens: int, flag: torch.Tensor) -> None:
    """``copy_pages`` of ``num_pages`` pages from one staged buffer: ``staged`` (1-D uint8 on the parts' device)
    holds the destination page ids as int64 at its start, and part p's pages consecutively from byte
    ``offsets[p]`` (a multiple of 16; ignored for an absent part). ``geometry``: ``page_geometry(dst, dst)``,
    computed once by the caller. One launch, no tensor made on the host: a received message's write costs its
    copy to the device and this launch. MUTATES ``dst`` and ``flag``."""
    if staged.dim() != 1 or staged.dtype != torch.uint8 or staged.device != dst[0].device:
        raise ValueError(f"a staged buffer is 1-D uint8 on {dst[0].device}, got {tuple(staged.shape)} "
                         f"{staged.dtype} on {staged.device}")
    if num_pages <= 0:
        return
    if staged.data_ptr() % ACCESS_BYTES or 8 * num_pages > staged.numel():
        raise ValueError(f"a staged buffer starts at a multiple of {ACCESS_BYTES} bytes with {num_pages} ids")
    words = (geometry.val_words, geometry.sf_words, geometry.val_words, geometry.sf_words)
    at = []
    for name, t, off, w in zip(("k", "k_sf", "v", "v_sf"), dst, offsets, words, strict=True):
        if t is None:
            at.append(0)
            continue
        if off % ACCESS_BYTES or off < 8 * num_pages or off + num_pages * 4 * w > staged.numel():
            raise ValueError(f"staged part {name} at byte {off} ({num_pages} pages of {4 * w} bytes) is not a "
                             f"multiple of {ACCESS_BYTES} past the ids inside the {staged.numel()}-byte buffer")
        at.append(off)
    g = geometry
    k, k_sf, v, v_sf = [dst[0] if t is None else t for t in dst]  # absent: never read
    staged_copy_kernel[(num_pages, 4 if g.sf_words else 2)](
        staged, k, v, k_sf, v_sf, flag, int(num_tokens), at[0], at[2], at[1], at[3], PAGE_SIZE=g.page_size,
        VAL_WORDS=g.val_words, VAL_BLOCK=_block(g.val_words), VAL_CHECK=g.val_check, SF_WORDS=g.sf_words,
        SF_BLOCK=_block(g.sf_words), num_warps=4)


class PartTable(NamedTuple):
    """The parts of one size and kind of several layers: (source, destination) base addresses per part on the
    device (int64 [n, 2]), words per page, check kind (0: E2M1 codes, not checked)."""

    addresses: torch.Tensor
    words: int
    check: int


class PageTables(NamedTuple):
    """What ``move_pages`` launches over: the values of every layer, then their block scales (nvfp4)."""

    page_size: int
    groups: tuple[PartTable, ...]


def page_tables(src_layers: Sequence[Sequence[torch.Tensor | None]],
                dst_layers: Sequence[Sequence[torch.Tensor | None]]) -> PageTables:
    """The tables of layer pairs (parts k, k_sf, v, v_sf of each), each pair checked as ``page_geometry`` checks
    one layer's, every pair of one geometry on one device (pass the same layers twice to check in place). The
    tables address the parts' memory: keep the tensors alive while they are used."""
    if not src_layers or len(src_layers) != len(dst_layers):
        raise ValueError(f"page tables need as many source as destination layers (>= 1): {len(src_layers)} "
                         f"and {len(dst_layers)}")
    g = page_geometry(src_layers[0], dst_layers[0])
    device = dst_layers[0][0].device
    for src, dst in zip(src_layers, dst_layers, strict=True):
        if page_geometry(src, dst) != g or dst[0].device != device:
            raise ValueError("page tables need every layer of one page geometry on one device")
    groups = [((0, 2), g.val_words, g.val_check)] + ([((1, 3), g.sf_words, 1)] if g.sf_words else [])
    out = []
    for parts, words, check in groups:
        rows = [[src[p].data_ptr(), dst[p].data_ptr()] for src, dst in zip(src_layers, dst_layers, strict=True)
                for p in parts]
        out.append(PartTable(torch.tensor(rows, dtype=torch.int64).to(device), words, check))
    return PageTables(g.page_size, tuple(out))


def move_pages(tables: PageTables, src_ids: torch.Tensor, dst_ids: torch.Tensor, num_tokens: int,
               flag: torch.Tensor, copy: bool = True) -> None:
    """``copy_pages`` for every layer pair of ``tables`` at once: one launch per kind of part on the current
    stream (without ``copy`` only the source pages are checked, and parts that cannot be NaN are skipped).
    ids: 1-D int32/int64 on the parts' device, each < its pool's pages (the caller checks peers' ids: the
    kernel does not). MUTATES the destinations (with ``copy``) and ``flag``."""
    n = _check_ids(src_ids, dst_ids, flag, tables.groups[0].addresses.device)
    if n == 0:
        return
    for group in tables.groups:
        if copy or group.check:
            page_table_kernel[(n, group.addresses.shape[0])](
                group.addresses, src_ids, dst_ids, flag, int(num_tokens), PAGE_SIZE=tables.page_size,
                WORDS=group.words, BLOCK=_block(group.words), CHECK=group.check, COPY=copy, num_warps=4)


def _check_ids(src_ids: torch.Tensor, dst_ids: torch.Tensor, flag: torch.Tensor, device: torch.device) -> int:
    """The number of ids; ValueError unless both id tensors are 1-D int32/int64 of that length on ``device``
    and ``flag`` is one int32 there."""
    n = src_ids.numel()
    for name, t in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        if t.dim() != 1 or t.numel() != n or t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise ValueError(f"{name} must be 1-D int32/int64 on {device} with {n} ids, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if flag.dtype != torch.int32 or flag.numel() != 1 or flag.device != device:
        raise ValueError(f"flag must be one int32 on {device}, got {tuple(flag.shape)} {flag.dtype}")
    return n


def _block(words: int) -> int:
    return min(triton.next_power_of_2(max(words, 1)), _MAX_BLOCK_WORDS)
