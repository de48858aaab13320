"""The host work of one gRPC export, without a GPU: framing a run of page messages (``kv_wire.frame_page_run``) and
building them from a host buffer (``page_export.messages_from``), the part of a sender's export that runs Python;
alone, and beside a thread that runs Python all the time (as the sender's gRPC thread does while it sends).

    python -m benchmarks.transfer.bench_framing [--out-json docs/benchmarks/framing_cpu.json --out-md ...]

Shapes are the grpc path's: 8 messages of one layer per export, 4 MiB of NVFP4 or FP8 pages each (8 KV heads x
head_dim 128, 16-token pages). Two payload sizes: the real one (the copy of the bytes dominates; it runs without the
GIL), and 1/128 of it (the same messages and parts: what is left is the Python work per message). Medians of
``--repeats`` calls, with the senders' heap setting (``svc_common/host_malloc.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from svc_common.host_malloc import keep_freed_blocks
from svc_common.kv_wire import frame_page_run
from svc_common.page_export import messages_from

PAGE_PARTS = {"nvfp4": (16 * 8 * 64, 16 * 8 * 8, 16 * 8 * 64, 16 * 8 * 8), "fp8_e4m3": (16 * 8 * 128, 0, 16 * 8 * 128, 0)}
MESSAGE_BYTES = 4 << 20
MESSAGES_PER_EXPORT = 8


def _median_us(fn, repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(kv_dtype: str, scale: int, repeats: int) -> dict:
    """One export's framing and building at 1/``scale`` of the real part sizes, alone and beside a busy thread."""
    page = [b // scale for b in PAGE_PARTS[kv_dtype]]
    m = MESSAGE_BYTES // sum(PAGE_PARTS[kv_dtype])  # pages per message
    host = torch.randint(0, 256, (MESSAGES_PER_EXPORT * m * sum(page),), dtype=torch.uint8)
    sizes = [MESSAGES_PER_EXPORT * m * b for b in page]

    def frames() -> list:
        return [frame_page_run("req-0123456789", 3, i * m, m, [m * b for b in page])
                for i in range(MESSAGES_PER_EXPORT)]

    def export() -> list[bytes]:
        payloads = []
        for i in range(MESSAGES_PER_EXPORT):
            parts, offset = [], 0
            for size, b in zip(sizes, page, strict=True):
                parts.append(host[offset + i * m * b:offset + (i + 1) * m * b] if b else None)
                offset += size
            payloads.append(parts)
        return messages_from(frames(), payloads)

    total = sum(len(x) for x in export())
    row = {"kv_dtype": kv_dtype, "payload_scale": scale, "export_bytes": total,
           "frame_us_per_message": _median_us(frames, repeats) / MESSAGES_PER_EXPORT,
           "export_us": _median_us(export, repeats)}
    with _busy_thread():
        row["export_us_beside_busy_thread"] = _median_us(export, repeats)
    return row


@contextlib.contextmanager
def _busy_thread():
    """A thread that runs Python until the block ends (it holds the GIL whenever the measured thread lets go)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--out-md", default=None)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    torch.set_num_threads(1)
    keep_freed_blocks()  # the senders' heap setting: message buffers reuse freed pages (svc_common/host_malloc.py)
    rows = [measure(kv, scale, a.repeats) for kv in PAGE_PARTS for scale in (128, 1)]
    lines = [("| kv dtype | payload | export MB | framing us per message | export (8 messages) us | GB/s | "
             "export beside a busy Python thread us |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kv_dtype']} | {'1/128' if r['payload_scale'] > 1 else 'full'} | "
                     f"{r['export_bytes'] / 1e6:.2f} | {r['frame_us_per_message']:.1f} | {r['export_us']:.0f} | "
                     f"{r['export_bytes'] / r['export_us'] / 1e3:.2f} | {r['export_us_beside_busy_thread']:.0f} |")
    table = "\n".join(lines)
    print(table)
    cmd = "python -m benchmarks.transfer.bench_framing " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.out_json:
        Path(a.out_json).write_text(json.dumps({"command": cmd.strip(), "rows": rows}, indent=1) + "\n")
    if a.out_md:
        about = __doc__.split("\n\n")[2].strip()
        machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        Path(a.out_md).write_text(f"# One gRPC export's host work (CPU)\n\nCommand: `{cmd.strip()}`\n\n"
                                  f"Machine: {machine}.\n\n{about}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
