"""Decode forwards on fixed buffers, captured as CUDA graphs: one per (batch bucket, page-table width bucket).

A decode step of B requests with page tables of at most W pages runs the entry of the smallest buckets
Bp >= B, Wp >= W. Rows [B, Bp) are padding: token 0 at position 0 with a one-token sequence on the pool's
scratch page, so they write and read only that page (never a page the allocator hands out); their logits
are dropped. Table entries past a row's pages also name the scratch page (kernels never read them).

Per step the host fills pinned staging arrays, copies them into the entry's device buffers, lets the
backend refresh host-side plans (FlashInfer's fp8/bf16 decode plans its CSR here; the Triton NVFP4
decode reads lengths and pages from device memory and needs nothing), and replays the graph. Input ids the
previous step sampled and the host has not read yet (overlap scheduling, ``engine.carried_tokens``) are
filled in on the device after the copies. The staging arrays are reused every step: a step waits for the
last step's copies out of them (an event, complete long before in practice: they were queued ahead of the
whole previous forward) before it writes them, so a step staged while the last one still runs never
overwrites what that one has yet to read.

Width buckets are 4 per octave (a table is padded by at most ~19%), so the NVFP4 kernel's split-KV
geometry, which is baked into a graph from the bucket width, stays close to the batch's real length.
Entries are captured lazily at first use and share one CUDA graph memory pool: the logits of an entry
are valid until the next replay of any entry. A capture runs while other threads of the process keep using
the GPU (the decode service's KV transfer threads copy pages on their own streams, and UCX syncs its streams
for NIXL), so captures are thread-local: only the capturing thread is barred from CUDA calls that a capture
forbids. A capture that fails anyway turns capture off for good (torch leaves the pool recording after a
failed capture, so a second one could not start): that entry and every later one run eagerly, with one error
logged; serving goes on, slower. Every shape runs once at start-up (``warm_kernels``), so a
capture never JIT-compiles: the NVFP4 decode compiles once (nothing a plan derives from the shape is
specialized) and its merge once per split tile size, and the rest only launch.

``capture=False`` runs the same fixed-buffer path eagerly (CPU, or CUDA with graphs disabled for
debugging); tests check it against the plain decode path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from engine.attention_paths import AttentionPaths
from engine.carried_tokens import CarriedTokens
from engine.model import CausalLM
from nvfp4_kernels.backends.base import DecodePlan

log = logging.getLogger(__name__)
T = TypeVar("T")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which is always the last bucket)."""
    if max_batch < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_batch}")
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*out, max_batch]


