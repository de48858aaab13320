"""Page bytes into the decode's pool, off the engine thread (the prefill's side is ``svc_common/page_export.py``):
``PageImporter``, one per pull.

    grpc:     a message into up to 4 runs of consecutive pages (a fresh request's mostly are) --one numpy copy-->
              pinned staging --one H2D copy per part and run on a side stream (copy engine only, no kernel)-->
              the request's pages; ``finish`` checks the scales (and fp8/bf16 values) of the whole transfer in
              one launch per kind of part. Scattered pages: the destination ids and the message's bytes (parts
              aligned by the sender) --two numpy copies--> pinned staging --one H2D copy, one page-copy launch
              (every part, read where it lies in the message; checked in the same launch)--> the pages; a
              message with unaligned parts is staged part by part. Nothing is scanned on the host.
    cuda-ipc: the prefill's pages --one page-copy kernel per layer (every part, values checked in the same
              pass; nvfp4_kernels/page_copy_triton.py)--> the request's pages
    nixl:     NIXL's READ writes the request's pages (kv_transfer_nixl.py); ``finish`` checks them all
              (check_at_finish: the same kernel, check only, one launch per kind of part for the transfer)

Writes use the importer's own CUDA stream, so a transfer never waits behind the engine's next chunk or decode
step, and never holds the engine thread. The invariant: ``finish`` returns only after every write it issued is
complete, so the caller may free the pages (abort) or hand them to the engine right after. Pages written here
are the request's own (allocated to it, not yet visible to any other request).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.kv_pool import KVPool
from nvfp4_kernels.page_copy import check_kind, copy_pages_reference, move_pages_reference
from svc_common.kv_transfer_ipc import page_runs
from svc_common.kv_wire import PageRunView
from svc_common.pool_parts import (
    MAX_COPY_RUNS,
    PARTS,
    SummedTimes,
    device_ids,
    on_stream,
    part_page_bytes,
    pool_parts,
    side_stream,
)

_ALIGN = 64  # staged parts start at multiples of this (the page copy's 16-byte accesses, dtype views)
_ACCESS = 16  # nvfp4_kernels.page_copy_triton.ACCESS_BYTES (imported there only with triton)


class PageTableCache:
    """``move_pages``' tables by (destination layers, source part addresses), shared by the pulls into one pool:
    building one checks the geometry of every layer and copies the table to the device (a host sync), which
    each transfer would otherwise pay again on its first batch. Addresses identify a table: a source is this
    pool or another pool of its layout (the transfer's handshake checked it), and the table holds nothing but
    those addresses. A table may outlive a closed source (a prefill's view): it is looked up only by the live
    tensors of a batch, so it is used only while memory of that layout is mapped at its addresses. Bounded;
    the least recently used goes first. Thread-safe (pulls write on several threads)."""

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"a page table cache holds >= 1 tables, got {capacity}")
        self.capacity = capacity
        self._tables: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.built = 0  # tables built (the rest of the lookups were hits)

    def get(self, key: tuple, build: Callable[[], object]) -> object:
        with self._lock:
            if key in self._tables:
                self._tables.move_to_end(key)
                return self._tables[key]
        table = build()
        with self._lock:
            self.built += 1
            self._tables[key] = table
            self._tables.move_to_end(key)
            while len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        return table


class WriteTimes(SummedTimes):
    """A transfer's message writes (decode side): staging the bytes into pinned memory (allocation, id and part
    copies), waiting for the importer's lock, and under it (the H2D copy and the page-copy launch)."""

    STEPS = ("stage_s", "lock_wait_s", "launch_s")
    UNIT = "writes"
    LABELS = ("staging", "waiting for the lock", "copying and launching")

    @property
    def writes(self) -> int:
        return self.count


class PageImporter:
    """One transfer's writes into the decode's pool (create one per pull). Message writes into a few runs of
    consecutive pages are plain slice copies (a fresh request's pages mostly are consecutive) checked once by
    ``finish``, scattered ones one page-copy launch per message; copies from another pool one page-copy launch
    per layer (``copy_from``) or one per kind of part for every layer of a run of pages (``copy_from_layers``) on
    a GPU, ``nvfp4_kernels.page_copy`` on the CPU."""

    def __init__(self, pool: KVPool, tables: PageTableCache | None = None):
        self.pool = pool
        self.stream = side_stream(pool.device)
        self.page_bytes = part_page_bytes(pool)
        self._lock = threading.Lock()  # one write at a time (writes of one transfer come from several threads)
        self._last_ids: tuple | None = None  # (src ids, dst ids, their device tensors): see _indices
        self._bad: torch.Tensor | None = None  # device int32 flag: a written value or scale is NaN/inf
        self._arange: torch.Tensor | None = None  # see _first_ids
        self._copy_pages = copy_pages_reference
        self._copy_staged = None  # copy_staged_pages: a message copied to the device whole, one launch
        self._geometry = None  # page_geometry of this pool (the staged copy's launch)
        self._batched = False  # move_pages: one launch per kind of part for every layer of a batch
        self._tables = tables if tables is not None else PageTableCache()  # (layers, source addresses) -> their PageTables
        self.times = WriteTimes()  # the message writes' (``write``)
        # run copies (``_write_runs``) and NIXL's reads (``check_at_finish``): written pages whose values ``finish``
        # checks, (layer, page ids, tokens)
        self._run_copies = True
        self._unchecked: list[tuple[int, tuple[int, ...], int]] = []
        if pool.device.type == "cuda":  # triton: a GPU install's
            from nvfp4_kernels.page_copy_triton import ACCESS_BYTES, copy_pages
            if all(b % ACCESS_BYTES == 0 for b in self.page_bytes):  # else (tiny pages x heads) the reference
                self._copy_pages = copy_pages
                self._batched = True
                self.use_staged_copy()
        # What each part's values are checked as (nvfp4_kernels.page_copy.check_kind: E4M3, bf16 or not at all)
        self._kinds = [None if t is None else check_kind(t) for t in pool_parts(pool, 0)]

    def check_sizes(self, run: PageRunView) -> None:
        """ValueError unless every part of ``run`` is exactly ``run.num_pages`` pages of this pool."""
        for name, mv, page in zip(PARTS, run.parts, self.page_bytes, strict=True):
            if mv.nbytes != run.num_pages * page:
                raise ValueError(f"part {name} of layer {run.layer} has {mv.nbytes} bytes, {run.num_pages} "
                                 f"{self.pool.kv_dtype} pages need {run.num_pages * page}")

    def use_staged_copy(self) -> None:
        """Write messages whose parts lie 16-byte aligned (``kv_wire.PART_ALIGN``) with ``copy_staged_pages``: the
        whole message in one copy to pinned memory, one to the device, one launch. On by default on a GPU (the
        Triton interpreter's tests turn it on for CPU pools)."""
        from nvfp4_kernels.page_copy_triton import copy_staged_pages, page_geometry
        parts = pool_parts(self.pool, 0)
        self._geometry = page_geometry(parts, parts)
        self._copy_staged = copy_staged_pages

    def use_run_copies(self, on: bool = True) -> None:
        """Write messages into a few runs of consecutive pages with plain copies, their check left to ``finish``
        (``_write_runs``). On by default; off, every message is one page-copy launch (tests compare the two)."""
        self._run_copies = on

    def write(self, run: PageRunView, page_ids: Sequence[int], num_tokens: int) -> None:
        """MUTATES the pool: ``run``'s bytes into pages ``page_ids`` of ``run.layer``, of which the first
        ``num_tokens`` token slots hold the prompt (checked: sizes here, values on the pool's device, reported
        by ``finish``; the rest of a last, partial page is never read). Blocks until the host bytes are copied
        (call on a worker thread); device writes complete by ``finish``.

        The destination ids and each part are copied (numpy, off the GIL) into one staging buffer at aligned
        offsets (pinned on a GPU), outside the lock, so two writes stage at once; then, under it, one H2D copy
        and one page-copy launch for every part with the values' check (``copy_pages``, as ``copy_from``). A
        write thus waits for the GIL a handful of times, not once per torch op: on a transfer the gRPC reader
        holds it for every received byte, and each wait is a switch interval (docs/benchmarks/transfer_spy.md).
        No scan of the bytes on the host."""
        self.check_sizes(run)
        n = len(page_ids)
        if n == 0:
            return
        if n != run.num_pages:
            raise ValueError(f"{n} destination pages for a run of {run.num_pages}")
        dst = pool_parts(self.pool, run.layer)
        if self._run_copies and len(run.spans) == len(self.page_bytes):
            runs = page_runs(list(range(n)), [int(p) for p in page_ids])  # (position, pool page, length)
            if len(runs) <= MAX_COPY_RUNS:
                self._write_runs(run, runs, num_tokens, dst)
                return
        if self._copy_staged is not None and _lies_aligned(run, self.page_bytes):
            self._write_whole(run, page_ids, num_tokens, dst)
            return
        t0 = time.perf_counter()
        offsets, total = _staging_offsets(8 * n, [mv.nbytes for mv in run.parts])
        staged = torch.empty(total, dtype=torch.uint8, pin_memory=self.stream is not None)
        host = staged.numpy()
        host[:8 * n].view(np.int64)[:] = page_ids
        for mv, at, t in zip(run.parts, offsets, dst, strict=True):
            if t is not None:
                host[at:at + mv.nbytes] = np.frombuffer(mv, dtype=np.uint8)
        t1 = time.perf_counter()
        with self._lock, on_stream(self.stream):
            t2 = time.perf_counter()
            dev = staged.to(self.pool.device, non_blocking=True) if self.stream is not None else staged
            src = [None if t is None else dev[at:at + mv.nbytes].view(t.dtype).view(n, *t.shape[1:])
                   for mv, at, t in zip(run.parts, offsets, dst, strict=True)]
            self._copy_pages(src, dst, self._first_ids(n), dev[:8 * n].view(torch.int64), num_tokens, self._flag())
        self.times.add(t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _write_whole(self, run: PageRunView, page_ids: Sequence[int], num_tokens: int,
                     dst: list[torch.Tensor | None]) -> None:
        """``write`` of a message whose parts lie aligned in it: the destination ids, then the whole message, in
        one staging buffer (two numpy copies), then one copy to the device and one launch under the lock. Four
        waits for the GIL in all, where the part-by-part staging takes two dozen (each torch op releases it,
        and winning it back behind the gRPC reader costs up to a switch interval)."""
        n = len(page_ids)
        t0 = time.perf_counter()
        head = _aligned(8 * n)
        staged = torch.empty(head + len(run.data), dtype=torch.uint8, pin_memory=self.stream is not None)
        host = staged.numpy()
        host[:8 * n].view(np.int64)[:] = page_ids
        host[head:] = np.frombuffer(run.data, dtype=np.uint8)
        t1 = time.perf_counter()
        with self._lock, on_stream(self.stream):
            t2 = time.perf_counter()
            dev = staged.to(self.pool.device, non_blocking=True) if self.stream is not None else staged
            self._copy_staged(dev, [head + a for a, _ in run.spans], n, dst, self._geometry, num_tokens,
                              self._flag())
        self.times.add(t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _write_runs(self, run: PageRunView, runs: Sequence[tuple[int, int, int]], num_tokens: int,
                    dst: list[torch.Tensor | None]) -> None:
        """``write`` of a message into at most ``MAX_COPY_RUNS`` runs (position, pool page, length) of consecutive
        pages: the message staged whole (one numpy copy; pinned on a GPU), then under the lock one copy per part and
        run straight into the pool. On a GPU that is copy-engine work only: no kernel in this process's CUDA
        context, which the GPU time-slices with a prefill's when both share it (a kernel per message took the GPU
        from the prefill's chunks once per message). The values' check waits for ``finish``: one check for the
        whole transfer."""
        t0 = time.perf_counter()
        staged = torch.empty(len(run.data), dtype=torch.uint8, pin_memory=self.stream is not None)
        staged.numpy()[:] = np.frombuffer(run.data, dtype=np.uint8)
        t1 = time.perf_counter()
        with self._lock, on_stream(self.stream):
            t2 = time.perf_counter()
            for (at, _), page, t in zip(run.spans, self.page_bytes, dst, strict=True):
                if t is None:
                    continue
                rows = t.view(torch.uint8).view(t.shape[0], -1)
                for p0, d0, m in runs:
                    rows[d0:d0 + m].copy_(staged[at + p0 * page:at + (p0 + m) * page].view(m, page),
                                          non_blocking=True)
            self._defer([run.layer], tuple(d0 + i for _, d0, m in runs for i in range(m)), num_tokens)
        self.times.add(t1 - t0, t2 - t1, time.perf_counter() - t2)

    def check_at_finish(self, layers: Sequence[int], page_ids: Sequence[int], num_tokens: int) -> None:
        """``check_written`` left to ``finish``, for pages of ``layers`` that another agent wrote (nixl: NIXL's
        READs, complete before this call): joined there with every other deferred check, so a transfer's pages
        are checked in one launch per kind of part, not one per batch of reads (each launch costs the writer
        thread about a millisecond of host work while the transfer runs)."""
        with self._lock:  # the reads of one transfer return on several writer threads
            self._defer(layers, tuple(int(p) for p in page_ids), num_tokens)

    def _defer(self, layers: Sequence[int], ids: tuple[int, ...], num_tokens: int) -> None:
        """Leave the check of pages ``ids`` of ``layers`` to ``finish`` (``_check_deferred``; hold the lock)."""
        self._unchecked.extend((layer, ids, num_tokens) for layer in layers)

    def _check_deferred(self) -> None:
        """Queue the checks of every page written by ``_write_runs`` or named by ``check_at_finish``
        (``check_written``): the pages of the layers that share a page set in one check. A transfer's full pages
        and its one partial page (the prompt's last) of the same layers join into one list, so a whole transfer
        is one check (one launch per kind of part)."""
        if not self._unchecked:
            return
        by_pages: dict[tuple[tuple[int, ...], int], list[int]] = collections.defaultdict(list)
        for layer, ids, tokens in self._unchecked:
            by_pages[(ids, tokens)].append(layer)
        self._unchecked = []
        by_layers: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = collections.defaultdict(list)
        for (ids, tokens), layers in by_pages.items():
            by_layers[tuple(sorted(set(layers)))].append((ids, tokens))
        ps = self.pool.page_size
        for layers, segments in by_layers.items():
            full = [(ids, t) for ids, t in segments if t == len(ids) * ps]
            partial = [(ids, t) for ids, t in segments if t != len(ids) * ps]
            if len(partial) > 1:  # only the prompt's last page is partial; several: check each on its own
                for ids, t in segments:
                    self.check_written(layers, ids, t)
                continue
            ordered = full + partial  # the partial page last: the first ``tokens`` slots of the joined list
            self.check_written(layers, [p for ids, _ in ordered for p in ids], sum(t for _, t in ordered))

    def _first_ids(self, n: int) -> torch.Tensor:
        """0..n-1 on the pool's device (the rows of a staged message), made once per size bound (under the lock)."""
        if self._arange is None or self._arange.numel() < n:
            self._arange = torch.arange(max(n, 256), dtype=torch.int64, device=self.pool.device)
        return self._arange[:n]

    def copy_from(self, src_parts: Sequence[torch.Tensor | None], layer: int, src_ids: Sequence[int],
                  page_ids: Sequence[int], num_tokens: int) -> None:
        """MUTATES the pool: pages ``src_ids`` of another pool's layer tensors (cuda-ipc: the prefill's, opened
        here; the caller checked the ids against it) into pages ``page_ids`` of ``layer``, every part in one
        page-copy launch on a GPU; the values of the first ``num_tokens`` token slots checked in the same pass."""
        if len(page_ids) == 0:
            return
        src_ids, dst_ids = list(src_ids), list(page_ids)  # copies (the cache keeps them); int() each: 0.1 ms
        with self._lock, on_stream(self.stream):
            s_idx, d_idx = self._indices(src_ids, dst_ids)
            self._copy_pages(src_parts, pool_parts(self.pool, layer), s_idx, d_idx, num_tokens, self._flag())

    def _indices(self, src_ids: list[int], dst_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device source and destination ids: made once for the pages of a chunk, which every layer's
        message names again (call on the side stream: the copies that use them are ordered after)."""
        if self._last_ids is not None and self._last_ids[0] == src_ids and self._last_ids[1] == dst_ids:
            return self._last_ids[2]
        dev = self.pool.device
        s_idx = device_ids(src_ids, dev)
        made = (s_idx, s_idx if dst_ids == src_ids else device_ids(dst_ids, dev))
        self._last_ids = (src_ids, dst_ids, made)
        return made

    def copy_from_layers(self, src_layers: Sequence[Sequence[torch.Tensor | None]], layers: Sequence[int],
                         src_ids: Sequence[int], page_ids: Sequence[int], num_tokens: int) -> None:
        """``copy_from`` for the same pages of several layers (``src_layers[i]``: the parts of ``layers[i]`` in
        another pool; the caller checked the ids against it): on a GPU one launch per kind of part for all of
        them (``nvfp4_kernels.page_copy_triton.move_pages``), else the reference per layer."""
        self._move(src_layers, layers, src_ids, page_ids, num_tokens, copy=True)

    def check_written(self, layers: Sequence[int], page_ids: Sequence[int], num_tokens: int) -> None:
        """The checks ``copy_from`` makes, for pages ``page_ids`` of each of ``layers`` that another agent wrote
        into the pool (nixl: NIXL's READ, complete before this call): the values of the first ``num_tokens``
        token slots flagged on the device (``finish`` raises). Reads only; launches as ``copy_from_layers``."""
        self._move(None, layers, page_ids, page_ids, num_tokens, copy=False)

    def _move(self, src_layers: Sequence[Sequence[torch.Tensor | None]] | None, layers: Sequence[int],
              src_ids: Sequence[int], page_ids: Sequence[int], num_tokens: int, copy: bool) -> None:
        if len(page_ids) == 0 or len(layers) == 0:
            return
        dst_layers = [pool_parts(self.pool, i) for i in layers]
        srcs = dst_layers if src_layers is None else [list(p) for p in src_layers]
        src, dst = list(src_ids), list(page_ids)
        with self._lock, on_stream(self.stream):
            s_idx, d_idx = self._indices(src, dst)
            if not self._batched:
                move_pages_reference(srcs, dst_layers, s_idx, d_idx, num_tokens, self._flag(), copy)
                return
            from nvfp4_kernels.page_copy_triton import move_pages, page_tables
            key = (tuple(layers), tuple(t.data_ptr() for parts in srcs for t in parts if t is not None))
            tables = self._tables.get(key, lambda: page_tables(srcs, dst_layers))
            move_pages(tables, s_idx, d_idx, num_tokens, self._flag(), copy)

    def _flag(self) -> torch.Tensor:
        """The device int32 flag the checks OR into (made on first use, on the side stream; no sync)."""
        if self._bad is None:
            self._bad = torch.zeros(1, dtype=torch.int32, device=self.pool.device)
        return self._bad

    def settle(self) -> None:
        """Block until every write issued is complete (the pages may be freed next); no checks."""
        if self.stream is not None:
            self.stream.synchronize()

    def finish(self) -> None:
        """Block until every write issued is complete; ValueError if any written scale or value was NaN/inf
        (the caller fails the transfer and frees the pages)."""
        self._check_deferred()
        self.settle()
        if self._bad is not None and bool(self._bad.item()):
            raise ValueError("the pages carry NaN or inf scales or values")


def _lies_aligned(run: PageRunView, page_bytes: Sequence[int]) -> bool:
    """Whether every present part of ``run`` starts at a multiple of ``_ACCESS`` bytes of its message (a sender that
    aligns its parts, ``kv_wire.PART_ALIGN``; the spans are known: decoded here, not built by hand)."""
    return len(run.spans) == len(page_bytes) and all(
        a % _ACCESS == 0 for (a, _), page in zip(run.spans, page_bytes, strict=True) if page)


def _staging_offsets(head: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of parts of ``sizes`` bytes after ``head`` bytes, each at a multiple of ``_ALIGN``; the total."""
    offsets, at = [], _aligned(head)
    for size in sizes:
        offsets.append(at)
        at = _aligned(at + size)
    return offsets, max(at, 1)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
