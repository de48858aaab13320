"""``python -m benchmarks.serving {run,sweep,plot}`` (also ``nvfp4-serve bench``): see ``--help`` of each.

    run   --base-url URL | --launch [nvfp4-serve up args...]  --input-len N --output-len N --concurrency C
          --num-prompts P [--seed S] [--warmup K] [--out results.json]
    sweep (the same, --concurrency C1 C2 ...; --num-prompts P or --prompts-per-concurrency M)
    plot  results.json... --out-dir docs/benchmarks
    pd    --input-len N --output-len N --concurrency C --num-prompts P --launch [shared up args...]
          (colocated vs prefill + decode over cuda-ipc and gRPC, nvfp4 and fp8: benchmarks/serving/pd.py)
    experiments [--kv-dtypes bf16 fp8_e4m3 nvfp4] [--iso L:C ...] [--capacity-input-lens L ...]
          [--sweep-concurrency C ...] [--out docs/benchmarks/serving.json] --launch [nvfp4-serve up args...]
          (one deployment per KV dtype; JSON, docs/benchmarks/README.md and plots: see experiments.py)

``--launch`` must come last: every argument after it goes to ``nvfp4-serve up``, which the benchmark starts
(on a free port unless ``--port`` is given), waits for, and stops with SIGINT at the end.

Agentic multi-turn traces (``benchmarks.agentic``):
    gen-trace --out trace.jsonl [--scale S | --fit-pool-tokens P --saturate-at C]
    --trace trace.jsonl --concurrency C1 C2 ... [--kv-dtypes fp8_e4m3 nvfp4] [--out R.json] --launch ...
    agentic-report R.json... --out docs/benchmarks/agentic.md
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from benchmarks.serving.config import BenchConfig, Target
from benchmarks.serving.experiments import add_experiment_args
from benchmarks.serving.launch import LaunchedDeployment
from benchmarks.serving.launch_args import KEY_ENVS, LAUNCH_FLAG, resolve_api_key, split_launch
from benchmarks.serving.report import point_table, sweep_table, write_json
from benchmarks.serving.runner import (
    BenchError,
    Session,
    new_document,
    run_benchmark,
    run_point,
    sweep_configs,
)
from benchmarks.serving.server import describe_deployment, max_concurrency
from svc_common.cli_help import HelpFormatter


def _add_common(p: argparse.ArgumentParser) -> None:
    d = BenchConfig(1, 1, 1, 1)
    where = p.add_argument_group("deployment")
    where.add_argument("--base-url", help="router URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    where.add_argument(LAUNCH_FLAG, nargs="...", metavar="UP_ARGS",
                       help="start `nvfp4-serve up UP_ARGS` for the run and stop it after (must come last)")
    where.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for it")
    where.add_argument("--launch-log", default=None, help="launcher log file (default: OUT.launch.log)")
    where.add_argument("--model", default="", help="model id to request (default: the one the router serves)")
    where.add_argument("--tokenizer", default="", help="tokenizer dir (default: the router's --model-dir)")
    where.add_argument("--api-key", default="",
                       help=f"bearer token (default: ${KEY_ENVS[0]} or ${KEY_ENVS[1]}, "
                            "or the launch args' --api-key)")
    where.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=True,
                       help="ask for return_token_ids and time chunks per token (nvfp4-serve, vLLM); "
                            "--no-token-ids times text chunks as sglang.bench_serving does")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, required=True, help="prompt tokens (exact)")
    w.add_argument("--output-len", type=int, required=True, help="max_tokens (exact with --ignore-eos)")
    w.add_argument("--seed", type=int, default=d.seed, help="seed of the random prompts")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
                   help="generate every output token (ignore_eos in each request)")
    w.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured requests before each point")
    w.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="Poisson arrivals per second (default inf: as fast as the concurrency allows)")
    w.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=d.flush_cache,
                   help="POST /flush_cache before each point")
    m = p.add_argument_group("measurement and output")
    m.add_argument("--peak-window-s", type=float, default=d.peak_window_s, help="peak-batch figure's window")
    m.add_argument("--sample-interval-s", type=float, default=d.sample_interval_s, help="/server_info period")
    m.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s, help="HTTP read timeout")
    m.add_argument("--num-gpus", type=int, default=d.num_gpus, help="GPUs it runs on (per-GPU figures)")
    m.add_argument("--save-requests", action=argparse.BooleanOptionalAction, default=d.save_requests,
                   help="keep per-request timings (TTFT, ITL list, end) in the JSON")
    m.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    m.add_argument("--out", default=None, help="results JSON path")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", formatter_class=HelpFormatter, help="one point")
    _add_common(run)
    run.add_argument("--concurrency", type=_concurrency, required=True,
                     help="requests in flight; 'max': as many as the decode pools hold")
    run.add_argument("--num-prompts", type=int, required=True, help="requests sent")
    sweep = sub.add_parser("sweep", formatter_class=HelpFormatter, help="several concurrencies, one JSON")
    _add_common(sweep)
    sweep.add_argument("--concurrency", type=_concurrency, nargs="+", required=True,
                       help="the points (integers, or 'max')")
    sweep.add_argument("--num-prompts", type=int, default=None, help="prompts per point (default: M x C)")
    sweep.add_argument("--prompts-per-concurrency", type=int, default=1,
                       help="M: each point sends M x C prompts (1: one wave, every request at full batch)")
    plot = sub.add_parser("plot", formatter_class=HelpFormatter, help="PNG figures from results files")
    plot.add_argument("results", nargs="+")
    plot.add_argument("--out-dir", default="docs/benchmarks", help="where the PNGs go")
    plot.add_argument("--prefix", default="", help="prefix of the PNG file names")
    add_experiment_args(sub.add_parser("experiments", help="KV dtypes compared: one deployment each, every "
                                                           "experiment against it, JSON + markdown report"))
    return p


def _concurrency(text: str) -> int | str:
    if text == "max":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a concurrency is an integer or 'max', not {text!r}") from None


def _configs(a: argparse.Namespace, max_c: int) -> list[BenchConfig]:
    """The points to run, ``max`` concurrency resolved to ``max_c`` (duplicates dropped)."""
    values = a.concurrency if isinstance(a.concurrency, list) else [a.concurrency]
    concurrencies = list(dict.fromkeys(max_c if c == "max" else c for c in values))
    base = BenchConfig(
        input_len=a.input_len, output_len=a.output_len, concurrency=1, num_prompts=1, seed=a.seed,
        ignore_eos=a.ignore_eos, warmup=a.warmup, request_rate=a.request_rate, flush_cache=a.flush_cache,
        peak_window_s=a.peak_window_s, sample_interval_s=a.sample_interval_s,
        request_timeout_s=a.request_timeout_s, num_gpus=a.num_gpus, save_requests=a.save_requests)
    if a.command == "run":
        return sweep_configs(base, concurrencies, a.num_prompts, 1)
    if a.num_prompts is None and a.prompts_per_concurrency < 1:
        raise ValueError(f"--prompts-per-concurrency must be >= 1, got {a.prompts_per_concurrency}")
    return sweep_configs(base, concurrencies, a.num_prompts, a.prompts_per_concurrency)


def _drive(a: argparse.Namespace, argv: list[str], base_url: str,
           launch_args: list[str] | None) -> dict[str, Any]:
    target = Target(base_url, a.model, a.tokenizer, resolve_api_key(a.api_key, launch_args), a.token_ids)

    async def go() -> dict[str, Any]:
        session = await Session.connect(target)
        max_c = max_concurrency(session.info, a.input_len, a.output_len)
        wants_max = "max" in (a.concurrency if isinstance(a.concurrency, list) else [a.concurrency])
        if wants_max and max_c < 1:
            pools = describe_deployment(session.info)["pool_tokens_per_decode_worker"]
            raise BenchError(f"no decode pool holds one request of {a.input_len} + {a.output_len} tokens "
                             f"(pool tokens per decode worker: {pools})")
        doc = new_document(session, argv, launch_args, a.num_gpus)
        doc["max_concurrency"] = max_c
        for cfg in _configs(a, max_c):
            point = await run_point(session, cfg, a.progress)
            doc["points"].append(point)
            if a.command == "run":
                print(point_table(doc, point), flush=True)
            else:
                print(f"C={cfg.concurrency}: {point['completed']} ok, {point['failed']} failed, "
                      f"{point['output_tok_s']:.1f} output tok/s", flush=True)
            if a.out:
                write_json(doc, a.out)
        if a.command == "sweep":
            print(sweep_table(doc), flush=True)
        return doc

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.serving`` and ``nvfp4-serve bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from benchmarks.agentic.__main__ import is_agentic

    if argv[:1] == ["pd"]:
        from benchmarks.serving.pd import main as pd_main

        return pd_main(argv[1:])
    if is_agentic(argv):
        from benchmarks.agentic.__main__ import main as agentic_main

        return agentic_main(argv)
    own, launch_args = split_launch(argv)
    parser = build_parser()
    a = parser.parse_args(own)
    if a.command == "experiments":
        from benchmarks.serving.experiments import main as experiments_main

        return experiments_main(a, argv, launch_args)
    if a.command == "plot":
        from benchmarks.serving.plot import plot

        try:
            for path in plot(a.results, a.out_dir, a.prefix):
                print(path)
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"plot: {exc}", file=sys.stderr)
            return 1
        return 0
    if (a.base_url is None) == (launch_args is None):
        parser.error("give exactly one of --base-url URL and --launch [nvfp4-serve up args...]")
    try:
        _configs(a, 1)  # validates every option before anything starts
    except ValueError as exc:
        parser.error(str(exc))
    def body() -> None:
        if launch_args is None:
            _drive(a, argv, a.base_url, None)
        else:
            log = a.launch_log or (f"{a.out}.launch.log" if a.out else "nvfp4-serve-bench.launch.log")
            with LaunchedDeployment(launch_args, log, a.launch_timeout) as deployment:
                _drive(a, argv, deployment.base_url, launch_args)

    if code := run_benchmark(body):
        return code
    if a.out:
        print(f"results: {Path(a.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
