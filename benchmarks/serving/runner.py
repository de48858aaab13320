"""One benchmark point, and a sweep of points over concurrencies, against one deployment.

A point: warmup requests -> /flush_cache -> decode metrics -> [pool sampler on] measured requests
[sampler off] -> decode metrics -> figures. The results document (``new_document``) holds the command, the
deployment, the GPU and a list of points; ``run`` writes one point, ``sweep`` one per concurrency.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from typing import Any

import httpx

from benchmarks.serving import dataset
from benchmarks.serving.client import RequestResult, make_http_client, run_requests
from benchmarks.serving.config import BenchConfig, Target
from benchmarks.serving.progress import make_progress
from benchmarks.serving.server import (
    PoolSampler,
    decode_metrics,
    describe_deployment,
    fetch_server_info,
    flush_cache,
    gpu_name,
    metrics_delta,
    service_metrics,
)
from benchmarks.serving.stats import summarize

SCHEMA = "nvfp4-serve/bench-serving/1"


class BenchError(RuntimeError):
    """The benchmark cannot go on (the deployment refuses every request, no tokenizer, ...)."""


def run_benchmark(body: Callable[[], None]) -> int:
    """Exit code of a benchmark command's body: 0 when it ran, 1 (the reason on stderr) when the deployment or
    the benchmark failed, 130 on Ctrl-C. Shared by ``bench run|sweep`` and ``bench --trace``."""
    try:
        body()
    except (BenchError, RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmark interrupted", file=sys.stderr)
        return 130
    return 0


class Session:
    """What every point of one deployment shares: the target, its /server_info, the prompt vocabulary."""

    def __init__(self, target: Target, info: dict[str, Any]) -> None:
        model_dir = info.get("config", {}).get("model_dir", "")
        tokenizer_dir = target.tokenizer_dir or model_dir
        model = target.model or info.get("model", "")
        self.target = replace(target, model=model, tokenizer_dir=tokenizer_dir)
        self.info = info
        try:
            self.candidates = dataset.candidate_token_ids(tokenizer_dir, int(info.get("vocab_size") or 0))
        except FileNotFoundError as exc:
            raise BenchError(f"{exc} (the router serves {model_dir!r}, not readable from here)") from None
        self.decode_addresses = [w["address"] for w in info.get("decode", [])]
        self.prefill_addresses = [w["address"] for w in info.get("prefill", [])]  # none when colocated

    @classmethod
    async def connect(cls, target: Target) -> Session:
        async with make_http_client(target, 1, 60.0) as client:
            try:
                info = await fetch_server_info(client)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                raise BenchError(f"cannot reach the router at {target.base_url}: {why}") from None
        return cls(target, info)


def new_document(session: Session, argv: Sequence[str], launch_args: list[str] | None, num_gpus: int) -> dict:
    """The results document before any point: command, deployment, GPU."""
    return {
        "schema": SCHEMA, "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.serving " + " ".join(argv), "argv": list(argv),
        "base_url": session.target.base_url, "launched": launch_args is not None, "launch_args": launch_args,
        "gpu": gpu_name(session.info, session.target.base_url, launch_args), "num_gpus": num_gpus,
        "deployment": describe_deployment(session.info, launch_args), "server_info": session.info,
        "tokenizer_dir": session.target.tokenizer_dir, "num_candidate_tokens": int(session.candidates.size),
        "points": [],
    }


def _first_error(results: Sequence[RequestResult]) -> str:
    return next((r.error for r in results if r.error), "")


async def run_point(session: Session, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run one point (see the module docstring) and return its JSON."""
    target = session.target
    prompts = dataset.random_prompts(session.candidates, cfg.num_prompts, cfg.input_len, cfg.seed)
    async with make_http_client(target, cfg.concurrency, cfg.request_timeout_s) as client:
        if cfg.warmup:
            warm = dataset.random_prompts(session.candidates, cfg.warmup, cfg.input_len, cfg.seed,
                                          dataset.WARMUP_STREAM)
            bar = make_progress(cfg.warmup, "warmup", progress)
            results = await run_requests(client, target.model, warm, cfg.warmup_output_len,
                                         min(cfg.warmup, cfg.concurrency), cfg.ignore_eos,
                                         time.perf_counter(), on_done=lambda _: bar.update(),
                                         token_ids=target.token_ids)
            bar.close()
            if not any(r.ok for r in results):
                raise BenchError(f"every warmup request failed: {_first_error(results)}")
        flushed = await flush_cache(client) if cfg.flush_cache else None
        if flushed and "error" in flushed:
            print(f"warning: /flush_cache failed, the prefix caches keep their content: {flushed['error']}",
                  file=sys.stderr)
        before = await decode_metrics(session.decode_addresses)
        prefill_before = await service_metrics(session.prefill_addresses, "prefill")
        bar = make_progress(cfg.num_prompts, f"C={cfg.concurrency}", progress)
        t0 = time.perf_counter()
        sampler = PoolSampler(client, cfg.sample_interval_s, t0)
        sampler.start()
        try:
            results = await run_requests(client, target.model, prompts, cfg.output_len, cfg.concurrency,
                                         cfg.ignore_eos, t0, cfg.request_rate, cfg.seed,
                                         lambda _: bar.update(), target.token_ids)
        finally:
            duration = time.perf_counter() - t0
            await sampler.stop()
            bar.close()
        after = await decode_metrics(session.decode_addresses)
        prefill_after = await service_metrics(session.prefill_addresses, "prefill")
    if not any(r.ok for r in results):
        raise BenchError(f"every request failed: {_first_error(results)}")
    point: dict[str, Any] = {"config": {**asdict(cfg), "request_rate": str(cfg.request_rate)}}
    point.update(summarize(results, duration, cfg.batch, cfg.peak_window_s, cfg.num_gpus))
    point["concurrency"], point["num_prompts"] = cfg.concurrency, cfg.num_prompts
    point["input_len"], point["output_len"] = cfg.input_len, cfg.output_len
    point["input_len_mismatch"] = sum(1 for r in results if r.ok and r.prompt_tokens != cfg.input_len)
    point["output_len_mismatch"] = sum(1 for r in results if r.ok and r.completion_tokens != cfg.output_len)
    point["server"] = {"flush_cache": flushed, "pool": sampler.summary(),
                       "decode_metrics": metrics_delta(before, after),
                       "prefill_metrics": metrics_delta(prefill_before, prefill_after)}
    if cfg.save_requests:
        point["requests"] = [r.to_json() for r in results]
    return point


def sweep_configs(base: BenchConfig, concurrencies: Sequence[int], num_prompts: int | None,
                  prompts_per_concurrency: int) -> list[BenchConfig]:
    """One config per concurrency: ``num_prompts`` prompts each, or ``prompts_per_concurrency`` x C."""
    if not concurrencies:
        raise ValueError("--concurrency needs at least one value")
    return [replace(base, concurrency=c, num_prompts=num_prompts or prompts_per_concurrency * c)
            for c in concurrencies]

