"""What the deployment says about itself: /server_info, pool usage sampled during a run, decode metrics.

Pool usage comes from each decode worker's GetLoad (through the router's /server_info), summed over the
decode workers: ``in_use`` pages are held by running requests, ``used`` = total - free also counts the
pages only the prefix cache holds. Decode metrics come from each decode service's GetMetrics RPC (its
Prometheus text), read before and after a run; the report keeps the differences.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.serving.launch_args import flag_value

_GPU_KEYS = ("gpu_name", "device_name", "gpu")
# "since start" gauges: their differences are meaningful
_GAUGES_KEPT = ("evicted_pages", "evicted_tokens", "flushed_pages", "retractions", "host_hit_tokens", "host_loads",
                "host_stores", "host_load_bytes", "host_store_bytes", "host_load_seconds", "host_store_seconds")


async def fetch_server_info(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/server_info")
    if response.status_code != 200:
        raise RuntimeError(f"GET /server_info answered HTTP {response.status_code}: {response.text[:300]} "
                           f"(is {client.base_url} an nvfp4-serve router? --api-key if it needs one)")
    return response.json()


async def flush_cache(client: httpx.AsyncClient) -> dict[str, Any]:
    """POST /flush_cache; the router's JSON, or {"error": ...} (a benchmark goes on without the flush)."""
    response = await client.post("/flush_cache")
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text[:300]}"}
    return response.json()


def _int(load: dict[str, Any] | None, key: str) -> int:
    return int((load or {}).get(key, 0))  # protobuf JSON: int64 as strings, zeros omitted


def pool_state(info: dict[str, Any]) -> dict[str, int]:
    """Pages (total, free, in use, used, cached), page size and requests (running, waiting) over the decode
    workers of one /server_info answer."""
    loads = [w.get("load") for w in info.get("decode", [])]
    kinds = ("total", "free", "in_use", "cached")
    state = {k: sum(_int(ld, f"pool_pages_{k}") for ld in loads) for k in kinds}
    state["used"] = state["total"] - state["free"]
    state["running"] = sum(_int(ld, "num_running") for ld in loads)
    state["waiting"] = sum(_int(ld, "num_waiting") for ld in loads)
    state["page_size"] = max((_int(ld, "page_size") for ld in loads), default=0)
    return state


class PoolSampler:
    """Polls /server_info every ``interval_s`` in the background; ``summary()`` gives the peaks."""

    def __init__(self, client: httpx.AsyncClient, interval_s: float, t0: float) -> None:
        self._client, self._interval, self._t0 = client, interval_s, t0
        self.samples: list[dict[str, Any]] = []
        self.num_errors = 0
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            try:
                state = pool_state(await fetch_server_info(self._client))
                self.samples.append({"t": round(time.perf_counter() - self._t0, 3), **state})
            except (httpx.HTTPError, RuntimeError, ValueError):
                self.num_errors += 1
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pool-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def summary(self) -> dict[str, Any]:
        s = self.samples
        total = s[-1]["total"] if s else 0
        page = s[-1]["page_size"] if s else 0
        kinds = ("in_use", "used", "cached", "running", "waiting")
        peak = {k: max((x[k] for x in s), default=0) for k in kinds}
        return {"num_samples": len(s), "num_sample_errors": self.num_errors, "pages_total": total,
                "page_size": page,
                "peak_pages_in_use": peak["in_use"], "peak_pages_used": peak["used"],
                "peak_pages_cached": peak["cached"], "peak_running": peak["running"],
                "peak_waiting": peak["waiting"], "peak_tokens_in_use": peak["in_use"] * page,
                "peak_fraction_in_use": peak["in_use"] / total if total else None, "samples": s}


def parse_prometheus(text: str, prefix: str = "nvfp4_decode_") -> dict[str, float]:
    """Counters (``*_total``), histogram ``*_sum`` / ``*_count`` and the since-start gauges, summed over
    labels, named without ``prefix``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            suffixes: tuple[str, ...] = ("_total",)
        elif family.type == "histogram":
            suffixes = ("_sum", "_count")
        elif family.type == "gauge" and family.name.removeprefix(prefix) in _GAUGES_KEPT:
            suffixes = ("",)
        else:
            continue
        for sample in family.samples:
            name = sample.name.removeprefix(prefix)
            if any(name == family.name.removeprefix(prefix) + sfx for sfx in suffixes):
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


async def decode_metrics(addresses: list[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """address -> parsed metrics, or -> {"error": ...} when the decode service cannot be reached from here."""
    return await service_metrics(addresses, "decode", timeout_s)


async def service_metrics(addresses: list[str], role: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """``decode_metrics`` for the services of ``role`` ("decode" or "prefill"; names without ``nvfp4_<role>_``)."""
    import grpc

    from nvfp4_serve_proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
    from svc_common.service_auth import resolve_service_token
    from svc_common.tls import TLSConfig, open_channel

    stubs = {"decode": decode_pb2_grpc.DecodeStub, "prefill": prefill_pb2_grpc.PrefillStub}
    if role not in stubs:
        raise ValueError(f"service_metrics: role {role!r} is not one of {sorted(stubs)}")
    links = TLSConfig(service_token=resolve_service_token(None))  # the deployment's token, from the environment

    async def one(address: str) -> dict[str, Any]:
        try:
            async with open_channel(address, links, []) as channel:
                reply = await stubs[role](channel).GetMetrics(common_pb2.MetricsRequest(), timeout=timeout_s)
            return parse_prometheus(reply.prometheus_text, f"nvfp4_{role}_")
        except grpc.aio.AioRpcError as exc:
            return {"error": f"{exc.code().name}: {exc.details()}"}

    results = await asyncio.gather(*(one(a) for a in addresses))
    return dict(zip(addresses, results, strict=True))


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per decode worker ``after - before`` of every metric, plus ``sum`` over the workers that answered."""
    out: dict[str, Any] = {}
    total: dict[str, float] = {}
    for address, a in after.items():
        b = before.get(address, {})
        if "error" in a or "error" in b:
            out[address] = {"error": a.get("error") or b.get("error")}
            continue
        d = {k: v - b.get(k, 0.0) for k, v in sorted(a.items())}
        out[address] = d
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    out["sum"] = total
    return out


