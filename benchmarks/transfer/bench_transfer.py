"""KV transfer benchmark: gRPC bytes vs CUDA IPC, nvfp4 vs fp8_e4m3, long prompts, each path against its anchor.

    python -m benchmarks.transfer.bench_transfer [--prefill-gpu 0 --decode-gpu 0] [--lengths 32768 163840]
        [--model DIR [--num-layers N]] [--paths grpc cuda-ipc [nixl]] [--kv-dtypes nvfp4 fp8_e4m3]

For each KV dtype it starts one prefill service and one decode service per path (``--kv-transfer grpc``, the
same with ``--kv-grpc-lanes`` (path grpc-lanes: each transfer over several streams and connections) and
``--kv-transfer cuda-ipc``; ``nixl`` too when asked for: the prefills then run ``--kv-transfer nixl``, which
the grpc and cuda-ipc decodes meet under their own rules), all at once, on the given GPUs (one GPU works: two processes on one GPU still
use CUDA IPC). Then, one request at a time on idle services, a unique random prompt per (dtype, length, path)
goes through Decode.Generate, and it records: TTFT (client), prefill compute (the prefill's own time), the
transfer (the decode's time from header to last page in, copies complete; pages stream while the prefill
computes), its bytes, the path the decode's metrics say was taken, and single-sequence decode tok/s. Then the
same prompt again (``--ready-repeats`` times, the best kept, as the anchors keep theirs): the prefill's prefix
cache holds its pages, so they are all ready at once and the transfer runs at the path's own speed ("ready"
columns). Then the same prompt through the decode's own engine (no prefill: the colocated prompt path): the
prefill service's compute against it ("prefill vs colocated": colocated TTFT / prefill compute, 1.0 = as many
prompt tokens per second). Anchors from the same run
(``benchmarks/transfer/anchors.py``): raw grpcio between two processes (identity serializers, the same message
size, 1 and 4 channels) for the gRPC path, and one device gather of the same pages for cuda-ipc. It prints
tables and writes docs/benchmarks/transfer.json and .md.

Without ``--model`` it writes (once, cached under --model-cache) a random-weight checkpoint with Qwen3-8B's
attention and MLP shapes (32 query / 8 KV heads, head_dim 128, hidden 4096, MLP 12288), ``--layers`` layers
and a small vocabulary: transfer bytes and prefill compute both scale with the layer count, so the transfer
share does not depend on it, and four layers keep the whole run to a couple of minutes on one H200.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.transfer.anchors import attach_anchors, measure_anchors
from benchmarks.transfer.report import GOAL_RATIO, anchor_table, ratio_table, summarize, table, write
from benchmarks.transfer.services import (
    Service,
    delta,
    flush_decode_cache,
    invocation,
    metrics,
    spawn,
    stop_all,
    wait_ready,
)
from decode_svc.transfer_phases import PHASES
from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc
from prefill_svc.config import KV_SENDERS

TRANSPORTS = ("grpc", "cuda-ipc", "nixl")  # the decode's --kv-transfer (and its metrics' path label)
GRPC_LANES = "grpc-lanes"  # grpc with the decode's --kv-grpc-lanes (--grpc-lanes of this script)
PATHS = ("grpc", GRPC_LANES, "cuda-ipc", "nixl")
DEFAULT_PATHS = ("grpc", GRPC_LANES, "cuda-ipc")  # nixl needs the optional nixl extra on both ends


def transport(path: str) -> str:
    """The transfer mode a benchmark path runs (grpc-lanes is grpc with several streams)."""
    return "grpc" if path == GRPC_LANES else path
KV_DTYPES = ("nvfp4", "fp8_e4m3")
MODEL_SHAPE = {"arch": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_heads": 32,
               "num_kv_heads": 8, "head_dim": 128, "vocab_size": 4096, "rope_theta": 1e6,
               "max_position_embeddings": 262144}
_GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("bench_transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint (default: the generated Qwen3-8B-shaped one)")
    p.add_argument("--layers", type=int, default=4, help="layers of the generated model")
    p.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "nvfp4-bench-transfer-model"))
    p.add_argument("--num-layers", type=int, default=None, help="passed to the services (serve the first N)")
    p.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    p.add_argument("--lengths", nargs="+", type=int, default=[32768, 163840], help="prompt lengths (tokens)")
    p.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), choices=PATHS)
    p.add_argument("--grpc-lanes", type=int, default=4, help="the grpc-lanes path's decode --kv-grpc-lanes")
    p.add_argument("--kv-sender", default="auto", choices=KV_SENDERS,
                   help="the prefills' --kv-sender: which process sends the grpc path's page bytes")
    p.add_argument("--kv-exports-ahead", type=int, default=0,
                   help="the prefills' --kv-exports-ahead: page exports in flight per transfer (0: their default)")
    p.add_argument("--prefill-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the prefill services")
    p.add_argument("--decode-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the decode services")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--message-bytes", type=int, default=4 << 20,
                   help="the prefills' --kv-message-bytes, and the raw grpcio anchor's message size")
    p.add_argument("--ready-repeats", type=int, default=3,
                   help="ready transfers per row; the best is reported, as the raw grpcio anchor's best of 3")
    p.add_argument("--compute-repeats", type=int, default=3,
                   help="unique prompts per row whose prefill compute is set against the colocated engine's on the "
                        "same prompt; the row's 'prefill vs colocated' is the median ratio")
    p.add_argument("--anchor-bytes", type=int, default=1 << 30, help="bytes each raw grpcio anchor run moves")
    p.add_argument("--warmup-len", type=int, default=1024,
                   help="prompt of the first warm-up request per decode (then one more at every measured length)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="service logs (default: a temporary directory)")
    p.add_argument("--out-json", default="docs/benchmarks/transfer.json")
    p.add_argument("--out-md", default="docs/benchmarks/transfer.md")
    return p


def prepare_model(a: argparse.Namespace) -> Path:
    if a.model:
        return Path(a.model)
    from offline.tiny_model import make_tiny_model

    out = Path(a.model_cache) / f"qwen3-8b-shape-{a.layers}l"
    if not (out / "config.json").exists():
        kw = {"device": "cuda"} if a.device == "cuda" and "device" in inspect.signature(make_tiny_model).parameters \
            else {}
        t0 = time.perf_counter()
        make_tiny_model(out, num_layers=a.layers, seed=a.seed, **MODEL_SHAPE, **kw)
        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def gpu_name(a: argparse.Namespace) -> str:
    if a.device != "cuda":
        return "none (CPU smoke run)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", a.prefill_gpu],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        return out.splitlines()[0] if out else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def start_services(a: argparse.Namespace, model: Path, log_dir: Path) -> dict[str, dict[str, Service]]:
    """{kv_dtype: {"prefill": svc, "<path>": decode svc}}: the prefills first, then decodes naming them."""
    pool_tokens = max(a.lengths) + a.warmup_len + a.decode_tokens + 64 * a.page_size
    started: dict[str, dict[str, Service]] = {}
    every: list[Service] = []
    try:
        commons = {}
        for kv in a.kv_dtypes:
            common = ["--model", str(model), "--device", a.device, "--dtype", a.dtype, "--kv-cache-dtype", kv,
                      "--page-size", str(a.page_size), "--max-total-tokens", str(pool_tokens),
                      "--chunked-prefill-size", str(a.chunked_prefill_size)]
            if a.num_layers is not None:
                common += ["--num-layers", str(a.num_layers)]
            commons[kv] = common
            started[kv] = {"prefill": spawn(f"prefill-{kv}", "prefill_svc",
                                            [*common, "--kv-hold-timeout", "300",
                                             "--kv-message-bytes", str(a.message_bytes), "--kv-sender", a.kv_sender,
                                             "--kv-exports-ahead", str(a.kv_exports_ahead),
                                             *(["--kv-transfer", "nixl"] if "nixl" in a.paths else [])],
                                            log_dir, a.prefill_gpu if a.device == "cuda" else None)}
            every.append(started[kv]["prefill"])
        wait_ready(every, a.startup_timeout)
        for kv in a.kv_dtypes:
            for path in a.paths:
                lanes = ["--kv-grpc-lanes", str(a.grpc_lanes)] if path == GRPC_LANES else []
                started[kv][path] = spawn(f"decode-{kv}-{path}", "decode_svc",
                                          [*commons[kv], "--kv-transfer", transport(path), *lanes,
                                           "--prefill-addresses", started[kv]["prefill"].address],
                                          log_dir, a.decode_gpu if a.device == "cuda" else None)
                every.append(started[kv][path])
        wait_ready(every, a.startup_timeout)
    except BaseException:
        for s in every:
            s.stop()
        raise
    return started


def _ratio(colocated_s: float, prefill_s: float) -> float | None:
    """Prefill vs colocated for one prompt: colocated TTFT / the prefill service's compute (None if unmeasured)."""
    return colocated_s / prefill_s if prefill_s > 0 else None


