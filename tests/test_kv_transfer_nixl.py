"""The nixl KV transfer path on the CPU: NIXL (UCX backend) reads the prefill's pool pages into the decode's.

Real prefill and decode service processes with --kv-transfer nixl on both ends give the engine's own greedy
output for nvfp4 and bf16 pools, take the nixl path (metrics), and a transfer cancelled at every stage leaves no
page held on either side; a share the decode refuses sends that prefill's transfers over gRPC (counted). The
path rule and the share checks, which need no NIXL, are in tests/test_kv_transfer_nixl_rules.py.

Skipped, saying why, where nixl cannot be imported or its UCX agent cannot start (CI installs no nixl).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from svc_common.grpc_server import build_server
from tests.service_procs import free_port, start
from tests.test_kv_transfer_gpu import generate, state
from tests.test_kv_transfer_nixl_rules import bent
from tests.test_kv_transfer_protocol import prompt, reference

# nixl is probed in a child process and never imported into this one: once loaded, its libraries break
# grpc_tools' in-process protoc (test_proto_stubs segfaults), and every test here runs it in service processes.
_PROBE = """
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
"""
_probe = subprocess.run([sys.executable, "-c", _PROBE], check=False, capture_output=True, text=True, timeout=60)
if _probe.returncode != 0:
    _why = (_probe.stderr.strip().splitlines() or [f"exit status {_probe.returncode}"])[-1]
    pytest.skip(f"nixl cannot be imported or its UCX agent cannot start here ({_why[:300]}); "
                "install the nixl extra", allow_module_level=True)

CPU = ("--device", "cpu", "--dtype", "float32", "--page-size", "4", "--kv-transfer", "nixl")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def prefill_metrics(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await prefill_pb2_grpc.PrefillStub(ch).GetMetrics(common_pb2.MetricsRequest())).prometheus_text


# -- a prefill whose share is bent: its transfers take gRPC, counted ---------------------------------------
class BendingPrefill(prefill_pb2_grpc.PrefillServicer):
    """A real prefill process behind a proxy that bends the KVShare it answers (a broken or hostile prefill's
    share); everything else is forwarded as it is."""

    def __init__(self, stub: prefill_pb2_grpc.PrefillStub, bend):
        self.stub, self.bend = stub, bend

    async def GetKVShare(self, request, context):
        return self.bend(await self.stub.GetKVShare(request))

    async def Prefill(self, request, context):
        async for msg in self.stub.Prefill(request):
            yield msg

    async def ReleaseTransfer(self, request, context):
        return await self.stub.ReleaseTransfer(request)

    async def GetLoad(self, request, context):
        return await self.stub.GetLoad(request)

    async def GetMetrics(self, request, context):
        return await self.stub.GetMetrics(request)


@contextlib.asynccontextmanager
async def bending_proxy(prefill: str, port: int, bend):
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(prefill, options=opts) as ch:
        server = build_server(64 << 20)
        prefill_pb2_grpc.add_PrefillServicer_to_server(BendingPrefill(prefill_pb2_grpc.PrefillStub(ch), bend), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await server.stop(0)


@contextlib.contextmanager
def nixl_pair(model_dir: str, *args: str, prefill_args: tuple[str, ...] = (), more_prefills: tuple[str, ...] = ()):
    """A prefill and a decode service process with --kv-transfer nixl, started at once (the decode pulls from
    the prefill and from ``more_prefills``)."""
    port = free_port()
    common = ("--model", model_dir, *CPU, *args)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, "prefill_svc", *common, *prefill_args, "--port", str(port)),
                   pool.submit(start, "decode_svc", *common, "--prefill-addresses", f"127.0.0.1:{port}",
                               *more_prefills)]
    procs = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            f.result()  # a start that failed raises here; the other process is stopped below
        yield procs[0], procs[1]
    finally:
        for proc in procs:
            proc.stop()


def deltas(before: str, after: str, *names: str) -> list[float]:
    return [metric(after, n) - metric(before, n) for n in names]


@pytest.fixture(scope="module")
def nvfp4_pair(tiny_model_dir):
    """nvfp4 services; the decode also knows ``proxy_port``, where a test puts a proxy of the prefill."""
    proxy_port = free_port()
    with nixl_pair(tiny_model_dir, more_prefills=(f"127.0.0.1:{proxy_port}",)) as (p, d):
        yield p, d, proxy_port


def test_a_share_the_decode_refuses_sends_that_prefills_transfers_over_grpc_counted(tiny_model_dir, nvfp4_pair):
    p, d, port = nvfp4_pair

    def bend(share: prefill_pb2.KVShare) -> prefill_pb2.KVShare:  # geometry fits, one region was never registered
        return bent(share, tensor=3, address=share.tensors[3].address + (1 << 40))

    ids = prompt(26, offset=13)  # no prefix shared with the other tests' prompts: each pull starts at page 0
    names = ('nvfp4_decode_kv_transfer_path_total{path="grpc"}',
             'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="open_failed"}')

    async def scenario():
        _, _, ptext0, dtext0 = await state(p.address, d.address)
        async with bending_proxy(p.address, port, bend) as proxy:
            tokens = await generate(d.address, "f", ids, proxy, 6)
            await generate(d.address, "g", prompt(11, offset=17), proxy, 2)
        load, rep, ptext, dtext = await state(p.address, d.address)
        return tokens, load, rep, deltas(ptext0, ptext, 'nvfp4_prefill_kv_transfer_grpc_reasons_total'
                                                        '{reason="no_share"}'), deltas(dtext0, dtext, *names)

    tokens, load, rep, prefill_counts, decode_counts = asyncio.run(scenario())
    assert tokens == reference(tiny_model_dir, "nvfp4", ids)
    assert decode_counts == [2, 2] and prefill_counts == [2]
    assert "with NIXL: ValueError: the shared regions are not all registered" in d.output
    assert "use gRPC" in d.output
    assert load.pool_pages_in_use == 0 and rep.ok and rep.num_in_use == 0


# -- real service processes ----------------------------------------------------------------------------------
def check_greedy_over_nixl(model_dir: str, kv_dtype: str, p, d) -> None:
    prompts = [prompt(37), prompt(21, offset=9)]
    names = [f'nvfp4_{role}_kv_transfer_path_total{{path="{path}"}}' for role in ("prefill", "decode")
             for path in ("nixl", "grpc")]

    async def scenario():
        _, _, ptext0, dtext0 = await state(p.address, d.address)
        t0 = time.perf_counter()
        outs = [await generate(d.address, f"{kv_dtype}-{i}", ids, p.address, 6) for i, ids in enumerate(prompts)]
        seconds = time.perf_counter() - t0
        load, rep, ptext, dtext = await state(p.address, d.address)
        counts = deltas(ptext0, ptext, *names[:2]) + deltas(dtext0, dtext, *names[2:])
        holds = deltas(ptext0, ptext, 'nvfp4_prefill_kv_holds_total{outcome="released"}')
        reads = deltas(dtext0, dtext, "nvfp4_decode_kv_nixl_reads_total", "nvfp4_decode_kv_nixl_descriptors_total")
        return outs, seconds, load, rep, counts, holds, reads

    outs, seconds, load, rep, counts, holds, reads = asyncio.run(scenario())
    for ids, out in zip(prompts, outs, strict=True):
        assert out == reference(model_dir, kv_dtype, ids)
    assert counts == [2, 0, 2, 0] and holds == [2]  # nixl both times, on both ends; released after the reads
    # one prefill chunk each: one READ of every layer's pages, not one per layer; each with a descriptor per part
    # (nvfp4: values and scales of K and V) and run of consecutive pages, in every layer
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    assert reads[0] == 2 and reads[1] >= 2 * layers * (4 if kv_dtype == "nvfp4" else 2)
    assert "via nixl in 1 READs of " in d.output
    assert "via nixl" in d.output and "for nixl transfers" in d.output and "NIXL agent decode-" in d.output
    assert load.pool_pages_in_use == 0
    assert rep.ok and rep.num_in_use == 0
    print(f"{kv_dtype}: 2 requests in {seconds:.2f} s;", [ln.strip() for ln in d.lines if "via nixl" in ln][-1])


def test_greedy_through_nixl_service_processes_equals_the_engine_nvfp4(tiny_model_dir, nvfp4_pair):
    p, d, _ = nvfp4_pair
    check_greedy_over_nixl(tiny_model_dir, "nvfp4", p, d)


def test_greedy_through_nixl_service_processes_equals_the_engine_bf16(tiny_model_dir):
    with nixl_pair(tiny_model_dir, "--kv-cache-dtype", "bf16") as (p, d):
        check_greedy_over_nixl(tiny_model_dir, "bf16", p, d)


# seconds after the prefill counted the nixl path (right before the header) at which the request is cancelled.
# The 300-token prompt runs as 3 chunks of 128 tokens; the page refs of the pages ready so far go out in one
# message for every layer, each message 1 s after the one before (--debug-transfer-delay-s), and the decode
# reads them (one READ) as soon as that message is in: the first at 1 s, the next at 2 s or later.
NIXL_STAGES = {
    "as soon as the request is out (before or while the prefill computes)": None,
    "after the header, before any page refs": 0.3,
    "mid-stream, a READ of every layer done, the next page refs not yet sent": 1.5,
}


def test_a_nixl_transfer_cancelled_at_every_stage_frees_every_page_on_both_sides(tiny_model_dir):
    path_metric = 'nvfp4_prefill_kv_transfer_path_total{path="nixl"}'

    async def cancel_at(p, d, i: int, after_header_s: float | None):
        paths = metric(await prefill_metrics(p.address), path_metric)
        task = asyncio.ensure_future(generate(d.address, f"c{i}", prompt(300, offset=37 * i), p.address, 4))
        if after_header_s is not None:
            for _ in range(600):  # until the header is out
                if metric(await prefill_metrics(p.address), path_metric) == paths + 1:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(after_header_s)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await state(p.address, d.address)

    async def scenario(p, d):
        out = [await cancel_at(p, d, i, at) for i, at in enumerate(NIXL_STAGES.values())]
        later = await generate(d.address, "after", prompt(23, offset=11), p.address, 6)
        return out, later

    with nixl_pair(tiny_model_dir, prefill_args=("--debug-transfer-delay-s", "1.0", "--chunked-prefill-size",
                                                  "128")) as (p, d):
        asyncio.run(generate(d.address, "warm", prompt(20, offset=3), p.address, 2))  # opens the share
        results, later = asyncio.run(scenario(p, d))
    for stage, (load, rep, _, _) in zip(NIXL_STAGES, results, strict=True):
        assert load.pool_pages_in_use == 0, stage
        assert rep.ok and rep.num_in_use == 0, stage
    ptext, dtext = results[-1][2], results[-1][3]
    # the two stages after the header each ended a hold when the stream closed (the first may have too)
    assert metric(ptext, 'nvfp4_prefill_kv_holds_total{outcome="stream_ended"}') in (2, 3)
    assert metric(dtext, 'nvfp4_decode_kv_transfer_path_total{path="nixl"}') >= 3
    assert later == reference(tiny_model_dir, "nvfp4", prompt(23, offset=11))  # the services keep serving


def test_the_transfer_benchmark_runs_the_nixl_path_beside_grpc(tiny_model_dir, tmp_path):
    import json

    from benchmarks.transfer.bench_transfer import main

    out_json = tmp_path / "transfer.json"
    rc = main(["--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--lengths", "72",
               "--paths", "grpc", "nixl", "--kv-dtypes", "nvfp4", "--decode-tokens", "3", "--warmup-len", "8",
               "--page-size", "4", "--anchor-bytes", str(8 << 20), "--log-dir", str(tmp_path / "logs"),
               "--out-json", str(out_json), "--out-md", str(tmp_path / "transfer.md")])
    assert rc == 0
    rows = {r["path"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["nixl"]["path_used"] == rows["nixl"]["ready_path_used"] == "nixl"
    assert rows["grpc"]["path_used"] == "grpc"  # the prefill's --kv-transfer nixl leaves a grpc decode on grpc
    assert rows["nixl"]["transfer_bytes"] == rows["grpc"]["transfer_bytes"] > 0
    assert rows["nixl"]["anchor_gbps"] > 0 and rows["nixl"]["of_anchor"] > 0
