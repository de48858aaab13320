"""``nvfp4-serve bench pd``: the disaggregated deployment against the colocated one, same workload, one run.

    nvfp4-serve bench pd --input-len 32768 --output-len 256 --concurrency 16 --num-prompts 32 \\
        [--deployments colocated pd-ipc pd-grpc pd-grpc-fp8 pd-ipc-unpaced] [--out docs/benchmarks/pd.json] \\
        [--report docs/benchmarks/pd.md] --launch --model DIR [nvfp4-serve up args shared by all ...]

Each deployment is ``nvfp4-serve up`` with the shared args plus its own (one at a time, on the same GPU):

    colocated     --num-prefill 0 --kv-cache-dtype nvfp4        (the decode runs the prompts itself)
    pd-ipc        --num-prefill 1 --kv-transfer cuda-ipc --kv-cache-dtype nvfp4
    pd-grpc       --num-prefill 1 --kv-transfer grpc --kv-cache-dtype nvfp4
    pd-grpc-fp8   --num-prefill 1 --kv-transfer grpc --kv-cache-dtype fp8_e4m3
    pd-ipc-unpaced  as pd-ipc with --shared-gpu-decode-interval-ms 0 (on one GPU: what pacing the decode buys)
    pd-nixl       --num-prefill 1 --kv-transfer nixl --kv-cache-dtype nvfp4  (asked for by name: needs the nixl extra)
    pd-grpc-lanes4, pd-grpc-fp8-lanes4   as pd-grpc, pd-grpc-fp8 with --decode-args '--kv-grpc-lanes 4' (by name)
    colocated-fp8   --num-prefill 0 --kv-cache-dtype fp8_e4m3  (by name)
    colocated-sync, colocated-fp8-sync   as colocated, colocated-fp8 with --disable-overlap-schedule: each decode
                    step read before the next is launched (by name; what overlap scheduling buys, e.g. one user
                    at 32K: --concurrency 1)

One point each (the workload above, random prompts, warm-up first); per deployment TTFT mean / median /
p99, ITL p50 / p99, input and output tok/s, and from the decode's metrics the transfer bytes, the time
from each transfer's header to its last page, and the time its pool writes took (copy rate). The report
gives PD / colocated ratios, nvfp4 / fp8 in PD over gRPC and, for the colocated pairs run, overlap scheduling
on against off (output tok/s, TPOT = ITL p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.config import BenchConfig, Target
from benchmarks.serving.launch import LaunchedDeployment
from benchmarks.serving.runner import Session, run_point
from benchmarks.serving.server import describe_deployment, gpu_name

SCHEMA = "nvfp4-serve/bench-pd/1"
DEPLOYMENTS: dict[str, list[str]] = {
    "colocated": ["--num-prefill", "0", "--kv-cache-dtype", "nvfp4"],
    "pd-ipc": ["--num-prefill", "1", "--kv-transfer", "cuda-ipc", "--kv-cache-dtype", "nvfp4"],
    "pd-grpc": ["--num-prefill", "1", "--kv-transfer", "grpc", "--kv-cache-dtype", "nvfp4"],
    "pd-grpc-fp8": ["--num-prefill", "1", "--kv-transfer", "grpc", "--kv-cache-dtype", "fp8_e4m3"],
    # what pacing the decode on a shared GPU buys: the cuda-ipc deployment with it off
    "pd-ipc-unpaced": ["--num-prefill", "1", "--kv-transfer", "cuda-ipc", "--kv-cache-dtype", "nvfp4",
                       "--shared-gpu-decode-interval-ms", "0"],
    "pd-nixl": ["--num-prefill", "1", "--kv-transfer", "nixl", "--kv-cache-dtype", "nvfp4"],
    # gRPC with each transfer over 4 streams and connections (the decode's --kv-grpc-lanes)
    "pd-grpc-lanes4": ["--num-prefill", "1", "--kv-transfer", "grpc", "--kv-cache-dtype", "nvfp4",
                       "--decode-args", "--kv-grpc-lanes 4"],
    "pd-grpc-fp8-lanes4": ["--num-prefill", "1", "--kv-transfer", "grpc", "--kv-cache-dtype", "fp8_e4m3",
                           "--decode-args", "--kv-grpc-lanes 4"],
    "colocated-fp8": ["--num-prefill", "0", "--kv-cache-dtype", "fp8_e4m3"],
    # each decode step read before the next is launched: what overlap scheduling buys
    "colocated-sync": ["--num-prefill", "0", "--kv-cache-dtype", "nvfp4", "--disable-overlap-schedule"],
    "colocated-fp8-sync": ["--num-prefill", "0", "--kv-cache-dtype", "fp8_e4m3", "--disable-overlap-schedule"],
}
DEFAULT_DEPLOYMENTS = ["colocated", "pd-ipc", "pd-grpc", "pd-grpc-fp8", "pd-ipc-unpaced"]  # the others by name
_GRPC_PAIRS = (("pd-grpc", "pd-grpc-fp8"), ("pd-grpc-lanes4", "pd-grpc-fp8-lanes4"))  # nvfp4 vs fp8 in PD
_OVERLAP_PAIRS = (("colocated", "colocated-sync"), ("colocated-fp8", "colocated-fp8-sync"))  # overlap on / off
_OWN_FLAGS = ("--num-prefill", "--kv-transfer", "--kv-cache-dtype", "--shared-gpu-decode-interval-ms")
_OWN_SWITCHES = ("--disable-overlap-schedule",)  # flags without a value that the deployments set themselves


def add_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per deployment first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deployments", nargs="+", default=DEFAULT_DEPLOYMENTS, choices=list(DEPLOYMENTS))
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=None, help="launcher logs (default: beside --out)")
    p.add_argument("--out", default="docs/benchmarks/pd.json")
    p.add_argument("--report", default="docs/benchmarks/pd.md")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--launch", nargs="...", required=True, metavar="UP_ARGS",
                   help="`nvfp4-serve up` args shared by every deployment (must come last)")


def _strip(args: list[str], flags: tuple[str, ...], switches: tuple[str, ...] = ()) -> list[str]:
    """``args`` without ``flags`` (and their values) and ``switches`` (flags without a value)."""
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        elif x not in switches and not any(x.startswith(f + "=") for f in flags):
            out.append(x)
    return out


def _with_own(shared: list[str], own: list[str]) -> list[str]:
    """``up`` args of a deployment: the shared ones, then its own; a ``--decode-args`` of both is joined
    (the shared flags first), not replaced."""
    if "--decode-args" not in own:
        return [*shared, *own]
    extra = []
    for i, x in enumerate(shared):
        if x == "--decode-args" and i + 1 < len(shared):
            extra.append(shared[i + 1])
        elif x.startswith("--decode-args="):
            extra.append(x.split("=", 1)[1])
    at = own.index("--decode-args")
    joined = " ".join([*extra, own[at + 1]])
    return [*_strip(shared, ("--decode-args",)), *own[:at], "--decode-args", joined, *own[at + 2:]]


def _bytes_ratio(nv: dict[str, Any], f8: dict[str, Any]) -> str:
    """nvfp4 / fp8 transfer bytes per prompt token (the transfers counted are those that completed inside the
    measured window, which need not be as many for both)."""
    a, b = nv.get("bytes_per_token"), f8.get("bytes_per_token")
    if not a or not b:
        return "- transfer bytes per token: not measured"
    return (f"- transfer bytes per token: {a:,.0f} vs {b:,.0f}, {a / b:.4f}x (0.5625x is the format's ratio: 9 "
            f"bytes per 16 values against 16)")


def _transfer(metrics: dict[str, float]) -> dict[str, Any]:
    """The decode's transfer figures of one point (metric deltas summed over decode workers)."""
    num_bytes = metrics.get("kv_transfer_bytes_total", 0.0)
    seconds = metrics.get("kv_transfer_seconds_total", 0.0)
    copy = metrics.get("kv_transfer_copy_seconds_total", 0.0)
    tokens = metrics.get("kv_transfer_tokens_total", 0.0)
    return {"bytes": num_bytes, "tokens": tokens, "bytes_per_token": num_bytes / tokens if tokens else None,
            "header_to_last_page_s": seconds, "copy_s": copy,
            "copy_gb_s": num_bytes / copy / 1e9 if copy else None,
            "wait_s": metrics.get("kv_transfer_wait_seconds_total", 0.0)}


