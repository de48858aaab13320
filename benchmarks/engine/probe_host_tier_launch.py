"""Does the host tier's timed store window count the GPU waiting for the host to launch the copy? (CUDA GPU)

    python -m benchmarks.engine.probe_host_tier_launch

A store of 64 or 160 fp8 pages, or 64 nvfp4 pages (8 layers of Qwen3-8B's KV geometry, page 16, scattered device
and host pages), timed three ways, each the median of 30, with 0, 1 and 4 Python threads busy beside it (each
loops over pure Python and a small torch op, as a service's gRPC and tokenizer threads do):

- ``host``: ``HostPool.store``'s own timing, the figure ``HostTierStats`` and the benchmarks report;
- ``plain``: the same CUDA events around one page-stage launch on a side stream;
- ``gated``: the same, with the side stream held (``cuStreamWaitValue32`` on a pinned flag) until the events and
  the kernel are all queued, so the window holds the copy alone.

Every torch call and kernel launch gives up the GIL; once the GPU reaches the start event, each wait of the
launching thread to win the GIL back before the kernel (and the end event) are queued is counted as copy time.
Prints one line per configuration (docs/benchmarks/host_tier_launch_h100.md has a run).
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import threading

import torch

from engine.host_pool import CopyPath, HostPool
from engine.kv_pool import KVPool
from nvfp4_kernels import page_stage

CONFIGS = (("fp8_e4m3", 64), ("fp8_e4m3", 160), ("nvfp4", 64))
MODES = ("host", "plain", "gated")


class _Gate:
    """A pinned flag a stream can be held on: ``hold`` queues a wait for the next value, ``open`` writes it
    (a numpy store: the thread keeps the GIL)."""

    def __init__(self) -> None:
        libcuda = ctypes.CDLL("libcuda.so.1")
        self._wait = getattr(libcuda, "cuStreamWaitValue32_v2", None) or libcuda.cuStreamWaitValue32
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._flag = torch.zeros(1, dtype=torch.int32).pin_memory()
        self._value = 0

    def hold(self, stream: torch.cuda.Stream) -> None:
        self._value += 1
        code = self._wait(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(self._flag.data_ptr()), self._value,
                          0)  # CU_STREAM_WAIT_VALUE_GEQ
        if code != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed ({code})")

    def open(self) -> None:
        self._flag.numpy()[0] = self._value


def store_gbps(kv: str, b: int, iters: int, mode: str, gate: _Gate, dev: torch.device) -> float:
    """Median GB/s of ``iters`` stores of ``b`` pages of ``kv``, timed as ``mode`` says (module docstring)."""
    pool = KVPool(kv, 8, 2 * b + 1, device=dev, page_size=16, num_kv_heads=8, head_dim=128)
    host = HostPool(pool, 2 * b, CopyPath.DIRECT)
    owned = host.allocate(2 * b)
    g = torch.Generator().manual_seed(0)
    dids = torch.randperm(2 * b, generator=g)[:b].tolist()
    hids = [owned[i] for i in torch.randperm(2 * b, generator=g)[:b].tolist()]
    out = []
    if mode == "host":
        for _ in range(iters):
            before = host.stats()
            host.store(dids, hids)
            host.synchronize()
            after = host.stats()
            out.append((after.store_bytes - before.store_bytes) / (after.store_seconds - before.store_seconds) / 1e9)
        host.close()
        return statistics.median(out)
    side = torch.cuda.Stream(dev)
    ids, rows = torch.tensor(dids, device=dev), torch.tensor(hids, device=dev)
    for _ in range(iters):
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream(dev))
            if mode == "gated":
                gate.hold(side)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            page_stage.gather(host._plan, ids, host.pages, rows)
            end.record()
        if mode == "gated":
            gate.open()
        side.synchronize()
        out.append(b * host.page_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
    host.close()
    return statistics.median(out)


def _busy(stop: threading.Event) -> None:
    x = torch.zeros(16)
    while not stop.is_set():
        s = 0
        for i in range(3000):
            s += i
        x.add_(1)


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("probe_host_tier_launch needs a CUDA GPU")
    dev, gate = torch.device("cuda"), _Gate()
    print(torch.cuda.get_device_name(dev), file=sys.stderr)
    for nbusy in (0, 1, 4):
        stop = threading.Event()
        threads = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(nbusy)]
        for t in threads:
            t.start()
        for kv, b in CONFIGS:
            res = {m: store_gbps(kv, b, 30, m, gate, dev) for m in MODES}
            print(f"busy threads {nbusy} {kv} {b} pages: " + ", ".join(f"{m} {v:.1f} GB/s" for m, v in res.items()),
                  flush=True)
        stop.set()
        for t in threads:
            t.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
