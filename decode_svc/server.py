"""Builds and runs the decode gRPC server (health checking and reflection included)."""

from __future__ import annotations

import asyncio
import logging
import signal

from decode_svc.config import DecodeConfig
from decode_svc.servicer import DecodeServicer
from decode_svc.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_loop import EngineLoop
from nvfp4_serve.grpc_server import add_health_and_reflection, bind, build_server
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve_proto import decode_pb2, decode_pb2_grpc

log = logging.getLogger("decode_svc")

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


async def serve(config: DecodeConfig) -> None:
    engine = Engine(config.engine)
    loop = EngineLoop(engine).start()
    metrics = ServiceMetrics("decode")
    if config.metrics_port is not None:
        metrics.serve_http(config.metrics_port, config.host)
    worker = DecodeWorker(loop, config, metrics)
    server = build_server(config.max_message_bytes)
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    await add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.host, config.port)
    await server.start()
    cap = engine.capacity()
    log.info("decode service listening on %s:%d: KV pool %s holds %d tokens", config.host, port,
             cap.kv_dtype, cap.max_tokens)
    print(f"decode service ready on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    await worker.receiver.close()
    loop.stop()
