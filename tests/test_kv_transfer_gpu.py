"""GPU: prefill and decode services as real processes on one GPU, KV pages over gRPC bytes or CUDA IPC.

Both paths must give the single-process engine's greedy output for nvfp4 and fp8_e4m3, and leave no page
held on either side; the cuda-ipc path must be the one taken (metrics), and a cancelled cuda-ipc request
must free the prefill's pages. Two processes on one GPU exercise the whole IPC path except the NVLink hop.
"""

from __future__ import annotations

import asyncio
import functools
import re
import subprocess
import sys

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.service_procs import start

pytestmark = pytest.mark.gpu

GPU = ("--device", "cuda", "--max-total-tokens", "8192", "--page-size", "16")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny checkpoint with head_dim 128 (the GPU kernels' shape)."""
    from offline.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("gpu128") / "m", num_layers=2, hidden_size=256, num_heads=8,
                               num_kv_heads=2, head_dim=128, intermediate_size=512, seed=3))


def prompt(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % 400 + 3 for i in range(n)]


def reference(model_dir: str, kv_dtype: str, ids: list[int], max_tokens: int) -> list[int]:
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(EngineConfig(model_dir=model_dir, device="cuda",
                              cache=CacheConfig(kv_dtype=kv_dtype, page_size=16, max_total_tokens=8192)))
    out = eng.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids
    del eng
    return out


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def generate(address: str, rid: str, ids: list[int], prefill: str, max_tokens: int) -> list[int]:
    sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = decode_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling=sp, prefill_address=prefill)
    async with grpc.aio.insecure_channel(address) as ch:
        return [t async for m in decode_pb2_grpc.DecodeStub(ch).Generate(req) for t in m.token_ids]


async def state(prefill: str, decode: str):
    """(prefill load, decode integrity, prefill metrics, decode metrics) once the prefill holds no page."""
    async with grpc.aio.insecure_channel(prefill) as pch, grpc.aio.insecure_channel(decode) as dch:
        pstub, dstub = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
        for _ in range(100):
            load = await pstub.GetLoad(common_pb2.GetLoadRequest())
            if load.pool_pages_in_use == 0:
                break
            await asyncio.sleep(0.05)
        rep = await dstub.CheckIntegrity(decode_pb2.CheckIntegrityRequest())
        ptext = (await pstub.GetMetrics(common_pb2.MetricsRequest())).prometheus_text
        dtext = (await dstub.GetMetrics(common_pb2.MetricsRequest())).prometheus_text
    return load, rep, ptext, dtext


@functools.cache
def _nixl_cannot_start() -> str:
    """Why NIXL's UCX agent cannot start here ("" when it can), probed in a child process: once loaded, nixl's
    libraries must stay out of the test process (see tests/test_kv_transfer_nixl.py)."""
    probe = "from nixl._api import nixl_agent, nixl_agent_config\nnixl_agent('probe', nixl_agent_config(backends=['UCX']))"
    out = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60)
    return "" if out.returncode == 0 else (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:300]


@pytest.mark.parametrize("path", ["cuda-ipc", "grpc", "grpc-thread", "nixl"])
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3"])
def test_greedy_through_prefill_and_decode_processes_equals_the_engine(model_dir, kv_dtype, path):
    """grpc: the prefill's sender process (the default on CUDA) sends the bytes; grpc-thread: its engine process."""
    if path == "nixl" and (why := _nixl_cannot_start()):
        pytest.skip(f"nixl cannot be imported or its UCX agent cannot start here ({why}); install the nixl extra")
    sender = ("--kv-sender", "thread") if path == "grpc-thread" else ()
    path = path.removesuffix("-thread")
    args = ("--model", model_dir, "--kv-cache-dtype", kv_dtype, *GPU, "--kv-transfer", path)
    p = start("prefill_svc", *args, *sender)
    d = start("decode_svc", *args, "--prefill-addresses", p.address)
    try:
        prompts = [prompt(137), prompt(45, offset=11)]
        outs = [asyncio.run(generate(d.address, f"r{i}", ids, p.address, 12)) for i, ids in enumerate(prompts)]
        load, rep, ptext, dtext = asyncio.run(state(p.address, d.address))
    finally:
        p.stop()
        d.stop()
    for ids, out in zip(prompts, outs):
        assert out == reference(model_dir, kv_dtype, ids, 12)
    for role, text in (("prefill", ptext), ("decode", dtext)):
        assert metric(text, f'nvfp4_{role}_kv_transfer_path_total{{path="{path}"}}') == 2, text
    if path in ("cuda-ipc", "nixl"):  # GPU pools read in place (CUDA IPC, or NIXL over UCX's CUDA transports)
        assert metric(ptext, 'nvfp4_prefill_kv_holds_total{outcome="released"}') == 2
        assert f"via {path}" in d.output
        assert "opened the KV pool of prefill" in d.output if path == "cuda-ipc" else "NIXL agent decode-" in d.output
    else:
        assert metric(dtext, 'nvfp4_decode_kv_transfer_grpc_reasons_total{reason="kv_transfer_grpc"}') == 2
        assert ("via grpc (engine process)" if sender else "via grpc (sender process)") in p.output
    assert load.pool_pages_in_use == 0
    assert rep.ok and rep.num_in_use == 0


def test_a_cancelled_cuda_ipc_transfer_frees_the_prefill_pages(model_dir):
    args = ("--model", model_dir, *GPU, "--kv-transfer", "cuda-ipc")
    p = start("prefill_svc", *args, "--debug-transfer-delay-s", "1.0")
    d = start("decode_svc", *args, "--prefill-addresses", p.address)

    async def scenario():
        task = asyncio.ensure_future(generate(d.address, "c", prompt(300), p.address, 4))
        async with grpc.aio.insecure_channel(p.address) as ch:
            for _ in range(600):  # until the header is out: the path is counted right before it
                text = (await prefill_pb2_grpc.PrefillStub(ch).GetMetrics(common_pb2.MetricsRequest())).prometheus_text
                if metric(text, 'nvfp4_prefill_kv_transfer_path_total{path="cuda-ipc"}') == 2:
                    break
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the first page refs are due 1 s after the header
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await state(p.address, d.address)

    try:
        asyncio.run(generate(d.address, "warm", prompt(20, offset=3), p.address, 2))  # opens the share
        load, rep, ptext, _ = asyncio.run(scenario())
    finally:
        p.stop()
        d.stop()
    assert load.pool_pages_in_use == 0
    assert metric(ptext, 'nvfp4_prefill_kv_holds_total{outcome="stream_ended"}') == 1
    assert rep.ok and rep.num_in_use == 0
