"""A prefill and a decode service in this process (real engines, engine loops and gRPC servers on free ports)
with the knobs the disaggregation tests need: a gate that stops the prefill engine before a given chunk of
chunked prefill, and the decode's deployment naming the prefill."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from decode_svc.config import DecodeConfig
from decode_svc.servicer import DecodeServicer
from decode_svc.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.engine_loop import EngineLoop
from engine.model_runner import ModelRunner
from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from prefill_svc.servicer import PrefillServicer, add_to_server
from prefill_svc.worker import PrefillWorker
from svc_common.grpc_server import build_server
from svc_common.metrics import ServiceMetrics


class ChunkGate:
    """Stops ``runner`` right before its ``index``-th extend call (0-based) until ``release``; ``reached`` is
    set once it is waiting there. Wraps the real runner: the engine computes exactly what it would."""

    def __init__(self, runner: ModelRunner, index: int, timeout_s: float = 60.0):
        self.index, self.calls = index, 0
        self.reached, self.released = threading.Event(), threading.Event()
        inner = runner.extend

        def extend(*args, **kw):
            if self.calls == self.index:
                self.reached.set()
                self.released.wait(timeout_s)
            self.calls += 1
            return inner(*args, **kw)

        runner.extend = extend

    def release(self) -> None:
        self.released.set()


def engine(model_dir: str, kv_dtype: str = "nvfp4", page_size: int = 4, chunk_size: int = 8) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                               cache=CacheConfig(kv_dtype=kv_dtype, page_size=page_size, max_total_tokens=2048),
                               scheduler=SchedulerConfig(chunk_size=chunk_size)))


@dataclass
class PD:
    prefill: PrefillWorker
    decode: DecodeWorker
    prefill_address: str
    decode_address: str

    def request(self, rid: str, ids: list[int], max_tokens: int = 4) -> decode_pb2.GenerateRequest:
        sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return decode_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling=sp,
                                          prefill_address=self.prefill_address)

    async def generate(self, rid: str, ids: list[int], max_tokens: int = 4) -> list[int]:
        async with grpc.aio.insecure_channel(self.decode_address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            return [t async for m in stub.Generate(self.request(rid, ids, max_tokens)) for t in m.token_ids]

    async def idle(self, timeout_s: float = 30.0) -> tuple[common_pb2.WorkerLoad, decode_pb2.IntegrityReport]:
        """Once no page is in use on either side (aborts are applied between engine steps): the prefill's load
        and the decode's integrity report."""
        async with grpc.aio.insecure_channel(self.prefill_address) as pch, \
                grpc.aio.insecure_channel(self.decode_address) as dch:
            pstub, dstub = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
            for _ in range(int(timeout_s / 0.05)):
                load = await pstub.GetLoad(common_pb2.GetLoadRequest())
                rep = await dstub.CheckIntegrity(decode_pb2.CheckIntegrityRequest())
                if load.pool_pages_in_use == 0 and rep.num_in_use == 0:
                    break
                await asyncio.sleep(0.05)
            return load, rep


@contextlib.asynccontextmanager
async def services(model_dir: str, kv_dtype: str = "nvfp4", page_size: int = 4, chunk_size: int = 8,
                   also_allowed: tuple[str, ...] = (), grpc_lanes: int = 1,
                   lane_timeout_s: float = 30.0) -> AsyncIterator[PD]:
    """The pair; the decode's deployment names the prefill and ``also_allowed`` (e.g. a fake prefill), and
    spreads each transfer over ``grpc_lanes`` streams."""
    pe, de = engine(model_dir, kv_dtype, page_size, chunk_size), engine(model_dir, kv_dtype, page_size, chunk_size)
    ploop, dloop = EngineLoop(pe).start(), EngineLoop(de).start()
    prefill = PrefillWorker(ploop, 16 << 20, ServiceMetrics("prefill"), kv_transfer="grpc",
                            kv_lane_timeout_s=lane_timeout_s)
    ps, ds = build_server(16 << 20), build_server(16 << 20)
    add_to_server(PrefillServicer(prefill), ps)
    paddr = f"127.0.0.1:{ps.add_insecure_port('127.0.0.1:0')}"
    decode = DecodeWorker(dloop, DecodeConfig(engine=de.config, kv_transfer="grpc", kv_grpc_lanes=grpc_lanes,
                                              prefill_addresses=(paddr, *also_allowed)), ServiceMetrics("decode"))
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), ds)
    daddr = f"127.0.0.1:{ds.add_insecure_port('127.0.0.1:0')}"
    await ps.start()
    await ds.start()
    try:
        yield PD(prefill, decode, paddr, daddr)
    finally:
        await ds.stop(None)
        await ps.stop(None)
        await decode.receiver.close()
        ploop.stop()
        dloop.stop()
