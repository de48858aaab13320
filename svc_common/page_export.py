"""Page bytes of a pool out to the gRPC wire, off the engine thread (the prefill's side; the decode's is
``svc_common/page_import.py``):

    pool pages of several messages, after the fence of the chunk that wrote them, on a side stream: in up to 4
    runs of consecutive pages one D2H copy per part, message and run (copy engine only), else one gather per part
    into one device buffer first --> one pinned host buffer holding the messages framed in place
    (stage_messages) --one host copy each--> each message's bytes

Exports use their thread's own CUDA stream, so a transfer never waits behind the engine's next chunk and never
holds the engine thread; the calls that issue an export's copies keep the GIL (``native_copy``), so an export
does not queue behind the gRPC thread that sends the messages it makes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.fence import Fence
from svc_common.kv_transfer_ipc import PoolView, page_runs
from svc_common.kv_wire import Frame, frame_page_run
from svc_common.native_copy import DeviceToHost, bytes_at, host_copy
from svc_common.pool_parts import (
    MAX_COPY_RUNS,
    SummedTimes,
    device_ids,
    on_stream,
    page_bytes_of,
    side_stream,
    view_parts,
)


class PageExporter:
    """Reads pages of a pool: this process's (``pool_view``), or the engine's that a prefill's sender process
    opened at start-up. Thread-safe: several exports run at once (the prefill keeps a few of a stream's in
    flight), each on its thread's own side stream, so one export's synchronize never waits for another's."""

    def __init__(self, view: PoolView):
        self.view = view
        self.device = view.layers[0]["k"].device
        self._streams = threading.local()
        self.page_bytes = page_bytes_of(view_parts(view, 0))
        for layer in range(len(view.layers)):
            if any(t is not None and not t.is_contiguous() for t in view_parts(view, layer)):
                raise ValueError(f"layer {layer} of the pool has a non-contiguous part: exports read pages as rows")

    @property
    def page_bytes_per_layer(self) -> int:
        return sum(self.page_bytes)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """This thread's side stream (None for a host pool)."""
        if not hasattr(self._streams, "stream"):
            self._streams.stream = side_stream(self.device)
        return self._streams.stream

    def messages(self, request_id: str, layer: int, first_page: int, page_ids: Sequence[int],
                 pages_per_message: int, fence: Fence | None, times: ExportTimes | None = None) -> list[bytes]:
        """The serialized PrefillMessages of ``page_ids`` of ``layer`` (sequence pages from ``first_page``), at
        most ``pages_per_message`` pages each. Blocks (call on a worker thread); reads only, after ``fence``.

        Every message is laid out in one staging buffer, framing and payloads in place, then copied out as one
        bytes object each (``stage_messages``). On a GPU the staging buffer is pinned host memory (torch's caching
        host allocator: no fresh pages) and the payloads reach it by device-to-host copies queued on this thread's
        side stream, one per part and message and run of consecutive pages (copy-engine work; a prompt's pages
        are a few runs); pages in more than ``MAX_COPY_RUNS`` runs are gathered first, one gather per part into
        one device buffer. The calls that issue all this keep the GIL (``native_copy``): one export gives it up a
        handful of times (the pinned allocation, the fence, the stream's synchronize), not once per part and
        message. ``times`` (optional) gets the split of this call's time (staging, copying out)."""
        ids = [int(p) for p in page_ids]
        n = len(ids)
        if n == 0:
            return []
        if not 0 <= layer < len(self.view.layers) or min(ids) < 0 or max(ids) >= self.view.num_pages:
            raise ValueError(f"pages {min(ids)}..{max(ids)} of layer {layer}: the pool has {len(self.view.layers)} "
                             f"layers of {self.view.num_pages} pages")
        if pages_per_message < 1:
            raise ValueError(f"pages_per_message must be >= 1, got {pages_per_message}")
        tensors = view_parts(self.view, layer)
        t0 = time.perf_counter()
        counts = [min(pages_per_message, n - i) for i in range(0, n, pages_per_message)]
        frames = [frame_page_run(request_id, layer, first_page + i * pages_per_message, m,
                                 [m * b for b in self.page_bytes]) for i, m in enumerate(counts)]
        total = sum(f.total for f in frames)
        runs = page_runs(ids, list(range(n)))
        stream = self.stream
        if stream is None:
            staging = np.empty(total, dtype=np.uint8)
            offsets = stage_messages(frames, counts, _sources(tensors, self.page_bytes, runs),
                                     staging.ctypes.data, host_copy)
        else:
            d2h = self._d2h()
            staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            if fence is not None:
                fence.order(stream)
            gathered = None
            if len(runs) > MAX_COPY_RUNS:
                gathered = self._gather(tensors, ids, stream)
                sources = _sources(gathered, self.page_bytes, [(0, 0, n)])
            else:
                sources = _sources(tensors, self.page_bytes, runs)
            handle = stream.cuda_stream
            offsets = stage_messages(frames, counts, sources, staging.data_ptr(),
                                     lambda dst, src, size: d2h.copy(dst, src, size, handle))
            stream.synchronize()  # the copies (and the gather): this thread's stream only
            del gathered
        t1 = time.perf_counter()
        base = staging.ctypes.data if stream is None else staging.data_ptr()
        out = [bytes_at(base + off, f.total) for off, f in zip(offsets, frames, strict=True)]
        if times is not None:
            times.add(t1 - t0, time.perf_counter() - t1)
        return out

    def _d2h(self) -> DeviceToHost:
        """This thread's device-to-host copier, its context bound once."""
        d2h = getattr(self._streams, "d2h", None)
        if d2h is None:
            d2h = DeviceToHost()
            d2h.bind(self.device)
            self._streams.d2h = d2h
        return d2h

    def _gather(self, tensors: list[torch.Tensor | None], ids: list[int], stream: torch.cuda.Stream
                ) -> list[torch.Tensor | None]:
        """The pages ``ids`` of each part gathered in order into a fresh device tensor, on ``stream``."""
        with on_stream(stream):
            idx = device_ids(ids, self.device)
            return [None if t is None else torch.index_select(t.view(torch.uint8).view(t.shape[0], -1), 0, idx)
                    for t in tensors]