def colocated_ttft(decode: Service, rid: str, ids: list[int]) -> float:
    """TTFT of ``ids`` prefilled by ``decode``'s own engine (no prefill address: the colocated deployment's
    prompt path, the same engine code and chunk size), on idle services; its cache flushed after."""
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    req = decode_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling=sp)
    ttft = None
    with grpc.insecure_channel(decode.address, options=_GRPC_OPTIONS) as ch:
        t0 = time.perf_counter()
        for m in decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=1800):
            if m.token_ids:
                ttft = time.perf_counter() - t0
                break
    flush_decode_cache(decode.address)
    if ttft is None:
        raise RuntimeError(f"decode {decode.address} ended request {rid} without a token (see its log)")
    return ttft


def run_one(prefill: Service, decode: Service, rid: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One request on idle services; the numbers come from the client clock and metric deltas."""
    pb, db = metrics(prefill.address, "prefill"), metrics(decode.address, "decode")
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = decode_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling=sp, prefill_address=prefill.address)
    stamps: list[tuple[float, int]] = []
    with grpc.insecure_channel(decode.address, options=_GRPC_OPTIONS) as ch:
        t0 = time.perf_counter()
        for m in decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=1800):
            if m.token_ids:
                stamps.append((time.perf_counter(), len(m.token_ids)))
    pa, da = metrics(prefill.address, "prefill"), metrics(decode.address, "decode")
    flush_decode_cache(decode.address)
    ttft = stamps[0][0] - t0
    n_after = sum(n for _, n in stamps[1:])
    span = stamps[-1][0] - stamps[0][0]
    transfer_s = delta(da, db, "nvfp4_decode_kv_transfer_seconds_total")
    copy_s = delta(da, db, "nvfp4_decode_kv_transfer_copy_seconds_total")
    nbytes = delta(da, db, "nvfp4_decode_kv_transfer_bytes_total")
    used = [p for p in TRANSPORTS if delta(da, db, f'nvfp4_decode_kv_transfer_path_total{{path="{p}"}}') > 0]
    phases = {name: delta(da, db, f'nvfp4_decode_kv_transfer_phase_seconds_total{{phase="{name}"}}')
              for name in PHASES}
    # the prefill's sender process (--kv-sender process), where it sent the bytes: its exports' time and its
    # stream's waits for them (None where the engine's process sent them: it keeps no such counters)
    sent_by_process = any(k.startswith("nvfp4_prefill_sender_transfers_total") for k in pa)
    sender = {k: delta(pa, pb, f"nvfp4_prefill_sender_{k}_seconds_total") if sent_by_process else None
              for k in ("export", "export_wait")}
    return {
        "ttft_s": ttft, "prefill_compute_s": delta(pa, pb, "nvfp4_prefill_ttft_seconds_sum"),
        "prefill_wait_s": delta(da, db, "nvfp4_decode_kv_transfer_wait_seconds_total"),
        "transfer_s": transfer_s, "transfer_share": transfer_s / ttft if ttft > 0 else None,
        "transfer_bytes": int(nbytes), "transfer_mb": nbytes / 1e6,
        "transfer_gbps": nbytes / transfer_s / 1e9 if transfer_s > 0 else None,
        "copy_s": copy_s, "copy_gbps": nbytes / copy_s / 1e9 if copy_s > 0 else None, "phases_s": phases,
        "sender_export_s": sender["export"], "sender_export_wait_s": sender["export_wait"],
        "path_used": used[0] if len(used) == 1 else "/".join(used) or "none",
        "generated_tokens": sum(n for _, n in stamps),
        "decode_tok_s": n_after / span if span > 0 and n_after else None,
    }


def main(argv: list[str] | None = None) -> int:
    a = build_arg_parser().parse_args(argv)
    if a.ready_repeats < 1:
        build_arg_parser().error(f"--ready-repeats must be >= 1, got {a.ready_repeats}")
    if a.compute_repeats < 1:
        build_arg_parser().error(f"--compute-repeats must be >= 1, got {a.compute_repeats}")
    model = prepare_model(a)
    cfg = json.loads((model / "config.json").read_text())
    vocab = cfg["vocab_size"]
    rng = random.Random(a.seed)

    def unique_prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="bench-transfer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    services = start_services(a, model, log_dir)
    print(f"{sum(len(g) for g in services.values())} services ready in {time.perf_counter() - t_start:.1f} s "
          f"(logs in {log_dir})", flush=True)
    rows: list[dict[str, Any]] = []
    anchors = measure_anchors(a, model, log_dir)
    try:
        for kv, group in services.items():
            for path in a.paths:  # compiles kernels and opens the IPC share outside the measurements
                run_one(group["prefill"], group[path], f"warm-{kv}-{path}", unique_prompt(a.warmup_len), 2)
                # and once at every measured length: the first long prompt of a process pays one-off costs
                # (allocator growth, kernels specialised for the new shapes, the decode's CUDA graph of that
                # width) that would otherwise land in whichever measurement comes first
                for n in a.lengths:
                    run_one(group["prefill"], group[path], f"warm-{kv}-{n}-{path}", unique_prompt(n),
                            a.decode_tokens)
                    # the decode's own prompt path too: its first local extend compiles its kernels
                    colocated_ttft(group[path], f"warm-{kv}-{n}-{path}-colocated", unique_prompt(n))
            for n in a.lengths:
                for path in a.paths:
                    ids = unique_prompt(n)
                    r = run_one(group["prefill"], group[path], f"{kv}-{n}-{path}", ids, a.decode_tokens)
                    # the same prompt again: the prefill's cache holds its pages, so they are ready at once
                    # and the transfer runs at the path's own speed (the decode's cache was flushed); the best of
                    # --ready-repeats, the statistic of the raw grpcio anchor (best of its repeats)
                    readies = [run_one(group["prefill"], group[path], f"{kv}-{n}-{path}-ready{k}", ids, 2)
                               for k in range(a.ready_repeats)]
                    ready = max(readies, key=lambda x: x["transfer_gbps"] or 0.0)
                    r.update({f"ready_{k}": ready[k] for k in ("transfer_s", "transfer_gbps", "copy_gbps",
                                                                "transfer_bytes", "path_used", "phases_s",
                                                                "sender_export_s", "sender_export_wait_s")})
                    r["ready_gbps_each"] = [x["transfer_gbps"] for x in readies]
                    # the colocated engine's prompt path on the same prompt (the decode's own prefill), and so for
                    # --compute-repeats - 1 more unique prompts: one prompt's ratio moves by a few points
                    r["colocated_ttft_s"] = colocated_ttft(group[path], f"{kv}-{n}-{path}-colocated", ids)
                    ratios = [_ratio(r["colocated_ttft_s"], r["prefill_compute_s"])]
                    for k in range(1, a.compute_repeats):
                        more = unique_prompt(n)
                        cold = run_one(group["prefill"], group[path], f"{kv}-{n}-{path}-compute{k}", more, 2)
                        ratios.append(_ratio(colocated_ttft(group[path], f"{kv}-{n}-{path}-colocated{k}", more),
                                             cold["prefill_compute_s"]))
                    r["prefill_of_colocated_each"] = ratios
                    measured = [x for x in ratios if x is not None]
                    r["prefill_of_colocated"] = statistics.median(measured) if measured else None
                    rows.append({"kv_dtype": kv, "prompt_len": n, "path": path, **r})
                    print(table([rows[-1]]).splitlines()[-1], flush=True)
                    if r["path_used"] != transport(path):
                        print(f"WARNING: asked for {path}, the decode took {r['path_used']} (see its log)",
                              flush=True)
    finally:
        stop_all(services)
    doc = {
        "command": invocation("benchmarks.transfer.bench_transfer", argv),
        "gpu": gpu_name(a), "goal_ratio": GOAL_RATIO, "wall_s": time.perf_counter() - t_start,
        "setup": {"model": str(model) if a.model else f"random weights, Qwen3-8B shapes, vocab {vocab}",
                  "num_layers": a.num_layers or cfg["num_hidden_layers"],
                  "num_kv_heads": cfg["num_key_value_heads"], "head_dim": cfg.get("head_dim"),
                  "page_size": a.page_size, "chunk_size": a.chunked_prefill_size, "decode_tokens": a.decode_tokens, "ready_repeats": a.ready_repeats,
                  "compute_repeats": a.compute_repeats,
                  "prefill_gpu": a.prefill_gpu, "decode_gpu": a.decode_gpu, "device": a.device,
                  "kv_sender": a.kv_sender, "kv_exports_ahead": a.kv_exports_ahead,
                  "grpc_lanes": a.grpc_lanes if GRPC_LANES in a.paths else None},
        "rows": rows, "summary": summarize(rows), "anchors": anchors}
    attach_anchors(rows, anchors)
    write(doc, Path(a.out_json), Path(a.out_md))
    print("\n" + table(rows) + "\n\n" + anchor_table(anchors) + "\n\n" + ratio_table(doc["summary"]), flush=True)
    print(f"\nwrote {a.out_json} and {a.out_md} ({doc['wall_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