def width_bucket(pages: int, max_width: int, min_width: int = 16) -> int:
    """Smallest width >= ``pages`` of the form k * 2**(e-2), k in 4..7 (4 per octave), capped at max_width."""
    w = max(pages, min_width)
    step = 1 << max(0, w.bit_length() - 3)
    return min(max_width, -(-w // step) * step)


def width_buckets(max_width: int, min_width: int = 16) -> list[int]:
    """Every value ``width_bucket`` can return for tables of 1..max_width pages, ascending."""
    out = [width_bucket(1, max_width, min_width)]
    while out[-1] < max_width:
        out.append(width_bucket(out[-1] + 1, max_width, min_width))
    return out


@dataclass
class _Entry:
    batch: int
    width: int
    page_table: torch.Tensor  # [batch, width] int32, device
    plan: DecodePlan
    run: Callable[[], torch.Tensor]  # replays (or runs) the forward; returns logits [batch, vocab] fp32


class DecodeGraphRunner:
    """Fixed-buffer decode for batches up to ``max_batch`` rows and ``max_width`` pages per row."""

    def __init__(self, model: CausalLM, paths: AttentionPaths, device: torch.device, max_batch: int,
                 max_width: int, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use capture=False elsewhere")
        if max_width < 1:
            raise ValueError(f"max_width must be >= 1 page, got {max_width}")
        self.model, self.paths, self.device = model, paths, device
        self.buckets = batch_buckets(max_batch)
        self.max_batch, self.max_width = max_batch, max_width
        self.capture = capture
        pool = paths.pool
        self.scratch_page = pool.scratch_page
        self.page_size = pool.page_size
        pin = device.type == "cuda"
        # Device inputs shared by every entry (an entry reads rows [:batch]); host staging is pinned so the
        # copies are asynchronous. Invariant: between steps the device rows hold padding or a past step's
        # values, and every replay first overwrites rows [:batch] of its entry.
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.out_slots = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._h_ids = torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin)
        self._h_pos = torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin)
        self._h_lens = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self._h_slots = torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin)
        self._h_table_flat = torch.zeros(max_batch * max_width, dtype=torch.int32, pin_memory=pin)
        self.carry_rows = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self._h_carry = torch.full((max_batch,), -1, dtype=torch.int64, pin_memory=pin)
        # recorded behind each step's copies out of the pinned arrays above (and the backend's plan copies)
        self._staged = torch.cuda.Event() if pin else None
        # What each row of the host table holds while steps stay on one entry and their rows only grow
        # (``run(..., append_only=True)``): (the array whose prefix the row copied, entries copied); None rows are
        # all scratch. ``_rows_key`` names the entry they were written for (None: refill the next step).
        self._rows_key: tuple[int, int] | None = None
        self._rows_held: list[tuple[np.ndarray | None, int]] = []
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_captured = 0
        self.capture_error = ""  # why capture was turned off (see the module docstring), or ""

    # -- public ------------------------------------------------------------------------------------
    def supports(self, batch: int, width: int) -> bool:
        return 1 <= batch <= self.max_batch and 1 <= width <= self.max_width

    def run(self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[np.ndarray],
            seq_lens: Sequence[int], out_slots: Sequence[int], append_only: bool = False,
            carry: CarriedTokens | None = None) -> torch.Tensor:
        """Logits [B, vocab] fp32 of one decode step; ``tables[i]`` is row i's page ids (int32). ``carry``: rows whose
        input id is the previous step's sampled id on the device (their ``token_ids`` entry is a placeholder).

        ``append_only``: the caller promises that a table which is a view of the same array as in an earlier step
        only grew (its first entries unchanged), as ``model_runner.PageTableRows`` hands them out. The host page
        table then gets only each row's new entries, not a refill of every row: host work during which the GPU
        waits (``python -m benchmarks.engine.bench_host_staging``, docs/benchmarks/host_staging.md)."""
        b = len(token_ids)
        width = max(len(t) for t in tables)
        if not self.supports(b, width):
            raise ValueError(f"decode batch {b} x {width} pages is beyond the fixed buffers "
                             f"({self.max_batch} x {self.max_width})")
        bb = next(x for x in self.buckets if x >= b)
        wb = width_bucket(width, self.max_width)
        entry = self._entries.get((bb, wb)) or self._build(bb, wb)
        self._stage(entry, token_ids, positions, tables, seq_lens, out_slots, append_only, carry)
        return entry.run()[:b]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch bucket, width bucket) an entry can have."""
        return [(b, w) for b in self.buckets for w in width_buckets(self.max_width)]

    def warm_kernels(self) -> int:
        """Compile the attention kernels for every entry shape now, so that no serving step waits for a
        first-use compile (see ``AttentionBackend.warm_decode``); returns the number of shapes the backend
        ran (0 when it compiles nothing per shape). Only the scratch page is read."""
        pool = self.paths.pool
        return self.paths.backend.warm_decode(pool.layers[0], self.shapes(), self.paths.num_qo_heads,
                                              self.model.dtype, self.paths.sm_scale, self.scratch_page)

    # -- internals ---------------------------------------------------------------------------------
    def _host_table(self, batch: int, width: int) -> np.ndarray:
        return self._h_table_flat[: batch * width].numpy().reshape(batch, width)

    def _stage(self, entry: _Entry, token_ids: Sequence[int], positions: Sequence[int],
               tables: Sequence[np.ndarray], seq_lens: Sequence[int], out_slots: Sequence[int],
               append_only: bool = False, carry: CarriedTokens | None = None) -> None:
        bb, wb, b = entry.batch, entry.width, len(token_ids)
        if self._staged is not None:
            self._staged.synchronize()  # the last step's copies out of the pinned arrays are done
        ids, pos, lens, slots = (t.numpy() for t in (self._h_ids, self._h_pos, self._h_lens, self._h_slots))
        ids[:b], pos[:b], lens[:b], slots[:b] = token_ids, positions, seq_lens, out_slots
        ids[b:bb], pos[b:bb], lens[b:bb] = 0, 0, 1
        slots[b:bb] = self.scratch_page * self.page_size
        table = self._host_table(bb, wb)
        if append_only and self._rows_key == (bb, wb):
            self._grow_rows(table, tables)
        else:
            table.fill(self.scratch_page)
            for i, row in enumerate(tables):
                table[i, : len(row)] = row
            self._rows_key = (bb, wb) if append_only else None
            self._rows_held = [(_array_of(r), len(r)) for r in tables] + [(None, 0)] * (bb - len(tables))
        nb = self.device.type == "cuda"
        self.input_ids[:bb].copy_(self._h_ids[:bb], non_blocking=nb)
        self.positions[:bb].copy_(self._h_pos[:bb], non_blocking=nb)
        self.seq_lens[:bb].copy_(self._h_lens[:bb], non_blocking=nb)
        self.out_slots[:bb].copy_(self._h_slots[:bb], non_blocking=nb)
        entry.page_table.copy_(self._h_table_flat[: bb * wb].view(bb, wb), non_blocking=nb)
        if carry is not None:
            self._h_carry[:b].numpy()[:] = carry.rows
            self.carry_rows[:b].copy_(self._h_carry[:b], non_blocking=nb)
            carry.fill(self.input_ids[:b], self.carry_rows[:b])
        self.paths.backend.refresh_decode_plan(entry.plan, table, lens[:bb])
        if self._staged is not None:
            self._staged.record()

    def _grow_rows(self, table: np.ndarray, tables: Sequence[np.ndarray]) -> None:
        """The host table of the last step's entry brought to ``tables`` (see ``run``'s append_only): a row that
        holds the same array gets its new entries; any other row is rewritten, scratch past its pages."""
        held = self._rows_held
        for i in range(len(held)):
            row = tables[i] if i < len(tables) else None
            arr, n = (None, 0) if row is None else (_array_of(row), len(row))
            was, n_was = held[i]
            if arr is not None and arr is was and n >= n_was:
                if n > n_was:
                    table[i, n_was:n] = row[n_was:]
            else:
                if n:
                    table[i, :n] = row
                if n_was > n:
                    table[i, n:n_was] = self.scratch_page
            held[i] = (arr, n)

    def _build(self, bb: int, wb: int) -> _Entry:
        table = torch.full((bb, wb), self.scratch_page, dtype=torch.int32, device=self.device)
        plan = self.paths.plan_decode(table, self.seq_lens[:bb], self.model.dtype, static=True)
        attn = self.paths.decode_attn(plan, self.out_slots[:bb])
        ids, pos = self.input_ids[:bb], self.positions[:bb]

        def forward() -> torch.Tensor:
            return self.model.compute_logits(self.model(ids, pos, attn))

        entry = _Entry(bb, wb, table, plan, forward)
        if self.capture:
            # Capture on padding only: a warm-up over real rows would write K/V into real pages.
            pad = [0] * bb
            self._stage(entry, pad, pad, [np.zeros(0, dtype=np.int32)] * bb, [1] * bb,
                        [self.scratch_page * self.page_size] * bb)
            try:
                entry.run = capture_graph(forward, self.device, self._graph_pool)
                self.num_captured += 1
            except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError
                self.capture = False
                self.capture_error = f"{type(e).__name__}: {e}"
                log.error("CUDA graph capture of decode batch %d x %d pages failed (%s); decode steps run "
                          "without graphs from now on", bb, wb, self.capture_error)
                torch.cuda.synchronize(self.device)
        self._entries[(bb, wb)] = entry
        return entry


def _array_of(row: np.ndarray) -> np.ndarray:
    """The array a table row is a view of (the row itself when it owns its data)."""
    return row if row.base is None else row.base


def capture_graph(forward: Callable[[], T], device: torch.device, pool: object = None) -> Callable[[], T]:
    """``forward`` captured as a CUDA graph on ``device``; returns its replay, which returns what the capture's
    ``forward`` returned (tensors in the graph's memory, rewritten by each replay). One run on a side stream comes
    first, so kernels JIT-compile and device constants are cached outside the capture. ``pool``: a graph memory
    pool handle shared with other graphs (None: the graph's own). The capture is thread-local (see the module
    docstring); a failed one raises RuntimeError with the caller's stream current again."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        outer = torch.cuda.current_stream(device)
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = forward()
        except RuntimeError:
            torch.cuda.set_stream(outer)  # torch.cuda.graph leaves its capture stream current when it fails
            raise

    def replay() -> T:
        graph.replay()
        return out

    return replay


def max_width_pages(max_context_len: int, page_size: int) -> int:
    """Pages of the longest sequence the engine admits (its last token included)."""
    return math.ceil((max_context_len + 1) / page_size)
