"""``nvfp4-serve bench --trace FILE --concurrency C1 C2 ...``: replay a multi-turn trace at each concurrency.

    --base-url URL | --launch [nvfp4-serve up args...]     (--launch must come last)
    [--kv-dtypes fp8_e4m3 nvfp4 [--equal-pool-bytes FP8_TOKENS]]   one launched deployment per KV dtype
    [--host-cache-sizes 0 pool ...]           and per host tier size (`pool`: the GPU pool's bytes)
    [--sessions-per-concurrency M | --sessions-per-point N] [--think-time-scale X] [--max-point-duration-s S]
    [--out results.json] [--report docs/benchmarks/agentic.md]

Per deployment: a short unmeasured warmup (the first session's first turns), then for each concurrency a point
(``benchmarks.agentic.replay``: flush, counters, sessions, counters, integrity). The results file holds one
*run* per deployment, each with its points; it is rewritten after every point. The exit code is 1 when any
point failed its integrity check (or sent no successful turn), after everything was written.

``--equal-pool-bytes N`` gives each dtype's pool the bytes of N FP8 tokens (``--max-total-tokens`` scaled
by the bytes per token: nvfp4 holds 16/9 as many, bf16 half as many). CPU pools are sized in tokens, so a
fair CPU comparison needs it; on a GPU it pins the pool instead of ``--mem-fraction-static`` (which already
gives every dtype the same bytes), so that a trace sized for it saturates where intended.

Every decode worker's gRPC port (from /server_info) must be reachable from here, without TLS: the counters and
the integrity checks go there directly.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.agentic import trace as trace_format
from benchmarks.agentic.prompts import PromptBuilder
from benchmarks.agentic.replay import PointConfig, replay_sessions, run_point
from benchmarks.agentic.trace import SessionTrace, Trace, TraceError
from benchmarks.serving.client import make_http_client
from benchmarks.serving.config import Target
from benchmarks.serving.launch import LaunchedDeployment
from benchmarks.serving.launch_args import KEY_ENVS, LAUNCH_FLAG, flag_value, resolve_api_key, split_launch
from benchmarks.serving.report import write_json
from benchmarks.serving.runner import BenchError, Session, run_benchmark
from benchmarks.serving.server import describe_deployment, gpu_name
from svc_common.cli_help import HelpFormatter

SCHEMA = "nvfp4-serve/bench-agentic/1"
KV_DTYPES = ("bf16", "fp8_e4m3", "nvfp4")  # as nvfp4_kernels.kv_layout.KV_DTYPES (not imported: it pulls in torch)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvfp4-serve bench --trace", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--trace", required=True,
                   help="trace file (JSONL; `nvfp4-serve bench gen-trace` writes one)")
    p.add_argument("--concurrency", type=int, nargs="+", required=True, help="sessions in flight, per point")
    w = p.add_argument_group("workload")
    w.add_argument("--sessions-per-concurrency", type=int, default=2,
                   help="M: a point replays the first M x C sessions of the trace (capped by the trace)")
    w.add_argument("--sessions-per-point", type=int, default=None, help="N sessions at every point instead")
    w.add_argument("--think-time-scale", type=float, default=1.0, help="multiply the trace's think times")
    w.add_argument("--max-point-duration-s", type=float, default=math.inf,
                   help="no new turn after this many seconds of a point (default: none)")
    w.add_argument("--warmup-turns", type=int, default=2,
                   help="turns of the first session run unmeasured before the first point (0: none)")
    d = p.add_argument_group("deployment")
    d.add_argument("--base-url", help="router URL, e.g. http://127.0.0.1:8000")
    d.add_argument(LAUNCH_FLAG, nargs="...", metavar="UP_ARGS",
                   help="start `nvfp4-serve up UP_ARGS` (once per --kv-dtypes entry); must come last")
    d.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=None,
                   help="with --launch: one deployment per KV dtype, in this order")
    d.add_argument("--equal-pool-bytes", type=int, default=None, metavar="FP8_TOKENS",
                   help="with --launch: every pool gets the bytes of FP8_TOKENS fp8 tokens (CPU runs)")
    d.add_argument("--host-cache-sizes", nargs="+", default=None, metavar="SIZE",
                   help="with --launch: one deployment per KV dtype and host tier size (`--host-cache-size` of "
                        "`up`: 0 for none, bytes like 8GiB, tokens like 64Ktokens, or `pool` for the bytes of "
                        "the GPU pool, which needs --equal-pool-bytes or --max-total-tokens)")
    d.add_argument("--launch-timeout", type=float, default=900.0, help="seconds a deployment may take to start")
    d.add_argument("--launch-log", default=None, help="launcher log (default: OUT.<dtype>.launch.log)")
    d.add_argument("--model", default="", help="model id to request (default: the router's)")
    d.add_argument("--tokenizer", default="", help="tokenizer dir (default: the router's --model-dir)")
    d.add_argument("--api-key", default="",
                   help=f"bearer token (default: ${KEY_ENVS[0]} or ${KEY_ENVS[1]})")
    m = p.add_argument_group("measurement and output")
    m.add_argument("--request-timeout-s", type=float, default=3600.0, help="HTTP read timeout of one turn")
    m.add_argument("--sample-interval-s", type=float, default=0.5, help="/server_info pool sampling period")
    m.add_argument("--peak-window-s", type=float, default=1.0, help="window of the peak output throughput")
    m.add_argument("--num-gpus", type=int, default=1, help="GPUs the deployment uses (for per-GPU figures)")
    m.add_argument("--save-turns", action=argparse.BooleanOptionalAction, default=True,
                   help="keep every turn's timings in the JSON")
    m.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    m.add_argument("--out", default=None, help="results JSON")
    m.add_argument("--report", default=None, help="also write this markdown report (PNGs beside it)")
    return p


def point_configs(a: argparse.Namespace, num_trace_sessions: int) -> list[PointConfig]:
    """One PointConfig per concurrency (validated; duplicates dropped)."""
    if a.sessions_per_point is None and a.sessions_per_concurrency < 1:
        raise ValueError(f"--sessions-per-concurrency must be >= 1, got {a.sessions_per_concurrency}")
    out = []
    for c in dict.fromkeys(a.concurrency):
        n = a.sessions_per_point if a.sessions_per_point is not None else a.sessions_per_concurrency * c
        out.append(PointConfig(
            concurrency=c, num_sessions=min(n, num_trace_sessions) if n >= 1 else n,
            think_time_scale=a.think_time_scale, max_duration_s=a.max_point_duration_s,
            request_timeout_s=a.request_timeout_s, sample_interval_s=a.sample_interval_s,
            peak_window_s=a.peak_window_s, num_gpus=a.num_gpus, save_turns=a.save_turns))
    return out


def pool_tokens_for(kv_dtype: str, fp8_tokens: int) -> int:
    """Tokens of a ``kv_dtype`` pool with the bytes of ``fp8_tokens`` FP8 tokens (per-token bytes scale with
    the dtype only, whatever the model's heads and layers)."""
    from nvfp4_kernels.kv_layout import bytes_per_token_per_layer

    fp8, other = (bytes_per_token_per_layer(d, 1, 16) for d in ("fp8_e4m3", kv_dtype))
    return fp8_tokens * fp8 // other


def deployments(a: argparse.Namespace, launch_args: list[str] | None) -> list[tuple[str, list[str] | None]]:
    """(label, launch args or None) of each deployment to run."""
    hosts = getattr(a, "host_cache_sizes", None)
    if launch_args is None:
        if a.kv_dtypes or a.equal_pool_bytes is not None or hosts:
            raise ValueError("--kv-dtypes, --equal-pool-bytes and --host-cache-sizes need --launch (they choose "
                             "what to start)")
        return [("", None)]
    if hosts and flag_value(launch_args, "--host-cache-size") is not None:
        raise ValueError("give --host-cache-size through --host-cache-sizes, not in the launch args")
    if not a.kv_dtypes:
        if a.equal_pool_bytes is not None:
            raise ValueError("--equal-pool-bytes needs --kv-dtypes")
        return [(label, [*launch_args, *extra]) for label, extra in _host_axis(a, launch_args, None, "")]
    chosen = ["--kv-cache-dtype"] + (["--max-total-tokens"] if a.equal_pool_bytes is not None else [])
    for flag in chosen:
        if flag_value(launch_args, flag) is not None:
            raise ValueError(f"give {flag} through --kv-dtypes/--equal-pool-bytes, not in the launch args")
    out = []
    for dtype in a.kv_dtypes:
        extra = ["--kv-cache-dtype", dtype]
        if a.equal_pool_bytes is not None:
            extra += ["--max-total-tokens", str(pool_tokens_for(dtype, a.equal_pool_bytes))]
        out += [(label, [*launch_args, *extra, *host]) for label, host in _host_axis(a, launch_args, dtype, dtype)]
    return out


def _host_axis(a: argparse.Namespace, launch_args: list[str], dtype: str | None,
               label: str) -> list[tuple[str, list[str]]]:
    """(label, extra launch args) per --host-cache-sizes value ([(label, [])] without the axis); ``pool`` is the
    GPU pool's bytes, as a token count of its dtype (known before the launch only from the pool flags)."""
    from engine.host_cache_size import parse_host_cache_size  # no torch: the benchmark client stays light

    hosts = getattr(a, "host_cache_sizes", None)
    if not hosts:
        return [(label, [])]
    out = []
    for value in dict.fromkeys(hosts):
        if value == "pool":
            if a.equal_pool_bytes is not None and dtype is not None:
                value = f"{pool_tokens_for(dtype, a.equal_pool_bytes)}tokens"
            elif flag_value(launch_args, "--max-total-tokens") is not None:
                value = f"{flag_value(launch_args, '--max-total-tokens')}tokens"
            else:
                raise ValueError("--host-cache-sizes pool needs --equal-pool-bytes (with --kv-dtypes) or "
                                 "--max-total-tokens in the launch args: the pool's size must be known before "
                                 "the launch")
        parse_host_cache_size(value)  # a bad size is refused before anything starts
        out.append((f"{label}.host-{value}" if label else f"host-{value}", ["--host-cache-size", value]))
    return out


def new_document(argv: list[str], trace_path: str, trace: Trace) -> dict[str, Any]:
    return {"schema": SCHEMA, "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "nvfp4-serve bench " + " ".join(argv), "argv": list(argv),
            "trace": {"path": trace_path, "header": trace.header_json(), "stats": trace.stats()}, "runs": []}


def _longest_context(trace: Trace) -> int | None:
    try:
        return max(s.context_lens(trace.shared_prefix_tokens)[-1] for s in trace.sessions)
    except TraceError:
        return None  # a text trace: its lengths are known only after tokenization


async def _warmup(base: Session, trace: Trace, builder: PromptBuilder, num_turns: int, page_size: int,
                  timeout_s: float) -> None:
    first = trace.sessions[0]
    warm = Trace((SessionTrace(first.session_id, first.turns[:num_turns]),), trace.shared_prefix_tokens,
                 trace.shared_prefix_text, trace.seed)
    cfg = PointConfig(concurrency=1, num_sessions=1, think_time_scale=0.0, request_timeout_s=timeout_s)
    async with make_http_client(base.target, 1, timeout_s) as client:
        replay = await replay_sessions(client, base.target.model, warm, builder, cfg, page_size, 0.0)
    failed = [r.result.error for r in replay.records if not r.result.ok]
    if failed:
        raise BenchError(f"the warmup turn failed: {failed[0]}")


async def run_deployment(a: argparse.Namespace, target: Target, trace: Trace, configs: list[PointConfig],
                         launch_args: list[str] | None, doc: dict[str, Any]) -> dict[str, Any]:
    """Every point against one deployment; appends its run to ``doc`` (written after each point)."""
    base = await Session.connect(target)
    dep = describe_deployment(base.info, launch_args)
    page_size = dep["page_size"] or 1
    longest, context_len = _longest_context(trace), base.info.get("context_len")
    if longest is not None and context_len and longest > context_len:
        raise BenchError(f"the trace's longest session reaches {longest} tokens, but this deployment serves "
                         f"at most {context_len} (the router's context_len: the model's context capped by "
                         "the decode pool); regenerate the trace with a smaller --max-context-tokens (or "
                         "--fit-pool-tokens) or give the deployment a larger pool")
    builder = PromptBuilder(trace, base.candidates, base.target.tokenizer_dir)
    if a.warmup_turns > 0:
        await _warmup(base, trace, builder, a.warmup_turns, page_size, a.request_timeout_s)
    host_size = flag_value(launch_args or [], "--host-cache-size")
    host_tokens = sum(int((w.get("load") or {}).get("host_cache", {}).get("max_tokens", 0))
                      for w in base.info.get("decode", []))
    run: dict[str, Any] = {
        "kv_dtype": dep["kv_dtype"], "host_cache_size": host_size, "host_cache_tokens": host_tokens, "base_url": base.target.base_url, "launched": launch_args is not None,
        "launch_args": launch_args, "gpu": gpu_name(base.info, base.target.base_url, launch_args),
        "num_gpus": a.num_gpus, "deployment": dep, "server_info": base.info, "points": []}
    doc["runs"].append(run)
    for cfg in configs:
        point = await run_point(base, trace, builder, cfg, page_size, a.progress, run["kv_dtype"])
        run["points"].append(point)
        hit = "-" if point["cache_hit_rate"] is None else f"{point['cache_hit_rate']:.1%}"
        integrity = "ok" if point["integrity_ok"] else "FAILED"
        print(f"kv {run['kv_dtype']} C={cfg.concurrency}: {point['completed']} turns ok, {point['failed']} "
              f"failed, {point['turns_not_sent']} not sent; {point['output_tok_s']:.1f} output tok/s; "
              f"cache hit {hit}; evicted {point['evicted_pages']} pages; re-prefilled "
              f"{point['reprefill_tokens']} tokens; host tier hits {point['host_hit_tokens']} tokens; "
              f"integrity {integrity}", flush=True)
        if a.out:
            write_json(doc, a.out)
    return run


def main(argv: list[str]) -> int:
    """``nvfp4-serve bench --trace ...``; returns the exit code."""
    own, launch_args = split_launch(list(argv))
    parser = build_parser()
    a = parser.parse_args(own)
    if (a.base_url is None) == (launch_args is None):
        parser.error("give exactly one of --base-url URL and --launch [nvfp4-serve up args...]")
    try:
        trace = trace_format.load(a.trace)
        configs = point_configs(a, len(trace.sessions))
        plan = deployments(a, launch_args)
    except (TraceError, ValueError) as exc:
        parser.error(str(exc))
    doc = new_document(list(argv), a.trace, trace)
    api_key = resolve_api_key(a.api_key, launch_args)
    def body() -> None:
        for label, args in plan:
            if args is None:
                target = Target(a.base_url, a.model, a.tokenizer, api_key)
                asyncio.run(run_deployment(a, target, trace, configs, None, doc))
                continue
            log = a.launch_log or f"{a.out or 'nvfp4-serve-agentic'}.launch.log"
            if label:  # one log per deployment
                log = f"{log.removesuffix('.log')}.{label}.log"
            with LaunchedDeployment(args, log, a.launch_timeout) as deployment:
                target = Target(deployment.base_url, a.model, a.tokenizer, api_key)
                asyncio.run(run_deployment(a, target, trace, configs, args, doc))

    if code := run_benchmark(body):
        return code
    if a.out:
        write_json(doc, a.out)
        print(f"results: {Path(a.out).resolve()}")
    if a.report:
        from benchmarks.agentic.report import write_report

        for path in write_report([doc], a.report, [a.out or "(not saved)"]):
            print(path)
    failed = [(r["kv_dtype"], p["concurrency"]) for r in doc["runs"] for p in r["points"]
              if p["failed_point"]]
    if failed:
        print(f"points that failed (integrity or no successful turn): {failed}", file=sys.stderr)
        return 1
    return 0
