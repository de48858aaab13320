"""Builds and runs the prefill gRPC server (health checking and reflection included)."""

from __future__ import annotations

import asyncio
import logging
import signal

from engine.engine import Engine
from engine.engine_loop import EngineLoop
from nvfp4_serve.grpc_server import add_health_and_reflection, bind, build_server
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve_proto import prefill_pb2, prefill_pb2_grpc
from prefill_svc.config import PrefillConfig
from prefill_svc.servicer import PrefillServicer
from prefill_svc.worker import PrefillWorker

log = logging.getLogger("prefill_svc")

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


async def serve(config: PrefillConfig) -> None:
    engine = Engine(config.engine)
    loop = EngineLoop(engine).start()
    metrics = ServiceMetrics("prefill")
    if config.metrics_port is not None:
        metrics.serve_http(config.metrics_port, config.host)
    server = build_server(config.max_message_bytes)
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(PrefillWorker(loop, config.max_message_bytes, metrics, config.debug_transfer_delay_s)), server)
    await add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.host, config.port)
    await server.start()
    log.info("prefill service listening on %s:%d (kv %s, page %d)", config.host, port,
             config.engine.cache.kv_dtype, config.engine.cache.page_size)
    print(f"prefill service ready on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    loop.stop()
