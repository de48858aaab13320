"""Host-tier page movement on one GPU: ``HostPool.store`` / ``load`` of a batch of pages (every layer, data and block
scales) against a raw pinned copy of the same bytes, for each KV dtype and batch size.

    python -m benchmarks.engine.bench_host_tier [--layers 36] [--batches 1 8 64 512] [--spread-gib 32] \\
        --out docs/benchmarks/host_tier_copy.json --md docs/benchmarks/host_tier_copy.md

A pool of Qwen3-8B's KV geometry (8 KV heads x 128, page 16) and a host tier of the same pages; each row times
the host tier's own measurement (CUDA events around its copies on its side stream, ``HostTierStats``) of a
store and a load of ``batch`` pages at scattered device ids, the median of ``--iters``, for each copy path
(``direct``: the page-stage kernel reads and writes the pinned host pages; ``staged``: device staging and one copy
per run of consecutive host pages) and each order of host pages (``consecutive``, as in a fresh tier;
``scattered``, as after the tier has evicted and reused pages; with ``--spread-gib``, ``spread``: a tier of that
many GiB, each batch's host pages drawn from all of it, as in a full tier after a long run), and the raw anchor:
``torch`` D2H / H2D of one contiguous pinned buffer of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.engine.doc_files import write_doc

LAYOUT = {"page_size": 16, "num_kv_heads": 8, "head_dim": 128}


def _raw_gbps(nbytes: int, iters: int, device: torch.device) -> tuple[float, float]:
    """(D2H, H2D) GB/s of one contiguous pinned copy of ``nbytes``, median of ``iters``."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for direction in ("d2h", "h2d"):
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if direction == "d2h":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append(nbytes / statistics.median(times) / 1e9)
    return out[0], out[1]


def _tier_gbps(host, device_pages: list[int], host_pages: list[int], iters: int) -> tuple[float, float]:
    """(store, load) GB/s of the host tier's own timing, median of ``iters`` round trips."""
    store, load = [], []
    for _ in range(iters):
        before = host.stats()
        host.store(device_pages, host_pages)
        host.synchronize()
        mid = host.stats()
        host.load(host_pages, device_pages)
        host.synchronize()
        after = host.stats()
        store.append((mid.store_bytes - before.store_bytes) / (mid.store_seconds - before.store_seconds) / 1e9)
        load.append((after.load_bytes - mid.load_bytes) / (after.load_seconds - mid.load_seconds) / 1e9)
    return statistics.median(store), statistics.median(load)


