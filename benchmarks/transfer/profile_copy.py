"""Where a KV transfer's time goes, one component at a time, in one process (no gRPC): the pool-side pieces
of both paths (``svc_common/page_export.py``, ``svc_common/page_import.py``), each against the device or host
operation it is made of.

    python -m benchmarks.transfer.profile_copy [--pages 2048] [--layers 8] [--out docs/benchmarks/transfer_profile.json]

Rows: cuda-ipc ``copy_from`` (per call: one layer's pages; from a pool in this process and from one opened
through CUDA IPC from a child process), gRPC ``PageExporter.message`` and ``PageImporter.write`` (per message),
and the raw copies they stand on (pageable / pinned H2D and D2H, a bytes copy). ``engine slowdown`` runs a
thread launching small kernels (the engine's pattern) while exports run in another: how much the GIL costs
the engine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from engine.engine_loop import ENGINE_SWITCH_INTERVAL_S
from engine.kv_pool import KVPool
from nvfp4_serve_proto import prefill_pb2
from svc_common.host_malloc import keep_freed_blocks
from svc_common.kv_transfer_ipc import export_share, open_share, pool_view
from svc_common.kv_wire import decode_page_run
from svc_common.page_export import PageExporter
from svc_common.page_import import PageImporter
from svc_common.pool_parts import PARTS


def _pool(args, device) -> KVPool:
    return KVPool(args.kv_dtype, args.layers, args.pages * 2, 16, 8, 128, device=device)


def _time(fn, repeat: int) -> float:
    """Median seconds of ``fn`` (synchronised)."""
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _trace(args, fns: dict) -> None:
    """torch.profiler tables of one call of each of ``fns`` (warm), appended to ``args.trace``."""
    from torch.profiler import ProfilerActivity, profile
    out = []
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        out.append(f"## {name}\n\nby self CPU time\n{avg.table(sort_by='self_cpu_time_total', row_limit=25)}\n"
                   f"by CUDA time\n{avg.table(sort_by='self_device_time_total', row_limit=15)}\n")
    Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
    Path(args.trace).write_text("\n".join(out))
    print(f"wrote {args.trace}")


def _child(args, conn) -> None:
    pool = _pool(args, "cuda")
    for layer in pool.layers:
        for t in (layer.k, layer.v, layer.k_sf, layer.v_sf):
            if t is not None:
                t.view(torch.uint8).fill_(1)
    torch.cuda.synchronize()
    share = prefill_pb2.KVShare(num_pages=pool.layers[0].k.shape[0], tensors=export_share(pool))
    conn.send(share.SerializeToString())
    conn.recv()  # keep the pool alive until the parent is done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-dtype", default="nvfp4")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="docs/benchmarks/transfer_profile.json")
    p.add_argument("--trace", default="", help="also write torch.profiler tables (CPU and CUDA time per op) of "
                   "one copy_from of every layer, one export and one import of every message, to this text file")
    args = p.parse_args()
    dev = torch.device("cuda")
    src, dst = _pool(args, dev), _pool(args, dev)
    for layer in src.layers:
        for t in (layer.k, layer.v, layer.k_sf, layer.v_sf):
            if t is not None:
                t.view(torch.uint8).fill_(1)
    n = args.pages
    layer_bytes = n * src.page_bytes_per_layer
    rows: list[dict] = []

    def row(name: str, seconds: float, nbytes: int, note: str = "") -> None:
        rows.append({"component": name, "ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9, "note": note})
        print(f"{name:58s} {seconds * 1e3:9.3f} ms {nbytes / seconds / 1e9:9.2f} GB/s  {note}", flush=True)

    mv0 = memoryview(torch.ones(1 << 20, dtype=torch.uint8).numpy())
    row("bytes(memoryview) 1 MiB x200, default heap", _time(lambda: [bytes(mv0) for _ in range(200)], 3) / 200, 1 << 20)
    keep_freed_blocks()  # as the services do (svc_common/host_malloc.py): every row below runs with it
    row("bytes(memoryview) 1 MiB x200, services' heap setting",
        _time(lambda: [bytes(mv0) for _ in range(200)], 3) / 200, 1 << 20)
    contiguous = list(range(n))
    shuffled = random.Random(0).sample(range(2 * n), n)
    for label, s_ids in (("contiguous", contiguous), ("scattered", shuffled)):
        parts = [dict(zip(PARTS, (lk.k, lk.k_sf, lk.v, lk.v_sf), strict=True)) for lk in src.layers]

        def ipc_all(s_ids=s_ids, parts=parts) -> None:
            imp = PageImporter(dst)
            for layer in range(args.layers):
                imp.copy_from([parts[layer][k] for k in PARTS], layer, s_ids, contiguous, n * 16)
            imp.finish()
        row(f"copy_from in-process, {label}, {args.layers} layers", _time(ipc_all, args.repeat),
            layer_bytes * args.layers)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(args, child))
    proc.start()
    share = prefill_pb2.KVShare.FromString(parent.recv())
    view = open_share(share, dst)
    for label, s_ids in (("contiguous", contiguous), ("scattered", shuffled)):
        def ipc_open(s_ids=s_ids) -> None:
            imp = PageImporter(dst)
            for layer in range(args.layers):
                imp.copy_from([view.layers[layer].get(k) for k in PARTS], layer, s_ids, contiguous, n * 16)
            imp.finish()
        row(f"copy_from IPC-opened pool, {label}, {args.layers} layers", _time(ipc_open, args.repeat),
            layer_bytes * args.layers)
    parent.send(b"done")
    proc.join(timeout=30)

    exporter = PageExporter(pool_view(src))
    per_msg = max(1, (1 << 20) // src.page_bytes_per_layer)
    unit = per_msg * 8  # as the prefill service exports: 8 messages per gather
    runs = [(layer, i) for layer in range(args.layers) for i in range(0, n, unit)]
    msgs: list[bytes] = []

    def export_all() -> None:
        msgs.clear()
        for layer, i in runs:
            msgs.extend(exporter.messages("r", layer, i, contiguous[i:i + unit], per_msg, None))
    t = _time(export_all, args.repeat)
    row(f"PageExporter.messages x{len(runs)} ({unit} pages, {per_msg} per message)", t, layer_bytes * args.layers,
        f"{t / max(1, len(msgs)) * 1e6:.0f} us per message")
    views = [decode_page_run(m) for m in msgs]

    def import_all() -> None:
        imp = PageImporter(dst)
        for v in views:
            imp.write(v, contiguous[v.first_page:v.first_page + v.num_pages], v.num_pages * 16)
        imp.finish()
    t = _time(import_all, args.repeat)
    row(f"PageImporter.write x{len(views)}", t, layer_bytes * args.layers, f"{t / len(views) * 1e6:.0f} us per message")
    if args.trace:
        _trace(args, {"copy_from in-process, scattered": ipc_all, "PageExporter.messages": export_all,
                      "PageImporter.write": import_all})

    a16 = src.layers[0].k.view(torch.uint8).view(src.layers[0].k.shape[0], -1)
    b16 = dst.layers[0].k.view(torch.uint8).view(dst.layers[0].k.shape[0], -1)
    idx = torch.arange(n, device=dev)
    part = n * a16.shape[1]
    row(f"copy_ {part >> 20} MiB between pools (one part of one layer)", _time(lambda: b16[:n].copy_(a16[:n]), 5), part)
    row(f"index_select {part >> 20} MiB into the pool", _time(
        lambda: torch.index_select(a16, 0, idx, out=b16[:n]), 5), part)
    mib = 1 << 20
    host = torch.empty(mib, dtype=torch.uint8)
    pinned = torch.empty(mib, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(mib, dtype=torch.uint8, device=dev)
    reps = 200
    row("H2D 1 MiB pageable x200", _time(lambda: [d.copy_(host) for _ in range(reps)], 3) / reps, mib)
    row("H2D 1 MiB pinned x200", _time(lambda: [d.copy_(pinned, non_blocking=True) for _ in range(reps)], 3) / reps, mib)
    row("D2H 1 MiB pageable (.cpu()) x200", _time(lambda: [d.cpu() for _ in range(reps)], 3) / reps, mib)
    row("D2H 1 MiB pinned x200", _time(lambda: [pinned.copy_(d, non_blocking=True) for _ in range(reps)], 3) / reps, mib)
    # a 4 MiB message (the services' --kv-message-bytes) between a bytes object and the device, both ways the
    # copy can go: straight (pageable memory, the driver stages it) or through pinned memory (one host copy more)
    msg = bytes(4 * mib)
    d4 = torch.empty(4 * mib, dtype=torch.uint8, device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer over read-only bytes: only read here
        src4 = torch.frombuffer(msg, dtype=torch.uint8)

    def staged_h2d() -> None:
        staged = torch.empty(4 * mib, dtype=torch.uint8, pin_memory=True)
        staged.copy_(src4)
        d4.copy_(staged, non_blocking=True)
    reps4 = 50
    row("H2D 4 MiB message from bytes, pageable x50", _time(lambda: [d4.copy_(src4) for _ in range(reps4)], 3) / reps4,
        4 * mib)
    row("H2D 4 MiB message from bytes, via pinned staging x50",
        _time(lambda: [staged_h2d() for _ in range(reps4)], 3) / reps4, 4 * mib)
    big = torch.empty(layer_bytes, dtype=torch.uint8, device=dev)
    bigp = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    row(f"D2H {layer_bytes >> 20} MiB pinned", _time(lambda: bigp.copy_(big, non_blocking=True), 5), layer_bytes)
    row(f"H2D {layer_bytes >> 20} MiB pinned", _time(lambda: big.copy_(bigp, non_blocking=True), 5), layer_bytes)

    # GIL: a thread launching small kernels (engine-like), alone and beside a thread exporting messages
    x = torch.zeros(1024, device=dev)

    def engine(k: int = 3000) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            x.add_(1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    alone = min(engine() for _ in range(3))
    default_interval = sys.getswitchinterval()
    # how long a thread may hold the GIL while another waits: CPython's default, the services' setting, shorter
    for interval in (default_interval, ENGINE_SWITCH_INTERVAL_S, 1e-4):
        sys.setswitchinterval(interval)
        stop = threading.Event()

        def exporting(stop=stop) -> None:
            while not stop.is_set():
                for layer, i in runs[:8]:
                    exporter.messages("r", layer, i, contiguous[i:i + unit], per_msg, None)
        th = threading.Thread(target=exporting)
        th.start()
        time.sleep(0.05)
        beside = min(engine() for _ in range(3))
        stop.set()
        th.join()
        name = f"engine thread: 3000 launches alone / beside exports, GIL switch interval {interval * 1e3:g} ms"
        rows.append({"component": name, "ms": alone * 1e3, "beside_ms": beside * 1e3, "slowdown": beside / alone})
        print(f"{name}: alone {alone * 1e3:.1f} ms, beside {beside * 1e3:.1f} ms ({beside / alone:.2f}x)")
    sys.setswitchinterval(default_interval)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m benchmarks.transfer.profile_copy", "gpu":
                               torch.cuda.get_device_name(), "pages": n, "layers": args.layers,
                               "kv_dtype": args.kv_dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
