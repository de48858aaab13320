"""Seeded chaos soak: requests of random lengths through a router, one prefill and two decode services while
clients disconnect and cancel, the prefill is killed mid-transfer and restarted, and a decode worker is killed
and restarted on the same port. Afterwards:

  - every decode pool passes Decode.CheckIntegrity with zero pages in use, the prefill holds no page;
  - every completed request's greedy text equals the undisturbed output (the same engine in this process);
  - the router's metrics report the failures it saw, and it routes to the restarted decode worker again.

Greedy outputs are bit-identical across faults because every prompt is unique (no cache hit changes its
attention path) and is computed in one piece (--chunked-prefill-size above any batch); the one legitimate
exception is a retry whose prompt the prefill still cached from the failed attempt, which runs the cached-prefix
path (path 2): such a text must equal THAT path's undisturbed output.

CI runs 60 requests (test_soak_ci); the 1,000-request version is marked slow (``pytest --run-slow``) and is also
a script: ``python -m tests.test_soak --requests 1000 --seed 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.service_procs import Proc, restart, start_many, start_router
from tests.soak_workload import Job, Outcome, Reference, SoakPlan, engine_args, make_jobs, run_job


@dataclass
class SoakReport:
    plan: SoakPlan
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    failed_transfers_after_prefill_kill: list[float] = field(default_factory=list)
    router_metrics: str = ""
    integrity: dict[str, decode_pb2.IntegrityReport] = field(default_factory=dict)
    prefill_load: common_pb2.WorkerLoad | None = None
    decode_requests_since_restart: dict[str, float] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    num_path2: int = 0
    service_output: str = ""
    seconds: float = 0.0

    def event(self, what: str) -> None:
        self.events.append(f"{time.perf_counter() - self.t0:.1f}s {what}")

    def counts(self) -> Counter:
        return Counter(o.kind for o in self.outcomes.values())

    def router_counter(self, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in re.findall(rf"^nvfp4_router_{name}_total\{{([^}}]*)\}} (\S+)$", self.router_metrics,
                                        re.MULTILINE):
            out[labels] = float(value)
        return out

    def summary(self) -> str:
        c = self.counts()
        retried = sum(1 for o in self.outcomes.values() if o.attempts > 1)
        failed = Counter(f"{j}:{o.status}" for j, o in self.outcomes.items() if o.kind == "failed")
        http = {k.rpartition("=")[2].strip('"'): v for k, v in self.router_counter("requests").items()
                if '"/v1/completions"' in k}
        return (f"soak seed={self.plan.seed}: {len(self.outcomes)} requests in {self.seconds:.1f}s: "
                f"{c['completed']} completed ({self.num_path2} via the prefill's cached-prefix path after a retry), "
                f"{c['disconnected']} disconnected, {c['cancelled']} cancelled, {c['failed']} failed "
                f"{dict(Counter(k.partition(':')[2] for k in failed))}; {retried} needed client retries; "
                f"events: {'; '.join(self.events)}; router HTTP statuses {http}, failures "
                f"{self.router_counter('failures')}, retries {self.router_counter('retries')}; mismatches "
                f"{len(self.mismatches)}")


# -- probes of the services -----------------------------------------------------------------------------------

async def decode_call(address: str, method: str, request):
    async with grpc.aio.insecure_channel(address) as ch:
        return await getattr(decode_pb2_grpc.DecodeStub(ch), method)(request, timeout=10)


async def prefill_load(address: str) -> common_pb2.WorkerLoad:
    async with grpc.aio.insecure_channel(address) as ch:
        return await prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10)


def metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))


async def decode_metric(address: str, name: str) -> float:
    try:
        resp = await decode_call(address, "GetMetrics", common_pb2.MetricsRequest())
    except grpc.aio.AioRpcError:
        return 0.0  # being restarted
    return metric_sum(resp.prometheus_text, name)


# -- the soak ---------------------------------------------------------------------------------------------------

class Deployment:
    def __init__(self, model_dir: str, plan: SoakPlan) -> None:
        args = engine_args(model_dir, plan.page_size)
        p, d0, d1 = start_many([("prefill_svc", *args, "--debug-transfer-delay-s", str(plan.transfer_delay_s)),
                                ("decode_svc", *args), ("decode_svc", *args)])
        self.procs: dict[str, Proc] = {"prefill": p, "decode-0": d0, "decode-1": d1}
        self.retired: list[Proc] = []
        self.router = start_router(model_dir, [d0.address, d1.address], [p.address], "--served-model-name", "tiny",
                                   "--health-check-interval-s", "0.3", "--max-retries", "3")

    @property
    def decodes(self) -> list[Proc]:
        return [self.procs["decode-0"], self.procs["decode-1"]]

    def restart(self, name: str, sig_kill: bool = True) -> None:
        old = self.procs[name]
        old.stop(sig_kill=sig_kill)
        self.retired.append(old)
        self.procs[name] = restart(old)

    def output(self) -> str:
        return "".join(p.output for p in [*self.retired, *self.procs.values(), self.router])

    def stop(self) -> None:
        for p in [self.router, *self.procs.values()]:
            p.stop()


async def _kill_prefill_mid_transfer(dep: Deployment, report: SoakReport) -> None:
    address = dep.procs["prefill"].address
    before = sum([await decode_metric(d.address, "nvfp4_decode_failed_transfers_total") for d in dep.decodes])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the prefill holds pages only while a transfer is under way
        load = await prefill_load(address)
        if load.pool_pages_in_use > 0:
            break
        await asyncio.sleep(0.01)
    else:
        report.event("prefill: no transfer under way within 10 s (killed anyway)")
    await asyncio.to_thread(dep.procs["prefill"].stop, True)
    after = before
    for _ in range(100):  # the decode side sees the stream break
        after = sum([await decode_metric(d.address, "nvfp4_decode_failed_transfers_total") for d in dep.decodes])
        if after > before:
            break
        await asyncio.sleep(0.05)
    report.failed_transfers_after_prefill_kill.append(after - before)
    await asyncio.sleep(0.3)  # some requests meet the dead prefill
    old = dep.procs["prefill"]
    dep.retired.append(old)
    dep.procs["prefill"] = await asyncio.to_thread(restart, old)
    report.event(f"prefill killed with {load.pool_pages_in_use} pages in transfer, {after - before:g} transfer(s) "
                 f"failed, restarted on port {old.port}")


async def _restart_decode(dep: Deployment, name: str, report: SoakReport) -> None:
    proc = dep.procs[name]
    for _ in range(200):  # kill it while it is serving
        load = await decode_call(proc.address, "GetLoad", common_pb2.GetLoadRequest())
        if load.num_running > 0:
            break
        await asyncio.sleep(0.01)
    running = load.num_running
    await asyncio.to_thread(dep.restart, name, True)
    report.event(f"{name} killed with {running} running, restarted on port {proc.port}")


async def _chaos(dep: Deployment, plan: SoakPlan, dispatched: list[int], report: SoakReport) -> None:
    for fraction, event in plan.chaos:
        while dispatched[0] < fraction * (plan.num_requests - plan.num_probes):
            await asyncio.sleep(0.02)
        if event == "prefill":
            await _kill_prefill_mid_transfer(dep, report)
        else:
            await _restart_decode(dep, event, report)


async def _probe(dep: Deployment, plan: SoakPlan, jobs: list[Job], report: SoakReport) -> None:
    """Once the router sees every worker healthy again, a last round of requests (compared like the others):
    a restarted decode worker must get its share."""
    async with httpx.AsyncClient(base_url=f"http://{dep.router.address}", timeout=120) as client:
        deadline = time.monotonic() + 30
        while (await client.get("/health")).json().get("decode_healthy") != 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        report.event("every worker healthy again")

        async def one(job: Job) -> None:
            report.outcomes[job.index] = await run_job(client, job, plan, "tiny")

        await asyncio.gather(*(one(j) for j in jobs))


async def _settle(dep: Deployment, report: SoakReport) -> None:
    """Wait (bounded) until every pool is idle, then take the final integrity reports and metrics."""
    deadline = time.monotonic() + 20
    while True:
        reps = {d.name + "@" + d.address: await decode_call(d.address, "CheckIntegrity",
                                                            decode_pb2.CheckIntegrityRequest()) for d in dep.decodes}
        load = await prefill_load(dep.procs["prefill"].address)
        idle = all(r.ok and r.num_in_use == 0 for r in reps.values()) and load.pool_pages_in_use == 0 \
            and load.num_running == 0 and load.num_waiting == 0
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    report.integrity, report.prefill_load = reps, load
    for name, proc in dep.procs.items():
        if name.startswith("decode"):
            report.decode_requests_since_restart[name] = await decode_metric(proc.address,
                                                                             "nvfp4_decode_requests_total")
    async with httpx.AsyncClient(base_url=f"http://{dep.router.address}") as client:
        report.router_metrics = (await client.get("/metrics")).text


async def _drive(dep: Deployment, plan: SoakPlan, jobs: list[Job], report: SoakReport) -> None:
    pending, probes = list(jobs[:-plan.num_probes]), jobs[-plan.num_probes:]
    dispatched = [0]

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            job = pending.pop(0)
            dispatched[0] += 1
            report.outcomes[job.index] = await run_job(client, job, plan, "tiny")

    limits = httpx.Limits(max_connections=plan.concurrency * 2)
    async with httpx.AsyncClient(base_url=f"http://{dep.router.address}", timeout=120, limits=limits) as client:
        chaos = asyncio.ensure_future(_chaos(dep, plan, dispatched, report))
        await asyncio.gather(*(client_loop(client) for _ in range(plan.concurrency)))
        await chaos
    report.event("chaos over")
    await _probe(dep, plan, probes, report)
    await _settle(dep, report)


def run_soak(model_dir: str, plan: SoakPlan) -> SoakReport:
    jobs = make_jobs(plan, vocab_size=_vocab_size(model_dir))
    ref = Reference(model_dir, plan.page_size)
    expected = ref.fresh(jobs)
    report = SoakReport(plan)
    dep = Deployment(model_dir, plan)
    t0 = time.perf_counter()
    try:
        asyncio.run(_drive(dep, plan, jobs, report))
    finally:
        report.seconds = time.perf_counter() - t0
        dep.stop()
        report.service_output = dep.output()
    for job in jobs:
        out = report.outcomes[job.index]
        if out.kind != "completed" or out.text == expected[job.index]:
            continue
        if out.text == ref.cached_prefix(job):
            report.num_path2 += 1
            continue
        report.mismatches.append(f"request {job.index} (prompt of {len(job.prompt)}, max_tokens {job.max_tokens}, "
                                 f"{job.kind}): got {out.text!r}, undisturbed {expected[job.index]!r}")
    return report


def _vocab_size(model_dir: str) -> int:
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)["vocab_size"]


def check_report(report: SoakReport) -> None:
    """Everything the soak guarantees (the test and the script assert the same)."""
    plan, counts = report.plan, report.counts()
    assert len(report.outcomes) == plan.num_requests
    assert not report.mismatches, "\n".join(report.mismatches)
    for name, rep in report.integrity.items():
        assert rep.ok and rep.num_in_use == 0 and rep.num_free + rep.num_cached == rep.num_total, (name, rep)
    load = report.prefill_load
    assert load is not None and load.pool_pages_in_use == 0 and load.num_running == 0, load
    assert "pool integrity check failed" not in report.service_output
    assert "Traceback" not in report.service_output, report.service_output[-5000:]
    # most requests that were not abandoned on purpose completed (clients retry 429/5xx like real ones)
    assert counts["completed"] >= 0.9 * (plan.num_requests - counts["disconnected"] - counts["cancelled"])
    # kills were mid-transfer and seen by the decode workers; the router saw and counted the failures
    num_prefill_kills = sum(1 for _, e in plan.chaos if e == "prefill")
    assert len(report.failed_transfers_after_prefill_kill) == num_prefill_kills
    # a kill can land while the pages it holds belong to streams whose client already left (their pull was
    # cancelled, not failed), so only the kills together must have broken transfers
    assert sum(report.failed_transfers_after_prefill_kill) > 0, report.events
    failures = report.router_counter("failures")
    assert sum(failures.values()) > 0 and any("unavailable" in k for k in failures), failures
    statuses = report.router_counter("requests")
    if counts["cancelled"]:  # clients that left before their response are counted as 499
        assert sum(v for k, v in statuses.items() if 'status="499"' in k) > 0, statuses
    # the restarted decode worker(s) came back empty and were routed to again (at the latest by the probes)
    for _, event in plan.chaos:
        if event.startswith("decode"):
            assert report.decode_requests_since_restart[event] > 0, report.decode_requests_since_restart
    assert re.search(r"^nvfp4_router_in_flight_requests 0\.0$", report.router_metrics, re.MULTILINE)


# CI's events: both prefill kills before the decode kill. The decode worker's restart holds the chaos for a
# process start (seconds on a 2-core machine), so a prefill kill after it met a finished workload: it found no
# transfer, waited 10 s for one and broke none. The kills land among requests that retry (seed 0's disconnects
# and cancels are requests 7, 9, 19, 20, 23, 27, 47 and 53; they do not retry a 503 of a dead prefill).
CI_CHAOS = ((0.2, "prefill"), (0.6, "prefill"), (0.8, "decode-1"))


def test_soak_ci(tiny_model_dir):
    report = run_soak(tiny_model_dir, SoakPlan(chaos=CI_CHAOS))
    print(report.summary())
    check_report(report)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_full(tiny_model_dir):
    report = run_soak(tiny_model_dir, SoakPlan.full())
    print(report.summary())
    check_report(report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m tests.test_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=None, help="checkpoint directory (default: a fresh tiny model)")
    a = p.parse_args(argv)
    model = a.model
    if model is None:
        import tempfile

        from offline.tiny_model import make_tiny_model

        model = str(make_tiny_model(tempfile.mkdtemp() + "/model", seed=0))
    report = run_soak(model, SoakPlan.full(seed=a.seed, num_requests=a.requests))
    print(report.summary())
    check_report(report)
    print("soak passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
