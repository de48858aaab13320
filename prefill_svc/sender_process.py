"""A prefill's sender process (``--kv-sender process``): the process that serves the Prefill service's port and
sends the grpc path's page bytes, beside the engine's process, which then shares its GIL with nothing but
its own light calls.

    callers --Prefill (grpc pages) / PrefillLane / GetLoad ...--> sender process (--host:--port)
                                                                    |  Unix socket, in a directory of this user's
    engine process (prefill_svc/server.py) <--the same calls------- +  (relay: pages named, not sent)

Why: on the grpc path gRPC copies every sent message into its own buffer while holding the GIL, and the
exports wait for it too; in the engine's process that stalls the engine thread (the prefill ran 85-87% of
the colocated engine's prompt tokens/s while sending, 95-97% while the decode copied pages over CUDA IPC).

The sender opens the engine's pool once, at start-up, through ``torch.multiprocessing`` (CUDA IPC for a
CUDA pool, shared memory for a CPU pool: tests run it on CPU), so it reads pages where the engine wrote
them, as the decode does on the cuda-ipc path. Lifetime: the sender is a child of the engine's process; either
one exits when the other has (the engine's process fails so that its supervisor restarts both).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

import torch
import torch.multiprocessing

from svc_common.kv_transfer_ipc import PoolView
from svc_common.tls import TLSConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderSpec:
    """What the sender process needs besides the pool: where it listens, where the engine listens, how it
    frames page messages."""

    host: str
    port: int
    engine_socket: str  # the engine process's Unix socket
    max_message_bytes: int
    kv_message_bytes: int
    lane_timeout_s: float
    exports_ahead: int  # page exports in flight per transfer
    tls: TLSConfig = field(default_factory=TLSConfig)  # the public port's (the Unix link carries its token only)
    log_level: int = logging.INFO


class SenderProcess:
    """The engine process's handle on its sender: ``start`` it once the engine's Unix socket listens."""

    def __init__(self, spec: SenderSpec, view: PoolView):
        ctx = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        # the pool's tensors are pickled by torch's reductions: CUDA IPC handles, or a CPU tensor's storage
        # moved into shared memory in place (the engine keeps writing the same pages)
        self.process = ctx.Process(target=_main, args=(spec, view.num_pages, list(view.layers)), name="prefill-sender",
                                   daemon=True)

    def start(self) -> None:
        self.process.start()
        log.info("prefill sender process %d started: it serves the Prefill port and sends grpc page bytes",
                 self.process.pid)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def why_dead(self) -> str:
        return f"its sender process exited with {self.process.exitcode}"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class EngineSocket:
    """A Unix socket path in a fresh directory only this user can enter; removed with ``close``."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="nvfp4-prefill-")  # mode 0700
        self.path = os.path.join(self.directory, "engine.sock")

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# The GIL switch interval of the sender (CPython's default: 5 ms). Its export threads release the GIL for each
# copy and need it back in between; behind the gRPC thread (which holds it while copying each sent message)
# a 5 ms interval can keep one waiting that long every time.
SWITCH_INTERVAL_S = 5e-4


def _main(spec: SenderSpec, num_pages: int, layers: list[dict[str, torch.Tensor]]) -> None:
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(spec, PoolView(num_pages, tuple(layers))))


async def _serve(spec: SenderSpec, view: PoolView) -> None:
    from nvfp4_serve_proto import prefill_pb2, prefill_pb2_grpc
    from prefill_svc.lanes import TransferLanes
    from prefill_svc.page_sender import pages_per_message
    from prefill_svc.sender_metrics import SenderMetrics
    from prefill_svc.sender_servicer import SenderServicer
    from prefill_svc.sender_stream import SenderContext
    from prefill_svc.servicer import add_to_server
    from svc_common.grpc_server import build_server, server_options, start_and_wait
    from svc_common.host_malloc import keep_freed_blocks
    from svc_common.page_export import PageExporter
    from svc_common.tls import open_channel

    keep_freed_blocks()  # page messages reuse freed heap pages (svc_common/host_malloc.py)
    exporter = PageExporter(view)
    channel = open_channel(f"unix:{spec.engine_socket}", TLSConfig(service_token=spec.tls.service_token),
                           server_options(spec.max_message_bytes))
    ctx = SenderContext(exporter, prefill_pb2_grpc.PrefillStub(channel), TransferLanes(spec.lane_timeout_s),
                        pages_per_message(spec.max_message_bytes, spec.kv_message_bytes, exporter.page_bytes_per_layer),
                        len(view.layers), SenderMetrics(), spec.exports_ahead)
    server = build_server(spec.max_message_bytes, spec.tls)
    add_to_server(SenderServicer(ctx), server)
    parent = multiprocessing.parent_process()
    name = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
    try:
        await start_and_wait(server, [name], "prefill", spec.host, spec.port, tls=spec.tls,
                             alive=parent.is_alive if parent is not None else None,
                             dead=lambda: "the engine process it sends for has exited")
    finally:
        await channel.close()