def _prefill_ms(metrics: dict[str, float]) -> float | None:
    """The prefill services' mean time from a prompt's submit to its last layer computed (their
    ``ttft_seconds``: queueing in the prefill's scheduler included), over the measured requests."""
    n = metrics.get("ttft_seconds_count", 0.0)
    return 1e3 * metrics.get("ttft_seconds_sum", 0.0) / n if n else None


def _summary(point: dict[str, Any]) -> dict[str, Any]:
    t, i = point["ttft_ms"], point["itl_ms"]
    prefill_ms = _prefill_ms(point["server"].get("prefill_metrics", {}).get("sum", {}))
    return {"completed": point["completed"], "failed": point["failed"], "ttft_mean_ms": t["mean"],
            "ttft_median_ms": t["median"], "ttft_p99_ms": t["p99"], "itl_p50_ms": i["median"], "itl_p99_ms": i["p99"],
            "input_tok_s": point["input_tok_s"], "output_tok_s": point["output_tok_s"],
            "prefill_ms": prefill_ms,
            "after_prefill_ms": None if prefill_ms is None else t["mean"] - prefill_ms,
            "transfer": _transfer(point["server"]["decode_metrics"].get("sum", {}))}


async def _one(base_url: str, cfg: BenchConfig, progress: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    session = await Session.connect(Target(base_url, "", "", "", True))
    point = await run_point(session, cfg, progress)
    return session.info, point


def run(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    shared = _strip(a.launch, _OWN_FLAGS, _OWN_SWITCHES)
    out = Path(a.out)
    log_dir = Path(a.log_dir) if a.log_dir else out.parent / "pd-logs"
    cfg = BenchConfig(input_len=a.input_len, output_len=a.output_len, concurrency=a.concurrency,
                      num_prompts=a.num_prompts, seed=a.seed, warmup=a.warmup)
    doc: dict[str, Any] = {"schema": SCHEMA, "command": "nvfp4-serve bench pd " + " ".join(argv),
                           "shared_up_args": shared, "workload": {"input_len": a.input_len,
                           "output_len": a.output_len, "concurrency": a.concurrency, "num_prompts": a.num_prompts},
                           "deployments": {}}
    for name in a.deployments:
        args = _with_own(shared, DEPLOYMENTS[name])
        record: dict[str, Any] = {"up_args": args, "status": "failed"}
        doc["deployments"][name] = record
        t0 = time.perf_counter()
        deployment = LaunchedDeployment(args, log_dir / f"{name}.launch.log", a.launch_timeout)
        try:
            base_url = deployment.start()
            info, point = asyncio.run(_one(base_url, cfg, a.progress))
            doc.setdefault("gpu", gpu_name(info, base_url, args))
            record.update(status="ok", summary=_summary(point), deployment=describe_deployment(info, args),
                          point=point)
            print(f"[{name}] {json.dumps(record['summary'])}", flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded; the next deployment runs
            record["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)
        finally:
            record["exit_code"] = deployment.stop()
            record["wall_s"] = round(time.perf_counter() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")  # compact: per-request records
    return doc


def _f(x: Any, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(a: Any, b: Any) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def report(doc: dict[str, Any]) -> str:
    """The markdown report of a ``bench pd`` document."""
    w = doc["workload"]
    deps = {k: v for k, v in doc["deployments"].items() if v.get("status") == "ok"}
    lines = ["# Disaggregated prefill/decode vs colocated serving", "",
             f"Command: `{doc['command']}`", "",
             (f"GPU: {doc.get('gpu', '?')}. Workload: {w['num_prompts']} random prompts of {w['input_len']:,} tokens, "
             f"{w['output_len']} output tokens each, {w['concurrency']} in flight; one deployment at a time on the "
             "same machine, each `nvfp4-serve up` with the shared args plus its own (the table's first column)."), "",
             ("| deployment | up args | TTFT mean / median / p99 ms | ITL p50 / p99 ms | input tok/s | output tok/s | "
             "transfer MB | header->last page s | copy GB/s |"), "|---|---|---|---|---|---|---|---|---|"]
    for name, rec in deps.items():
        s, t = rec["summary"], rec["summary"]["transfer"]
        own = " ".join(DEPLOYMENTS[name])
        lines.append(f"| {name} | `{own}` | {_f(s['ttft_mean_ms'])} / {_f(s['ttft_median_ms'])} / {_f(s['ttft_p99_ms'])} "
                     f"| {_f(s['itl_p50_ms'], 1)} / {_f(s['itl_p99_ms'], 1)} | {_f(s['input_tok_s'])} | "
                     f"{_f(s['output_tok_s'], 1)} | {_f(t['bytes'] / 1e6, 1)} | {_f(t['header_to_last_page_s'], 2)} | "
                     f"{_f(t['copy_gb_s'], 1)} |")
    for name, rec in doc["deployments"].items():
        if rec.get("status") != "ok":
            lines.append(f"| {name} | failed: {rec.get('error', '?')[:200]} | | | | | | | |")
    col = deps.get("colocated", {}).get("summary")
    if col:
        lines += ["", "## Against colocated (same run)", "",
                  "| deployment | output tok/s | TTFT mean | ITL p99 ms |", "|---|---|---|---|"]
        for name, rec in deps.items():
            if name != "colocated":
                s = rec["summary"]
                lines.append(f"| {name} | {_ratio(s['output_tok_s'], col['output_tok_s'])} | "
                             f"{_ratio(s['ttft_mean_ms'], col['ttft_mean_ms'])} | {_f(s['itl_p99_ms'], 1)} |")
    for nv, f8 in _GRPC_PAIRS:
        g4, g8 = deps.get(nv, {}).get("summary"), deps.get(f8, {}).get("summary")
        if g4 and g8:
            lines += ["", f"## nvfp4 vs fp8_e4m3, both PD over gRPC ({nv} / {f8})", "",
                      _bytes_ratio(g4["transfer"], g8["transfer"]),
                      f"- TTFT mean: {_ratio(g4['ttft_mean_ms'], g8['ttft_mean_ms'])}",
                      (f"- TTFT mean past the prefill service's own time (submit to last layer, its queue "
                       f"included): {_f(g4.get('after_prefill_ms'))} vs {_f(g8.get('after_prefill_ms'))} ms, "
                       f"{_ratio(g4.get('after_prefill_ms'), g8.get('after_prefill_ms'))}; the prefill's own: "
                       f"{_f(g4.get('prefill_ms'))} vs {_f(g8.get('prefill_ms'))} ms"),
                      f"- output tok/s: {_ratio(g4['output_tok_s'], g8['output_tok_s'])}"]
    for on, off in _OVERLAP_PAIRS:
        a, b = deps.get(on, {}).get("summary"), deps.get(off, {}).get("summary")
        if a and b:
            lines += ["", f"## Overlap scheduling on / off ({on} / {off})", "",
                      (f"- output tok/s: {_f(a['output_tok_s'], 1)} vs {_f(b['output_tok_s'], 1)}, "
                      f"{_ratio(a['output_tok_s'], b['output_tok_s'])}"),
                      (f"- TPOT (ITL p50): {_f(a['itl_p50_ms'], 2)} vs {_f(b['itl_p50_ms'], 2)} ms; one user's tok/s "
                      f"1 / TPOT: {_f(1e3 / a['itl_p50_ms'] if a['itl_p50_ms'] else None)} vs "
                      f"{_f(1e3 / b['itl_p50_ms'] if b['itl_p50_ms'] else None)}"),
                      f"- TTFT mean: {_ratio(a['ttft_mean_ms'], b['ttft_mean_ms'])}"]
    lines += ["", ("Transfer columns come from the decode's metrics over the measured requests: bytes received, the "
              "time from each transfer's header to its last page (pages stream while the prefill computes, so this "
              "includes the prompt's compute after its first chunk), and the time the pool writes took on the "
              "decode's copy threads (copy GB/s = bytes / that time). `python -m benchmarks.transfer.bench_transfer` "
              "measures each path's transport rate against raw grpcio and a device gather."), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser("nvfp4-serve bench pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pd_args(p)
    a = p.parse_args(argv)
    doc = run(a, argv)
    text = report(doc)
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    Path(a.report).write_text(text)
    print(text, flush=True)
    return 0 if all(r.get("status") == "ok" for r in doc["deployments"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