class ExportTimes(SummedTimes):
    """A transfer's exports (sender side): staging the messages (framing them, the gather and the copies to pinned
    memory, and waiting for them) and copying each message out of the staging buffer into its bytes."""

    STEPS = ("stage_s", "copy_out_s")
    UNIT = "exports"
    LABELS = ("framing and copying to host", "copying out")


class PartSource(NamedTuple):
    """Where one part's pages are read: ``address`` of its row 0 (the pool's page 0, or a gather's first row),
    ``page_bytes`` per row, and the ``runs`` (source row, position in the export, pages) that hold the export's
    pages, in position order."""

    address: int
    page_bytes: int
    runs: Sequence[tuple[int, int, int]]


def _sources(tensors: Sequence[torch.Tensor | None], page_bytes: Sequence[int],
             runs: Sequence[tuple[int, int, int]]) -> list[PartSource | None]:
    """``PartSource`` of each present part of ``tensors`` (contiguous rows of ``page_bytes``: the exporter checks
    its pool's once), read in ``runs``."""
    return [None if t is None else PartSource(t.data_ptr(), b, runs) for t, b in zip(tensors, page_bytes, strict=True)]


def stage_messages(frames: Sequence[Frame], counts: Sequence[int], sources: Sequence[PartSource | None],
                   base: int, copy: Callable[[int, int, int], None]) -> list[int]:
    """Lay the messages ``frames`` frame out one after another from host address ``base`` (``sum(total)``
    bytes): each message's framing written here, each part's payload brought by ``copy(dst, src, size)`` (host
    addresses from ``base``, source addresses from ``sources``: one call per part, message and run of pages).
    Message i holds ``counts[i]`` pages, the export's positions after the earlier messages'. Returns each
    message's offset from ``base``. Keeps the GIL (``native_copy.host_copy``); so should ``copy``."""
    offsets, at, lo = [], 0, 0
    for frame, m in zip(frames, counts, strict=True):
        sizes = [0 if src is None else m * src.page_bytes for src in sources]
        host_copy(base + at, frame.head, len(frame.head))
        for prefix, src, payload in zip(frame.prefixes, sources, frame.payload_offsets(sizes), strict=True):
            if not prefix:
                continue
            host_copy(base + at + payload - len(prefix), prefix, len(prefix))
            for row, pos, count in src.runs:
                first, last = max(lo, pos), min(lo + m, pos + count)
                if first < last:
                    copy(base + at + payload + (first - lo) * src.page_bytes,
                         src.address + (row + first - pos) * src.page_bytes, (last - first) * src.page_bytes)
        offsets.append(at)
        at += frame.total
        lo += m
    return offsets


def message_from(frame: Frame, payloads: Sequence[torch.Tensor | np.ndarray | None]) -> bytes:
    """The message ``frame`` frames, its parts copied from host ``payloads`` (1-D uint8 tensors or arrays, None
    where absent): ``stage_messages`` with each part one row."""
    arrays = [None if p is None else np.ascontiguousarray(p.numpy() if isinstance(p, torch.Tensor) else p)
              for p in payloads]
    sources = [None if a is None else PartSource(a.ctypes.data, a.nbytes, [(0, 0, 1)]) for a in arrays]
    staging = np.empty(frame.total, dtype=np.uint8)
    stage_messages([frame], [1], sources, staging.ctypes.data, host_copy)
    return bytes_at(staging.ctypes.data, frame.total)