def _local_gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0].strip() if out else None


def _find_key(obj: Any, keys: tuple[str, ...]) -> str | None:
    if isinstance(obj, dict):
        for k in keys:
            if isinstance(obj.get(k), str) and obj[k]:
                return obj[k]
        for v in obj.values():
            if (found := _find_key(v, keys)) is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            if (found := _find_key(v, keys)) is not None:
                return found
    return None


def gpu_name(info: dict[str, Any], base_url: str, launch_args: list[str] | None) -> str:
    """The deployment's GPU: a GPU-name field of /server_info when it has one; else, for a deployment on this
    host (launched here or on a loopback URL), "cpu" when it runs with --device cpu or this host has no
    NVIDIA GPU, else this host's GPU; "unknown" for a remote deployment that does not say."""
    if (name := _find_key(info, _GPU_KEYS)) is not None:
        return name
    host = urlparse(base_url).hostname or ""
    if launch_args is None and host not in ("127.0.0.1", "localhost", "::1"):
        return "unknown"
    args = launch_args or []
    if flag_value(args, "--device") == "cpu":
        return "cpu"
    return _local_gpu_name() or "cpu"


def max_concurrency(info: dict[str, Any], input_len: int, output_len: int) -> int:
    """Requests of ``input_len + output_len`` tokens the decode pools hold at once (``--concurrency max``):
    per decode worker, its pool pages // the pages one request needs, summed over the workers. An upper
    bound: pages the engine keeps for itself, if any, are not subtracted."""
    total = 0
    for w in info.get("decode", []):
        load = w.get("load") or {}
        page = _int(load, "page_size")
        if page > 0:
            total += _int(load, "pool_pages_total") // -(-(input_len + output_len) // page)
    return total


def describe_deployment(info: dict[str, Any], launch_args: list[str] | None = None) -> dict[str, Any]:
    """Model, KV format, layers (with a note when fewer than the checkpoint's are served), pool capacity and
    worker counts, from /server_info."""
    loads = [w.get("load") or {} for w in info.get("decode", [])]
    layout = next((ld.get("layout") for ld in loads if ld.get("layout")), {}) or {}
    model_path = next((ld.get("model_path") for ld in loads if ld.get("model_path")), "") or \
        info.get("config", {}).get("model_dir", "")
    served_layers = int(layout.get("num_layers", 0))
    checkpoint_layers = None
    config_path = Path(model_path) / "config.json" if model_path else None
    if config_path is not None and config_path.is_file():
        hf = json.loads(config_path.read_text())
        checkpoint_layers = {**hf.get("text_config", {}), **hf}.get("num_hidden_layers")
    note = ""
    override = flag_value(launch_args or [], "--num-layers")
    if checkpoint_layers and served_layers and served_layers != checkpoint_layers:
        note = (f"served with {served_layers} of the checkpoint's {checkpoint_layers} layers "
                "(--num-layers override)")
    elif override is not None:
        note = f"launched with --num-layers {override}"
    return {
        "model": info.get("model", ""), "model_path": model_path, "kv_dtype": layout.get("kv_dtype", ""),
        "page_size": int(layout.get("page_size", 0)), "num_layers": served_layers,
        "checkpoint_num_layers": checkpoint_layers, "num_layers_note": note,
        "num_kv_heads": int(layout.get("num_kv_heads", 0)), "head_dim": int(layout.get("head_dim", 0)),
        "num_decode_workers": len(info.get("decode", [])),
        "num_prefill_workers": len(info.get("prefill", [])),
        "pool_pages_total": sum(_int(ld, "pool_pages_total") for ld in loads),
        "pool_tokens_per_decode_worker": [_int(ld, "max_total_tokens") for ld in loads],
        "context_len": info.get("context_len"), "vocab_size": info.get("vocab_size"),
    }
