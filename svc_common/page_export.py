"""Page bytes of a pool out to the gRPC wire, off the engine thread (the prefill's side; the decode's is
``svc_common/page_import.py``):

    pool pages of several messages, after the fence of the chunk that wrote them, on a side stream: in up to 4
    runs of consecutive pages one D2H copy per part and run (copy engine only), else one gather per part into
    one device buffer and one D2H copy --> pinned host memory --one copy call for every message
    (messages_from)--> each message's bytes

Exports use their thread's own CUDA stream, so a transfer never waits behind the engine's next chunk and never
holds the engine thread.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from engine.fence import Fence
from svc_common.kv_transfer_ipc import PoolView, page_runs
from svc_common.kv_wire import Frame, encode_page_run, frame_page_run
from svc_common.pool_parts import (
    MAX_COPY_RUNS,
    SummedTimes,
    device_ids,
    on_stream,
    page_bytes_of,
    side_stream,
    view_parts,
)

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize  # (NULL, n): an uninitialized bytes object of n bytes
_new_bytes.argtypes, _new_bytes.restype = [ctypes.c_void_p, ctypes.c_ssize_t], ctypes.py_object
_bytes_data = ctypes.pythonapi.PyBytes_AsString  # the address of a bytes object's buffer
_bytes_data.argtypes, _bytes_data.restype = [ctypes.py_object], ctypes.c_void_p
_MAX_SLICE_RUNS = 16  # up to this many runs of consecutive pages are copied run by run (a host pool's export)


class PageExporter:
    """Reads pages of a pool: this process's (``pool_view``), or the engine's that a prefill's sender process
    opened at start-up. Thread-safe: several exports run at once (the prefill keeps a few of a stream's in
    flight), each on its thread's own side stream, so one export's synchronize never waits for another's."""

    def __init__(self, view: PoolView):
        self.view = view
        self.device = view.layers[0]["k"].device
        self._streams = threading.local()
        self.page_bytes = page_bytes_of(view_parts(view, 0))

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

        On a GPU: pages in a few runs of consecutive ids (a prompt's pages mostly are) go from the pool to pinned
        host memory (torch's caching host allocator: no fresh pages) with one copy per part and run, copy-engine
        work only; scattered pages are gathered first, one gather per part into one device buffer, then one copy
        to host. Then every message is framed from views of that host buffer (one host copy, all messages in one
        call: ``messages_from``). ``times`` (optional) gets the split of this call's time
        (device part, framing) on a GPU; a host pool's messages are not split."""
        ids = [int(p) for p in page_ids]
        n = len(ids)
        if n == 0:
            return []
        if not 0 <= layer < len(self.view.layers) or min(ids) < 0 or max(ids) >= self.view.num_pages:
            raise ValueError(f"pages {min(ids)}..{max(ids)} of layer {layer}: the pool has {len(self.view.layers)} "
                             f"layers of {self.view.num_pages} pages")
        tensors = view_parts(self.view, layer)
        stream = self.stream
        if stream is None:
            return [self._host_message(request_id, layer, first_page + i, ids[i:i + pages_per_message], tensors)
                    for i in range(0, n, pages_per_message)]
        sizes = [n * b for b in self.page_bytes]
        t0 = time.perf_counter()
        runs = page_runs(ids, list(range(n)))
        with on_stream(stream):
            if fence is not None:
                fence.order(stream)
            host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
            if len(runs) <= MAX_COPY_RUNS:
                _copy_runs_to_host(tensors, sizes, runs, host)
            else:
                idx = device_ids(ids, self.device)
                buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
                offset = 0
                for t, size in zip(tensors, sizes, strict=True):
                    if t is not None:
                        torch.index_select(t.view(torch.uint8).view(t.shape[0], -1), 0, idx,
                                           out=buf[offset:offset + size].view(n, -1))
                    offset += size
                host.copy_(buf, non_blocking=True)
            stream.synchronize()  # the copies to host (and the gather): this thread's stream only
        t1 = time.perf_counter()
        frames, payloads = [], []
        for i in range(0, n, pages_per_message):
            m = min(pages_per_message, n - i)
            parts, offset = [], 0
            for size, page in zip(sizes, self.page_bytes, strict=True):
                parts.append(host[offset + i * page:offset + (i + m) * page] if page else None)
                offset += size
            frames.append(frame_page_run(request_id, layer, first_page + i, m, [m * b for b in self.page_bytes]))
            payloads.append(parts)
        out = messages_from(frames, payloads)
        if times is not None:
            times.add(t1 - t0, time.perf_counter() - t1)
        return out

    def _host_message(self, request_id: str, layer: int, first_page: int, ids: list[int],
                      tensors: list[torch.Tensor | None]) -> bytes:
        """A host pool's pages: slices straight into the message where they are a few runs, else one gather."""
        n = len(ids)
        runs = page_runs(ids, list(range(n)))
        if len(runs) > _MAX_SLICE_RUNS:
            idx = torch.tensor(ids, dtype=torch.int64)
            parts = [[] if t is None else [memoryview(t.view(torch.uint8).view(t.shape[0], -1).index_select(0, idx)
                                                      .numpy()).cast("B")] for t in tensors]
        else:
            parts = [[] if t is None else [memoryview(t[s0:s0 + m].view(torch.uint8).numpy()).cast("B")
                                           for s0, _, m in runs] for t in tensors]
        return encode_page_run(request_id, layer, first_page, n, parts)


class ExportTimes(SummedTimes):
    """A transfer's exports (sender side): the device part (the gather or the run copies to pinned memory, and
    waiting for them) and framing the messages on the host."""

    STEPS = ("device_s", "framing_s")
    UNIT = "exports"
    LABELS = ("gathering and copying to host", "framing")


def messages_from(frames: Sequence[Frame], payloads: Sequence[Sequence[torch.Tensor | np.ndarray | None]]
                  ) -> list[bytes]:
    """The messages ``frames`` frame, each part's bytes copied in from a 1-D uint8 tensor or array (None: absent),
    every payload byte of every message in ONE call (``torch._foreach_copy_``), which runs without the GIL; the
    framing bytes (a few dozen per part) are written directly.

    Why one call: in a sender, gRPC's thread holds the GIL while it copies each sent message into its own buffer,
    and every copy that releases the GIL must win it back behind such a copy (up to a switch interval). One
    release per batch of messages, not one per part (four for NVFP4 pages, plus the framing bytes), keeps an
    export from queueing behind the sends it feeds. Each bytes object is created uninitialized and filled in
    place before any other code holds it: the C API's way to build bytes (``PyBytes_FromStringAndSize(NULL,
    n)``)."""
    msgs, dst, src = [], [], []
    for frame, parts in zip(frames, payloads, strict=True):
        msg = _new_bytes(None, frame.total)
        base = _bytes_data(msg)
        # a writable view of the fresh object's buffer (no other code holds it yet)
        out = torch.frombuffer((ctypes.c_ubyte * frame.total).from_address(base), dtype=torch.uint8)
        msgs.append(msg)
        ctypes.memmove(base, frame.head, len(frame.head))  # the framing: a few bytes each, written here
        sizes = [0 if p is None else p.shape[0] for p in parts]
        for prefix, p, at in zip(frame.prefixes, parts, frame.payload_offsets(sizes), strict=True):
            if prefix:
                ctypes.memmove(base + at - len(prefix), prefix, len(prefix))
                dst.append(out[at:at + p.shape[0]])
                src.append(torch.from_numpy(p) if isinstance(p, np.ndarray) else p)
    torch._foreach_copy_(dst, src)
    return msgs


def message_from(frame: Frame, payloads: Sequence[torch.Tensor | np.ndarray | None]) -> bytes:
    """One message ``frame`` frames (``messages_from``)."""
    return messages_from([frame], [payloads])[0]


def _copy_runs_to_host(tensors: Sequence[torch.Tensor | None], sizes: Sequence[int],
                       runs: Sequence[tuple[int, int, int]], host: torch.Tensor) -> None:
    """Queue on the current stream the copies of runs (pool page, position, length) of every present part of
    ``tensors`` into ``host``, laid out part after part (``sizes`` bytes each), pages in position order: the
    layout a gather of the same pages writes."""
    offset = 0
    for t, size in zip(tensors, sizes, strict=True):
        if t is not None:
            rows = t.view(torch.uint8).view(t.shape[0], -1)
            page = rows.shape[1]
            for s0, d0, m in runs:
                host[offset + d0 * page:offset + (d0 + m) * page].view(m, page).copy_(rows[s0:s0 + m],
                                                                                     non_blocking=True)
        offset += size