def run_spread(kv_dtype: str, layers: int, batches: list[int], iters: int, device: torch.device,
               spread_gib: float) -> list[dict]:
    """The ``spread`` rows: a host tier of ``spread_gib`` GiB, each batch's host pages drawn at random from all of
    it (as in a full tier of a long sweep)."""
    from engine.host_pool import CopyPath, HostPool
    from engine.kv_pool import KVPool

    most = max(batches)
    pool = KVPool(kv_dtype, layers, 2 * most + 1, device=device, **LAYOUT)
    g = torch.Generator().manual_seed(1)
    scattered = torch.randperm(2 * most, generator=g)[:most].tolist()
    rows = []
    num_pages = max(2 * most, int(spread_gib * 2**30) // (pool.page_size * pool.bytes_per_token))
    for path in CopyPath:
        host = HostPool(pool, num_pages, path)
        owned = host.allocate(num_pages)
        for b in batches:
            host_pages = [owned[i] for i in torch.randperm(num_pages, generator=g)[:b].tolist()]
            store, load = _tier_gbps(host, scattered[:b], host_pages, iters)
            d2h, h2d = _raw_gbps(b * host.page_bytes, iters, device)
            rows.append({"kv_dtype": kv_dtype, "path": path.value,
                         "host_pages": f"spread over {num_pages * host.page_bytes / 2**30:.0f} GiB",
                         "batch_pages": b, "bytes": b * host.page_bytes, "store_gbps": store, "load_gbps": load,
                         "raw_d2h_gbps": d2h, "raw_h2d_gbps": h2d})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        host.close()  # unpinned before the next path's tier is pinned
    return rows


def run(kv_dtype: str, layers: int, batches: list[int], iters: int, device: torch.device) -> list[dict]:
    from engine.host_pool import CopyPath, HostPool
    from engine.kv_pool import KVPool

    most = max(batches)
    pool = KVPool(kv_dtype, layers, 2 * most + 1, device=device, **LAYOUT)
    g = torch.Generator().manual_seed(0)
    scattered = torch.randperm(2 * most, generator=g)[:most].tolist()  # device ids in no order, as evictions are
    rows = []
    for path in CopyPath:
        host = HostPool(pool, 2 * most, path)  # forced: a GPU that cannot map the host pages fails at the copy
        owned = host.allocate(2 * most)
        orders = {"consecutive": owned[:most],
                  "scattered": [owned[i] for i in torch.randperm(2 * most, generator=g)[:most].tolist()]}
        for order, host_pages in orders.items():
            for b in batches:
                nbytes = b * host.page_bytes
                store, load = _tier_gbps(host, scattered[:b], host_pages[:b], iters)
                d2h, h2d = _raw_gbps(nbytes, iters, device)
                rows.append({"kv_dtype": kv_dtype, "path": path.value, "host_pages": order, "batch_pages": b,
                             "bytes": nbytes, "store_gbps": store, "load_gbps": load, "raw_d2h_gbps": d2h,
                             "raw_h2d_gbps": h2d})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        host.close()
    return rows


def render(doc: dict) -> str:
    lines = [f"# Host-tier page movement ({doc['gpu']}, {doc['layers']} layers)", "",
             f"Command: `{doc['command']}`. " + __doc__.split("\n\n", 2)[2].replace("\n", " ").strip(), "",
             ("| kv | path | host pages | batch (pages) | MB | store GB/s | raw D2H GB/s | store / raw | load GB/s "
              "| raw H2D GB/s | load / raw |"), "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['kv_dtype']} | {r['path']} | {r['host_pages']} | "
                     f"{r['batch_pages']} | {r['bytes'] / 1e6:.1f} | {r['store_gbps']:.1f} | "
                     f"{r['raw_d2h_gbps']:.1f} | {r['store_gbps'] / r['raw_d2h_gbps']:.2f} | {r['load_gbps']:.1f} | "
                     f"{r['raw_h2d_gbps']:.1f} | {r['load_gbps'] / r['raw_h2d_gbps']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-dtypes", nargs="+", default=["fp8_e4m3", "nvfp4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 512])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--spread-gib", type=float, default=0.0,
                   help="also time a host tier of this many GiB, each batch's host pages drawn from all of it "
                        "(0: not)")
    p.add_argument("--out", default="docs/benchmarks/host_tier_copy.json")
    p.add_argument("--md", default="docs/benchmarks/host_tier_copy.md")
    a = p.parse_args(argv)
    if min(a.batches) < 1 or a.iters < 1 or a.layers < 1:
        p.error("--batches, --iters and --layers must be >= 1")
    if a.spread_gib < 0:
        p.error(f"--spread-gib must be >= 0 (0: no spread rows), got {a.spread_gib}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_tier needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = [r for dt in a.kv_dtypes for r in run(dt, a.layers, a.batches, a.iters, dev)]
    if a.spread_gib > 0:
        rows += [r for dt in a.kv_dtypes for r in run_spread(dt, a.layers, a.batches, a.iters, dev, a.spread_gib)]
    doc = {"gpu": torch.cuda.get_device_name(dev), "layers": a.layers, "rows": rows,
           "command": " ".join(["python -m benchmarks.engine.bench_host_tier", *(argv or sys.argv[1:])])}
    write_doc(doc, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
