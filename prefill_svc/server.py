"""Builds and runs the prefill gRPC server (health checking and reflection included): in this process
(``--kv-sender thread``), or behind the sender process that serves the port (``--kv-sender process``,
``prefill_svc/sender_process.py``; this process then listens on a Unix socket only the sender calls)."""

from __future__ import annotations

import logging

from engine.engine import Engine
from engine.engine_loop import EngineLoop, favour_engine_thread
from nvfp4_serve_proto import prefill_pb2
from prefill_svc.config import SENDER_PROCESS, PrefillConfig, sender_of
from prefill_svc.page_sender import exports_ahead
from prefill_svc.servicer import PrefillServicer, add_to_server
from prefill_svc.worker import PrefillWorker
from svc_common.grpc_server import build_server, check_port, start_and_wait
from svc_common.host_malloc import keep_freed_blocks
from svc_common.kv_transfer_ipc import pool_view
from svc_common.metrics import ServiceMetrics
from svc_common.tls import TLSConfig

log = logging.getLogger(__name__)
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


async def serve(config: PrefillConfig) -> None:
    engine = Engine(config.engine)
    favour_engine_thread()
    keep_freed_blocks()  # page messages reuse freed heap pages (svc_common/host_malloc.py)
    loop = EngineLoop(engine).start()
    metrics = ServiceMetrics("prefill")
    relayed = sender_of(config, engine.pool.device) == SENDER_PROCESS
    worker = PrefillWorker(loop, config.max_message_bytes, metrics, config.faults, config.kv_transfer,
                           config.kv_hold_timeout_s, config.kv_message_bytes, config.kv_lane_timeout_s,
                           relayed=relayed, exports_ahead=exports_ahead(config.kv_exports_ahead, relayed))
    try:
        if relayed:
            await _serve_behind_sender(config, worker, loop, metrics)
        else:
            server = build_server(config.max_message_bytes, config.tls)
            add_to_server(PrefillServicer(worker), server)
            await start_and_wait(server, [SERVICE_NAME], "prefill", config.host, config.port, metrics,
                                 config.metrics_port, config.tls, alive=loop.is_alive)
    finally:
        loop.stop()


async def _serve_behind_sender(config: PrefillConfig, worker: PrefillWorker, loop: EngineLoop,
                               metrics: ServiceMetrics) -> None:
    from prefill_svc.sender_process import EngineSocket, SenderProcess, SenderSpec

    check_port(config.host, config.port)  # the sender process binds it: a taken port is one line here, not its traceback
    socket = EngineSocket()
    internal = TLSConfig(service_token=config.tls.service_token)  # the Unix link: the token, no certificates
    server = build_server(config.max_message_bytes, internal)
    add_to_server(PrefillServicer(worker), server)
    spec = SenderSpec(config.host, config.port, socket.path, config.max_message_bytes, config.kv_message_bytes,
                      config.kv_lane_timeout_s, exports_ahead(config.kv_exports_ahead, True), config.tls,
                      logging.getLogger().getEffectiveLevel())
    sender = SenderProcess(spec, pool_view(worker.engine.pool))
    log.info("the engine's process listens on unix:%s for its sender process only", socket.path)

    def alive() -> bool:
        return loop.is_alive() and sender.is_alive()

    def dead() -> str:
        return "engine loop thread died (its traceback is above)" if not loop.is_alive() else sender.why_dead()

    try:
        await start_and_wait(server, [SERVICE_NAME], "prefill", config.host, config.port, metrics,
                             config.metrics_port, internal, alive=alive, unix_path=socket.path, dead=dead,
                             on_started=sender.start)
    finally:
        sender.stop()
        socket.close()
