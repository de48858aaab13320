"""Page bytes between a pool and the gRPC wire, off the engine thread: ``PageExporter`` (prefill side) and
``PageImporter`` (decode side).

    prefill: pool pages --gather on a side stream, after the fence of the chunk that wrote them--> one device
             buffer --one D2H copy--> host --kv_wire.encode_page_run (one copy)--> the message's bytes
    decode:  the message's bytes --memoryview slices (no copy)--> one H2D copy per part on a side stream
             --index_copy_ into the request's pages--> pool; scales (and fp8/bf16 values) checked on the device

Both use their own CUDA stream, so a transfer never waits behind the engine's next chunk or decode step,
and never holds the engine thread. The importer's invariant: ``finish`` returns only after every write it
issued is complete, so the caller may free the pages (abort) or hand them to the engine right after.
Pages written here are the request's own (allocated to it, not yet visible to any other request).
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Sequence

import torch

from engine.fence import Fence
from engine.kv_pool import KVPool
from nvfp4_serve.kv_wire import PageRunView, encode_page_run

PARTS = ("k", "k_sf", "v", "v_sf")


def _parts(pool: KVPool, layer: int) -> list[torch.Tensor | None]:
    lkv = pool.layers[layer]
    return [lkv.k, lkv.k_sf, lkv.v, lkv.v_sf]


def part_page_bytes(pool: KVPool) -> list[int]:
    """Bytes of one page of each part (k, k_sf, v, v_sf; 0 for absent scales)."""
    return [0 if t is None else math.prod(t.shape[1:]) * t.element_size() for t in _parts(pool, 0)]


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class PageExporter:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.stream = _side_stream(pool.device)
        self.page_bytes = part_page_bytes(pool)

    def message(self, request_id: str, layer: int, first_page: int, page_ids: Sequence[int],
                fence: Fence | None) -> bytes:
        """The serialized PrefillMessage of ``page_ids`` of ``layer`` (sequence pages from ``first_page``).
        Blocks (call on a worker thread); reads only, after ``fence``."""
        n = len(page_ids)
        sizes = [n * b for b in self.page_bytes]
        with _on(self.stream):
            if fence is not None:
                fence.order(self.stream)
            idx = torch.tensor(list(page_ids), dtype=torch.int64, device=self.pool.device)
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.pool.device)
            offset = 0
            for t, size in zip(_parts(self.pool, layer), sizes, strict=True):
                if t is not None:
                    torch.index_select(t.view(torch.uint8).view(t.shape[0], -1), 0, idx,
                                       out=buf[offset:offset + size].view(n, -1))
                offset += size
            host = buf.cpu()  # on the side stream: waits for the gather only
        view = memoryview(host.numpy())
        parts, offset = [], 0
        for size in sizes:
            parts.append(view[offset:offset + size])
            offset += size
        return encode_page_run(request_id, layer, first_page, n, parts)


class PageImporter:
    """One transfer's writes into the decode's pool (create one per pull)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.stream = _side_stream(pool.device)
        self.page_bytes = part_page_bytes(pool)
        self._lock = threading.Lock()  # one write at a time (writes of one transfer come from several threads)
        self._last_key: tuple | None = None
        self._last_idx: tuple[torch.Tensor, torch.Tensor] | None = None
        self._bad: torch.Tensor | None = None  # device flag: a written scale (or fp8/bf16 value) is NaN/inf
        # Which parts hold floats whose NaN/inf would poison attention: nvfp4 E2M1 codes cannot be NaN, their
        # E4M3 scales can (0x7F/0xFF); fp8 values are E4M3 themselves; bf16 values are checked as bf16.
        dtype = pool.kv_dtype
        self._checked = [dtype != "nvfp4", True, dtype != "nvfp4", True]

    def check_sizes(self, run: PageRunView) -> None:
        """ValueError unless every part of ``run`` is exactly ``run.num_pages`` pages of this pool."""
        for name, mv, page in zip(PARTS, (run.k, run.k_scales, run.v, run.v_scales), self.page_bytes, strict=True):
            if mv.nbytes != run.num_pages * page:
                raise ValueError(f"part {name} of layer {run.layer} has {mv.nbytes} bytes, {run.num_pages} "
                                 f"{self.pool.kv_dtype} pages need {run.num_pages * page}")

    def write(self, run: PageRunView, page_ids: Sequence[int], num_tokens: int) -> None:
        """MUTATES the pool: ``run``'s bytes into pages ``page_ids`` of ``run.layer`` (sizes checked first), of
        which the first ``num_tokens`` token slots hold the prompt (the values checked; the rest of a last,
        partial page is never read). Blocks until the host bytes are copied (call on a worker thread); device
        writes complete by ``finish``."""
        self.check_sizes(run)
        n = len(page_ids)
        with self._lock, _on(self.stream), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer over read-only bytes: only read here
            idx = torch.tensor(list(page_ids), dtype=torch.int64, device=self.pool.device)
            parts = (run.k, run.k_scales, run.v, run.v_scales)
            for t, mv, checked in zip(_parts(self.pool, run.layer), parts, self._checked, strict=True):
                if t is None or n == 0:
                    continue
                raw = t.view(torch.uint8).view(t.shape[0], -1)
                src = torch.frombuffer(mv, dtype=torch.uint8).view(n, -1).to(self.pool.device)
                if checked:
                    self._flag(src.view(n * t.shape[1], -1)[:num_tokens], t.dtype)
                raw.index_copy_(0, idx, src)

    def copy_from(self, src_parts: Sequence[torch.Tensor | None], layer: int, src_ids: Sequence[int],
                  page_ids: Sequence[int], num_tokens: int) -> None:
        """MUTATES the pool: pages ``src_ids`` of another pool's layer tensors (cuda-ipc: the prefill's, opened
        here) into pages ``page_ids`` of ``layer``, batched (a gather and a scatter per part); the values of the
        first ``num_tokens`` token slots checked, as in ``write``."""
        if len(page_ids) == 0:
            return
        with self._lock, _on(self.stream):
            s_idx, d_idx = self._indices(src_ids, page_ids)
            for t, s, checked in zip(_parts(self.pool, layer), src_parts, self._checked, strict=True):
                if t is None:
                    continue
                rows = s.view(torch.uint8).view(s.shape[0], -1).index_select(0, s_idx)
                if checked:
                    self._flag(rows.view(len(page_ids) * t.shape[1], -1)[:num_tokens], t.dtype)
                t.view(torch.uint8).view(t.shape[0], -1).index_copy_(0, d_idx, rows)

    def _indices(self, src_ids: Sequence[int], page_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device index tensors of a run; every layer of a chunk names the same pages: built once."""
        key = (tuple(src_ids), tuple(page_ids))
        if self._last_key != key:
            dev = self.pool.device
            self._last_key = key
            self._last_idx = (torch.tensor(key[0], dtype=torch.int64, device=dev),
                              torch.tensor(key[1], dtype=torch.int64, device=dev))
        return self._last_idx

    def _flag(self, raw: torch.Tensor, dtype: torch.dtype) -> None:
        """Accumulate (on the device, no sync) whether ``raw`` bytes of ``dtype`` hold a NaN or inf."""
        if dtype == torch.float8_e4m3fn:  # E4M3 (fn): NaN is S.1111.111, there is no inf
            bad = ((raw & 0x7F) == 0x7F).any()
        else:
            bad = ~torch.isfinite(raw.view(dtype)).all()
        self._bad = bad if self._bad is None else self._bad | bad

    def settle(self) -> None:
        """Block until every write issued is complete (the pages may be freed next); no checks."""
        if self.stream is not None:
            self.stream.synchronize()

    def finish(self) -> None:
        """Block until every write issued is complete; ValueError if any written scale or value was NaN/inf
        (the caller fails the transfer and frees the pages)."""
        if self.stream is not None:
            self.stream.synchronize()
        if self._bad is not None and bool(self._bad.item()):
            raise ValueError("the pages carry NaN or inf scales or values")
