"""Builds and runs the decode gRPC server (health checking and reflection included)."""

from __future__ import annotations

import logging

from decode_svc.config import DecodeConfig
from decode_svc.servicer import DecodeServicer
from decode_svc.worker import DecodeWorker
from engine.engine import Engine
from engine.engine_loop import EngineLoop, favour_engine_thread
from nvfp4_serve_proto import decode_pb2, decode_pb2_grpc
from svc_common.grpc_server import build_server, start_and_wait
from svc_common.host_malloc import keep_freed_blocks
from svc_common.metrics import ServiceMetrics

log = logging.getLogger("decode_svc")

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


async def serve(config: DecodeConfig) -> None:
    engine = Engine(config.engine)
    favour_engine_thread()
    keep_freed_blocks()  # page messages reuse freed heap pages (svc_common/host_malloc.py)
    loop = EngineLoop(engine, decode_interval_while_pulling_s=config.decode_interval_while_pulling_s).start()
    if config.decode_interval_while_pulling_s:
        log.info("decode steps start >= %.0f ms apart while prompts are pulled (a prefill shares this GPU)",
                 config.decode_interval_while_pulling_s * 1e3)
    metrics = ServiceMetrics("decode")
    worker = DecodeWorker(loop, config, metrics)
    server = build_server(config.max_message_bytes, config.tls)
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    cap = engine.capacity()
    log.info("decode service: KV pool %s holds %d tokens", cap.kv_dtype, cap.max_tokens)
    try:
        await start_and_wait(server, [SERVICE_NAME], "decode", config.host, config.port, metrics, config.metrics_port,
                             config.tls, alive=loop.is_alive)
    finally:
        await worker.receiver.close()
        loop.stop()
