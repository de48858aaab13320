"""The transfer benchmark's anchors, measured in the same run as the paths they judge:

- ``raw_grpc``: raw grpcio between two processes of this machine (``benchmarks/transfer/raw_grpc.py``:
  identity serializers, no pool reads or writes), at the prefills' message size, over 1 and 4 channels, with
  gRPC's defaults and with the services' heap and HTTP/2 frame settings; the gRPC path is judged against the
  best 1-channel figure, the stream count it uses.
- ``device_gather``: one ``index_select`` of the benchmark's largest transfer (its pages, every layer, in
  random order) on the decode's device; the cuda-ipc path is judged against it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from svc_common.grpc_server import HTTP2_MAX_FRAME_BYTES

_READY = re.compile(r"raw grpc ready on (\S+)")
REPO_ROOT = Path(__file__).resolve().parents[2]


def raw_grpc(message_bytes: int, total_bytes: int, channels: tuple[int, ...], log_dir: Path,
             timeout_s: float = 300.0, keep_freed: bool = False, max_frame_bytes: int = 0) -> list[dict[str, Any]]:
    """GB/s of raw grpcio, one client process per channel count against one server process; ``keep_freed``:
    both processes with the services' heap setting (``svc_common/host_malloc.py``); ``max_frame_bytes``: the
    HTTP/2 frame size both ends announce (0: gRPC's default; the services announce ``HTTP2_MAX_FRAME_BYTES``)."""
    env = {**os.environ, "NVFP4_KEEP_FREED_BLOCKS": "1" if keep_freed else "0"}
    frame = ["--http2-max-frame-bytes", str(max_frame_bytes)]
    log = (log_dir / f"raw-grpc-server{'-heap' if keep_freed else ''}{'-frame' if max_frame_bytes else ''}.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.transfer.raw_grpc", "serve", *frame], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = server.stdout.readline()
        m = _READY.search(line)
        if m is None:
            raise RuntimeError(f"raw grpc server did not start: {line!r} (log {log.name})")
        out = []
        for c in channels:
            res = subprocess.run([sys.executable, "-m", "benchmarks.transfer.raw_grpc", "client", "--address",
                                  m.group(1), "--total-bytes", str(total_bytes), "--message-bytes", str(message_bytes),
                                  "--channels", str(c), "--repeat", "3", *frame], cwd=REPO_ROOT, capture_output=True,
                                 text=True, timeout=timeout_s, check=True, env=env)
            out.append({**json.loads(res.stdout.strip().splitlines()[-1]), "keep_freed_blocks": keep_freed})
        return out
    finally:
        server.kill()
        server.wait()
        log.close()


def device_gather(device: str, num_pages: int, page_bytes: int, repeat: int = 10) -> dict[str, Any]:
    """GB/s (bytes gathered per second) of one index_select of ``num_pages`` rows of ``page_bytes`` bytes in
    random order out of a pool twice that size, on ``device``."""
    import torch

    dev = torch.device(device)
    pool = torch.randint(0, 255, (2 * num_pages, page_bytes), dtype=torch.uint8, device=dev)
    idx = torch.randperm(2 * num_pages, device=dev)[:num_pages]
    out = torch.empty((num_pages, page_bytes), dtype=torch.uint8, device=dev)
    torch.index_select(pool, 0, idx, out=out)
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.index_select(pool, 0, idx, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.index_select(pool, 0, idx, out=out)
            times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    return {"device": str(dev), "num_pages": num_pages, "page_bytes": page_bytes,
            "bytes": num_pages * page_bytes, "seconds": median, "gb_s": num_pages * page_bytes / median / 1e9}


def _page_bytes(model: Path, kv_dtype: str, page_size: int) -> tuple[int, int]:
    """(bytes of one page of one layer, layers) of the served model."""
    from nvfp4_kernels.kv_layout import bytes_per_token_per_layer

    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return page_size * bytes_per_token_per_layer(kv_dtype, cfg["num_key_value_heads"], head_dim), \
        cfg["num_hidden_layers"]


def measure_anchors(a: argparse.Namespace, model: Path, log_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"message_bytes": a.message_bytes}
    if set(a.paths) & {"grpc", "grpc-lanes", "nixl"}:
        out["raw_grpc"] = raw_grpc(a.message_bytes, a.anchor_bytes, (1, 4), log_dir) + \
            raw_grpc(a.message_bytes, a.anchor_bytes, (1,), log_dir, keep_freed=True) + \
            raw_grpc(a.message_bytes, a.anchor_bytes, (1, 4), log_dir, keep_freed=True,
                     max_frame_bytes=HTTP2_MAX_FRAME_BYTES)
        print(f"raw grpcio: {[round(r['best_gb_s'], 2) for r in out['raw_grpc']]} GB/s on 1/4 channels; 1 with the "
              f"services' heap setting; 1/4 with it and the services' HTTP/2 frame size", flush=True)
    if "cuda-ipc" in a.paths or a.device == "cuda":
        page_bytes, layers = _page_bytes(model, a.kv_dtypes[0], a.page_size)
        layers = a.num_layers or layers
        pages = -(-max(a.lengths) // a.page_size) * layers
        out["device_gather"] = device_gather(a.device, pages, page_bytes)
        print(f"device gather: {out['device_gather']['gb_s']:.1f} GB/s ({pages} pages of {page_bytes} B)", flush=True)
    return out


def attach_anchors(rows: list[dict[str, Any]], anchors: dict[str, Any]) -> None:
    """Each row's anchor: raw grpcio on one channel for grpc (the fastest of its settings), on any channel count
    for grpc-lanes (several streams: the best raw figure at all), the device gather for cuda-ipc, and for nixl
    the device gather on a GPU (UCX moves VRAM with cuda_ipc there) or raw grpcio on the CPU (UCX over tcp);
    and the share of it the ready transfer reached."""
    raws = anchors.get("raw_grpc", [])
    raw = max((r["best_gb_s"] for r in raws if r["channels"] == 1), default=None)
    raw_any = max((r["best_gb_s"] for r in raws), default=None)
    gather = anchors.get("device_gather", {}).get("gb_s")
    on_gpu = str(anchors.get("device_gather", {}).get("device", "")).startswith("cuda")
    by_path = {"cuda-ipc": gather, "grpc-lanes": raw_any, "nixl": gather if on_gpu else raw}
    for row in rows:
        anchor = by_path.get(row["path"], raw)
        got = row.get("ready_transfer_gbps")
        row["anchor_gbps"] = anchor
        row["of_anchor"] = got / anchor if got and anchor else None
