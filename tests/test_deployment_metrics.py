"""One scrape of the router's /metrics sees the whole deployment (`nvfp4-serve up` with a prefill and a decode
service and an API key, so every internal call carries the service token): each worker's families with a
``worker`` label and the values its own GetMetrics gives; one HELP/TYPE per family; a worker that does not
answer is skipped and counted without holding /metrics past its deadline."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from nvfp4_serve_proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.app import create_app
from router.config import RouterConfig
from tests.service_procs import Launched

API_KEY = "metrics-test-key"


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--page-size", "4", "--api-key", API_KEY)
    yield d
    d.stop()


def _families(text: str) -> dict[str, dict[tuple, float]]:
    """name -> {(sample name, sorted labels): value}"""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, {}).update(
            {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples})
    return out


async def _get_metrics(address: str, role: str) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = (decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub)(ch)
        res = await stub.GetMetrics(common_pb2.MetricsRequest(), metadata=(("authorization", f"Bearer {API_KEY}"),))
        return res.prometheus_text


def test_router_metrics_serve_every_workers_families_labelled_by_worker(dep):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    model = httpx.get(f"{dep.url}/v1/models", headers=auth).json()["data"][0]["id"]
    r = httpx.post(f"{dep.url}/v1/completions", headers=auth, timeout=60,
                   json={"model": model, "prompt": "def main():", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    # the prefill counts a transfer once its stream has ended, which may come just after the answer: wait for
    # that before comparing the router's view with the workers' own
    for _ in range(100):
        fam = _families(asyncio.run(_get_metrics(dep.address("prefill"), "prefill"))).get("nvfp4_prefill_kv_transfer_bytes", {})
        if fam.get(("nvfp4_prefill_kv_transfer_bytes_total", ()), 0) > 0:
            break
        time.sleep(0.1)
    text = httpx.get(f"{dep.url}/metrics", headers=auth, timeout=30).text
    got = _families(text)
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))  # families merged by name across workers

    for role, address in (("decode", dep.address("decode-0")), ("prefill", dep.address("prefill"))):
        want = _families(asyncio.run(_get_metrics(address, role)))
        for name in (f"nvfp4_{role}_requests", f"nvfp4_{role}_prompt_tokens", f"nvfp4_{role}_pool_pages_total",
                     f"nvfp4_{role}_pool_pages_used", f"nvfp4_{role}_prefix_cache_hit_tokens",
                     f"nvfp4_{role}_evicted_pages", f"nvfp4_{role}_kv_transfer_bytes",
                     f"nvfp4_{role}_kv_transfer_last_gbps"):
            assert name in want, (name, sorted(want))
            relabelled = {(s, tuple(sorted((*labels, ("worker", address))))): v for (s, labels), v in want[name].items()}
            assert got[name] == relabelled, name
        assert want[f"nvfp4_{role}_prompt_tokens"][(f"nvfp4_{role}_prompt_tokens_total", ())] > 0
        assert want[f"nvfp4_{role}_kv_transfer_bytes"][(f"nvfp4_{role}_kv_transfer_bytes_total", ())] > 0
    assert "nvfp4_router_requests" in got  # the router's own families stay
    failures = got.get("nvfp4_router_worker_metrics_failures", {})
    assert not any(v for (s, _), v in failures.items() if s.endswith("_total")), failures


def _black_hole() -> socket.socket:
    """A listening socket that accepts (the kernel's backlog) but never speaks HTTP/2."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_a_worker_that_does_not_answer_is_skipped_and_counted_within_the_deadline(tiny_model_dir):
    hole = _black_hole()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{closed.getsockname()[1]}"
    silent = f"127.0.0.1:{hole.getsockname()[1]}"
    config = RouterConfig(decode_addresses=(silent,), prefill_addresses=(refused,), model_dir=tiny_model_dir,
                          served_model_name="tiny", health_check_interval_s=60.0, health_check_timeout_s=0.5)
    with hole, TestClient(create_app(config)) as client:
        t0 = time.monotonic()
        r = client.get("/metrics")
        took = time.monotonic() - t0
    assert r.status_code == 200 and took < 3.0, took
    got = _families(r.text)
    failures = got["nvfp4_router_worker_metrics_failures"]
    for role, address in (("decode", silent), ("prefill", refused)):
        key = ("nvfp4_router_worker_metrics_failures_total", (("address", address), ("role", role)))
        assert failures[key] == 1.0, failures
    assert not any(name.startswith(("nvfp4_decode_", "nvfp4_prefill_")) for name in got)
