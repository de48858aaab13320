"""Builds and runs the prefill gRPC server (health checking and reflection included)."""

from __future__ import annotations

from engine.engine import Engine
from engine.engine_loop import EngineLoop, favour_engine_thread
from nvfp4_serve_proto import prefill_pb2
from prefill_svc.config import PrefillConfig
from prefill_svc.servicer import PrefillServicer, add_to_server
from prefill_svc.worker import PrefillWorker
from svc_common.grpc_server import build_server, start_and_wait
from svc_common.host_malloc import keep_freed_blocks
from svc_common.metrics import ServiceMetrics

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


async def serve(config: PrefillConfig) -> None:
    engine = Engine(config.engine)
    favour_engine_thread()
    keep_freed_blocks()  # page messages reuse freed heap pages (svc_common/host_malloc.py)
    loop = EngineLoop(engine).start()
    metrics = ServiceMetrics("prefill")
    worker = PrefillWorker(loop, config.max_message_bytes, metrics, config.faults, config.kv_transfer,
                           config.kv_hold_timeout_s, config.kv_message_bytes, config.kv_lane_timeout_s)
    server = build_server(config.max_message_bytes, config.tls)
    add_to_server(PrefillServicer(worker), server)
    try:
        await start_and_wait(server, [SERVICE_NAME], "prefill", config.host, config.port, metrics,
                             config.metrics_port, config.tls, alive=loop.is_alive)
    finally:
        loop.stop()
