"""The nixl KV transfer path on the CPU: NIXL (UCX backend) reads the prefill's pool pages into the decode's.

Real prefill and decode service processes with --kv-transfer nixl on both ends give the engine's own greedy
output for nvfp4 and bf16 pools, take the nixl path (metrics), and a transfer cancelled mid-stream leaves no
page held on either side. The path rule chooses nixl only when both ends ask for it; a share whose geometry
or addresses do not fit this decode's pool is refused, and that prefill's transfers take gRPC (counted).

Skipped, saying why, where nixl cannot be imported or its UCX agent cannot start (CI installs no nixl).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import subprocess
import sys
import time

import grpc
import pytest
import torch

from engine.kv_pool import KVPool
from nvfp4_serve.grpc_server import build_server
from nvfp4_serve.kv_copy import PageImporter
from nvfp4_serve.kv_transfer import FALLBACK_REASONS, PATH_NIXL, select_path
from nvfp4_serve.kv_transfer_ipc import describe_tensors
from nvfp4_serve.kv_transfer_nixl import check_nixl_share
from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.service_procs import free_port, start
from tests.test_kv_transfer_gpu import generate, state
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


# -- path rule -----------------------------------------------------------------------------------------------
def ep(mode: str, boot: str = "boot-a", device: str = "cuda:GPU-1", host: str = "h1"):
    return common_pb2.TransferEndpoint(hostname=host, boot_id=boot, device=device, kv_transfer=mode)


@pytest.mark.parametrize("theirs", [ep("nixl"), ep("nixl", boot="boot-b", host="h2"), ep("nixl", device="cpu"),
                                    ep("nixl", boot="")])
def test_nixl_on_both_ends_selects_nixl_on_any_host_and_device(theirs):
    for mine in (ep("nixl"), ep("nixl", device="cpu", boot="boot-c")):
        assert select_path(mine, theirs, "decode", "prefill") == (PATH_NIXL, "", "")
        assert select_path(theirs, mine, "prefill", "decode").path == PATH_NIXL  # symmetric


@pytest.mark.parametrize("other", ["auto", "grpc", "cuda-ipc"])
@pytest.mark.parametrize("theirs", [ep("?"), ep("?", boot="boot-b"), ep("?", device="cpu")])
def test_nixl_on_one_end_only_keeps_the_rule_of_auto(other, theirs):
    theirs.kv_transfer = other
    for mine_mode in ("nixl", "auto"):
        assert select_path(ep(mine_mode), theirs, "decode", "prefill")[:2] == \
            select_path(ep("auto"), theirs, "decode", "prefill")[:2]
    assert select_path(ep("nixl"), ep("grpc"), "decode", "prefill").reason == "kv_transfer_grpc"
    assert "nixl_unavailable" in FALLBACK_REASONS


# -- share checks --------------------------------------------------------------------------------------------
def cpu_pool(kv_dtype: str = "nvfp4", num_pages: int = 12) -> KVPool:
    return KVPool(kv_dtype, num_layers=2, num_pages=num_pages, page_size=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def exported():
    """A nixl share of a CPU pool as a prefill exports it (NIXL's own fields stand-ins: only checked here)."""
    pool = cpu_pool()
    tensors = describe_tensors(pool)
    for st in tensors:
        t = getattr(pool.layers[st.layer], st.part)
        st.address, st.num_bytes = t.data_ptr(), t.numel() * t.element_size()
    return pool, None, prefill_pb2.KVShare(num_pages=12, tensors=tensors, nixl_metadata=b"metadata",
                                           nixl_agent="prefill-x", nixl_mem_type="DRAM")


def bent(share: prefill_pb2.KVShare, tensor: int = 0, **fields) -> prefill_pb2.KVShare:
    out = prefill_pb2.KVShare()
    out.CopyFrom(share)
    for k, v in fields.items():
        if k in ("num_pages", "nixl_mem_type", "nixl_metadata"):
            setattr(out, k, v)
        elif k == "shape":
            del out.tensors[tensor].shape[:]
            out.tensors[tensor].shape.extend(v)
        else:
            setattr(out.tensors[tensor], k, v)
    return out


def test_a_share_of_this_pools_geometry_is_accepted_with_one_region_per_tensor(exported):
    pool, _, share = exported
    layers = check_nixl_share(share, cpu_pool())
    assert len(share.tensors) == 2 * 4
    assert layers[1]["v_sf"].address == pool.layers[1].v_sf.data_ptr()
    assert layers[0]["k"].page_bytes == pool.layers[0].k[0].numel()


@pytest.mark.parametrize("change, words", [
    ({"shape": [12, 4, 2, 8]}, "expected uint8 [12, 4, 2, 16]"),  # another head_dim
    ({"num_bytes": 12 * 4 * 2 * 16 + 1}, "12 pages need"),
    ({"address": 0}, "outside the address space"),
    ({"address": (1 << 63) - 100}, "outside the address space"),
    ({"tensor": 1, "address": None}, "overlap"),  # tensor 1 starts inside tensor 0
    ({"nixl_mem_type": "HBM"}, "not DRAM or VRAM"),
    ({"nixl_metadata": b""}, "no NIXL agent metadata"),
])
def test_a_share_with_wrong_geometry_or_addresses_is_refused(exported, change, words):
    _, _, share = exported
    if change.get("address", 1) is None:
        change = {"tensor": 1, "address": share.tensors[0].address + 16}
    with pytest.raises(ValueError, match=re.escape(words)):
        check_nixl_share(bent(share, **change), cpu_pool())


def test_pages_written_by_a_nixl_read_are_checked_like_copies_a_nan_scale_fails_the_transfer():
    pool = cpu_pool()
    for lkv in pool.layers:
        lkv.k_sf.view(torch.uint8).fill_(0x38)  # 1.0
        lkv.v_sf.view(torch.uint8).fill_(0x38)
    pool.layers[1].k_sf.view(torch.uint8)[5, 0] = 0x7F  # an E4M3 NaN scale in token slot 0 of page 5
    pool.layers[0].v_sf.view(torch.uint8)[7, 3] = 0xFF  # a NaN in slot 3 of page 7: past the prompt's 3 tokens
    clean = PageImporter(pool)
    clean.check_written(1, [3, 4], 8)
    clean.check_written(0, [7], 3)
    clean.finish()  # nothing flagged
    poisoned = PageImporter(pool)
    poisoned.check_written(1, [4, 5], 5)  # page 5 holds the prompt's 5th token
    with pytest.raises(ValueError, match="NaN or inf"):
        poisoned.finish()


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
        return outs, seconds, load, rep, counts, holds

    outs, seconds, load, rep, counts, holds = asyncio.run(scenario())
    for ids, out in zip(prompts, outs, strict=True):
        assert out == reference(model_dir, kv_dtype, ids)
    assert counts == [2, 0, 2, 0] and holds == [2]  # nixl both times, on both ends; released after the reads
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


def test_a_nixl_transfer_cancelled_mid_stream_frees_every_page_on_both_sides(tiny_model_dir):
    async def scenario(p, d):
        task = asyncio.ensure_future(generate(d.address, "c", prompt(300), p.address, 4))
        for _ in range(600):  # until the header is out (the path is counted right before it)
            if metric(await prefill_metrics(p.address), 'nvfp4_prefill_kv_transfer_path_total{path="nixl"}') == 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # layer 0's page refs were due 1 s after the header, layer 1's are due at 2 s
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await state(p.address, d.address)

    with nixl_pair(tiny_model_dir, prefill_args=("--debug-transfer-delay-s", "1.0")) as (p, d):
        asyncio.run(generate(d.address, "warm", prompt(20, offset=3), p.address, 2))  # opens the share
        load, rep, ptext, dtext = asyncio.run(scenario(p, d))
    assert load.pool_pages_in_use == 0
    assert metric(ptext, 'nvfp4_prefill_kv_holds_total{outcome="stream_ended"}') == 1
    assert metric(dtext, 'nvfp4_decode_kv_transfer_path_total{path="nixl"}') == 2
    assert rep.ok and rep.num_in_use == 0


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
