"""A prefill service with its sender process (``--kv-sender process``): the sender serves the port and sends the
grpc path's page bytes out of the engine's pool, opened across processes (shared memory on CPU). Real
processes on free ports, driven over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import time

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.service_procs import start_many, stop_all
from tests.test_services import CPU, gen_request, generate, metric, prompt, run
from tests.test_timeouts import decode_is_idle, prefill_is_idle

SENDER = ("--kv-sender", "process")


@pytest.fixture
def services():
    """Start services together (``(module, *args)`` each, on the CPU; a decode may pull from every prefill
    started with it) and stop them after the test: their start-ups overlap."""
    started = []

    def _start(*specs: tuple[str, ...]):
        new = start_many([(module, *CPU, *args) for module, *args in specs])
        started.extend(new)
        return new

    yield _start
    stop_all(started)


def _reference(model_dir: str, kv_dtype: str, ids: list[int], max_tokens: int) -> list[int]:
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                              cache=CacheConfig(kv_dtype=kv_dtype, page_size=4, max_total_tokens=4096)))
    return eng.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


async def _prefill_metric(address: str, name: str) -> float:
    async with grpc.aio.insecure_channel(address) as ch:
        text = (await prefill_pb2_grpc.PrefillStub(ch).GetMetrics(common_pb2.MetricsRequest())).prometheus_text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _sender_pid(proc) -> int:
    return int(re.search(r"prefill sender process (\d+) started", proc.output).group(1))


def test_greedy_through_a_sender_process_and_its_lanes_equals_the_engine_with_nvfp4_at_0_5625_of_fp8s_bytes(
        services, tiny_model_dir):
    ids = prompt(64)
    sent = {}
    dtypes = ("nvfp4", "fp8_e4m3")
    args = {dt: ("--model", tiny_model_dir, "--kv-cache-dtype", dt, "--page-size", "4") for dt in dtypes}
    started = services(*(s for dt in dtypes for s in (("prefill_svc", *args[dt], *SENDER, "--kv-message-bytes", "256"),
                                                       ("decode_svc", *args[dt], "--kv-transfer", "grpc",
                                                        "--kv-grpc-lanes", "3"))))
    for i, dt in enumerate(dtypes):
        p, d = started[2 * i], started[2 * i + 1]
        tokens, msgs = run(generate(d.address, gen_request("t", ids, p.address, max_tokens=4)))
        assert tokens == _reference(tiny_model_dir, dt, ids, 4)
        assert msgs[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH
        sent[dt] = run(metric(d.address, "nvfp4_decode_kv_transfer_bytes_total"))
        assert "over 2 lanes" in d.output  # the tiny model has two layers: one lane each
        rep = run(decode_is_idle(d.address))
        assert rep.ok and rep.num_in_use == 0
        # counted as what the decode got (grpc, pages in bytes), sent by the sender process
        assert run(_prefill_metric(p.address, 'nvfp4_prefill_kv_transfer_path_total{path="grpc"}')) == 1
        assert "via grpc (sender process)" in p.output
        assert run(_prefill_metric(p.address, 'nvfp4_prefill_sender_transfers_total{outcome="ok"}')) == 1
        assert run(_prefill_metric(p.address, "nvfp4_prefill_sender_bytes_total")) > \
            run(metric(d.address, "nvfp4_decode_kv_transfer_bytes_total"))  # the pages and their framing
        assert run(_prefill_metric(p.address, "nvfp4_prefill_sender_export_seconds_total")) > 0
        assert run(prefill_is_idle(p.address)).pool_pages_in_use == 0  # released: the engine freed its pages
    assert sent["fp8_e4m3"] > 0
    assert sent["nvfp4"] == pytest.approx(0.5625 * sent["fp8_e4m3"])


def test_a_transfer_cancelled_mid_stream_frees_every_page_on_both_sides(services, tiny_model_dir):
    args = ("--model", tiny_model_dir, "--page-size", "4")
    # five chunks, each chunk's pages named 1 s apart: a cancel at 1.5 s lands mid-transfer
    p, d = services(("prefill_svc", *args, *SENDER, "--chunked-prefill-size", "8", "--debug-transfer-delay-s", "1.0"),
                    ("decode_svc", *args, "--kv-transfer", "grpc"))

    async def scenario():
        async with grpc.aio.insecure_channel(d.address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(gen_request("x", prompt(40), p.address))
            await asyncio.sleep(1.5)
            call.cancel()
        # each side frees its pages once the cancel reaches it, between its engine steps: poll both, bounded
        return await prefill_is_idle(p.address), await decode_is_idle(d.address)

    load, rep = run(scenario())
    assert load.pool_pages_in_use == 0 and load.num_running == 0
    assert rep.ok and rep.num_in_use == 0
    assert run(_prefill_metric(p.address, 'nvfp4_prefill_sender_transfers_total{outcome="failed"}')) == 1
    tokens, _ = run(generate(d.address, gen_request("after", prompt(6), p.address, max_tokens=3)))
    assert len(tokens) == 3  # both stay up


def test_the_engines_answers_reach_the_caller_the_token_guards_both_links_and_each_process_ends_with_the_other(
        services, tiny_model_dir):
    token = "sk-sender-test-5b1c"
    # q: a second prefill with a sender, started alongside, whose engine's process is killed below
    p, q = services(("prefill_svc", "--model", tiny_model_dir, "--page-size", "4", *SENDER, "--service-token", token),
                    ("prefill_svc", "--model", tiny_model_dir, "--page-size", "4", *SENDER))
    md = (("authorization", f"Bearer {token}"),)
    socket = re.search(r"listens on unix:(\S+) for its sender", p.output).group(1)

    async def scenario():
        async with grpc.aio.insecure_channel(p.address) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in stub.Prefill(prefill_pb2.PrefillRequest(request_id="b", token_ids=[1, 10**7]),
                                            metadata=md):
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as lane:
                async for _ in stub.PrefillLane(prefill_pb2.PrefillLaneRequest(transfer_id="abc", lane=1),
                                                metadata=md):
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as anon:
                await stub.GetLoad(common_pb2.GetLoadRequest())
            released = await stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(transfer_id="nope"),
                                                  metadata=md)
            load = await stub.GetLoad(common_pb2.GetLoadRequest(), metadata=md)
        async with grpc.aio.insecure_channel(f"unix:{socket}") as ch:  # the Unix link without the token
            with pytest.raises(grpc.aio.AioRpcError) as inner:
                await prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest())
        return bad.value, lane.value, anon.value, inner.value, released, load

    bad, lane, anon, inner, released, load = run(scenario())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab" in bad.details()
    assert lane.code() == grpc.StatusCode.NOT_FOUND
    assert anon.code() == inner.code() == grpc.StatusCode.UNAUTHENTICATED
    # answered by the engine's process, through the Unix link that requires the same token
    assert not released.released and load.role == "prefill" and load.pool_pages_total > 0

    directory = os.path.dirname(socket)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700 and os.stat(directory).st_uid == os.getuid()
    os.kill(_sender_pid(p), signal.SIGKILL)  # the sender dies: the service exits non-zero (to be restarted)
    assert p.popen.wait(timeout=30) != 0
    assert "its sender process exited" in p.output
    assert not os.path.exists(directory)  # the socket's directory goes with the process

    pid = _sender_pid(q)
    q.stop(sig_kill=True)  # the engine's process dies: its sender follows
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the sender process outlived the engine's process")


def test_auto_takes_the_sender_process_for_a_cuda_pool_only(tiny_model_dir):
    import torch

    from engine.config import EngineConfig
    from prefill_svc.config import PrefillConfig, sender_of

    cfg = PrefillConfig(engine=EngineConfig(model_dir=tiny_model_dir, device="cpu"))
    assert sender_of(cfg, torch.device("cpu")) == "thread"
    assert sender_of(cfg, torch.device("cuda", 0)) == "process"
    for choice in ("thread", "process"):
        assert sender_of(PrefillConfig(engine=cfg.engine, kv_sender=choice), torch.device("cuda", 0)) == choice
    with pytest.raises(ValueError, match="--kv-sender"):
        PrefillConfig(engine=cfg.engine, kv_sender="fork")
