"""One Prefill stream through a prefill's sender process (``--kv-sender process``): the caller's request goes
to the engine's process unchanged, and what comes back is handed on, converted where the engine took the
relay path:

    engine process  --header (path relay, hold)-->       sender  --header (path grpc, lanes)-->        decode
                    --KVPageRefs (a run, every layer)-->         --KVPageRun messages of each layer-->
                                                                   (exported from the pool it opened)
                    --PrefillDone-->                             (every export copied, ReleaseTransfer)
                                                                 --PrefillDone-->
    any other path (cuda-ipc, nixl): every message as it came.

Invariants: the sender reads a page only while the engine holds it (before ReleaseTransfer, and never past the
hold's deadline: an export that would start within ``_HOLD_MARGIN`` of it fails the transfer instead); a
stream that ends for any reason cancels the engine's, which frees the prompt's pages there; the caller never
sees the relay path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from nvfp4_serve_proto import prefill_pb2, prefill_pb2_grpc
from prefill_svc.lanes import LaneTransfer, TransferLanes
from prefill_svc.page_sender import PageSender
from prefill_svc.sender_metrics import SenderMetrics
from svc_common.errors import PrefillUnavailable, ServiceError, TransferTimeout
from svc_common.kv_transfer import PATH_GRPC, PATH_RELAY
from svc_common.page_export import PageExporter

_RELEASE_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


def _hold_margin(hold_timeout_s: float) -> float:
    """How long before the hold's deadline the sender stops starting exports."""
    return max(1.0, 0.1 * hold_timeout_s)


class UpstreamError(ServiceError):
    """The engine process's answer, handed to the caller with its status and message."""

    def __init__(self, error: grpc.aio.AioRpcError):
        super().__init__(error.details() or error.code().name)
        self.status_name = error.code().name


@dataclass(frozen=True)
class SenderContext:
    """What every stream of one sender process shares."""

    exporter: PageExporter  # over the engine's pool, opened at start-up
    upstream: prefill_pb2_grpc.PrefillStub  # the engine process
    lanes: TransferLanes
    per_message: int  # pages of one layer per message
    num_layers: int
    metrics: SenderMetrics
    exports_ahead: int  # --kv-exports-ahead, resolved (prefill_svc/page_sender.py: exports_ahead)


async def relay_prefill(ctx: SenderContext, request: prefill_pb2.PrefillRequest
                        ) -> AsyncIterator[prefill_pb2.PrefillMessage | bytes]:
    call = ctx.upstream.Prefill(request)
    stream = _Relayed(ctx, request)
    try:
        async for msg in call:
            out = stream.on(msg)
            if out is None:
                continue
            async for m in out:
                yield m
        await stream.finish()
    except grpc.aio.AioRpcError as e:
        raise UpstreamError(e) from None
    finally:
        call.cancel()  # the engine's stream ends with this one: its pages are freed there
        stream.close()


class _Relayed:
    def __init__(self, ctx: SenderContext, request: prefill_pb2.PrefillRequest):
        self.ctx, self.request = ctx, request
        self.header: prefill_pb2.TransferHeader | None = None
        self.passthrough = False
        self.sender: PageSender | None = None
        self.lanes: LaneTransfer | None = None
        self.completed = False
        self.hold_deadline = 0.0  # monotonic: the engine frees the pages at this time at the latest

    def on(self, msg: prefill_pb2.PrefillMessage) -> AsyncIterator | None:
        """What to send for the engine's ``msg`` (None: nothing)."""
        kind = msg.WhichOneof("payload")
        if self.passthrough:
            return _one(msg)
        if self.header is None:
            if kind != "header":
                raise PrefillUnavailable(f"the engine process sent {kind or 'an empty message'} before its header")
            if msg.header.path != PATH_RELAY:  # cuda-ipc or nixl with this caller: nothing to convert
                self.passthrough = True
                return _one(msg)
            return _one(self._start(msg))
        if kind == "page_refs":
            return self._pages(msg.page_refs)
        if kind == "done":
            return self._done(msg)
        raise PrefillUnavailable(f"the engine process sent {kind or 'an empty message'} on the relay path")

    def _start(self, msg: prefill_pb2.PrefillMessage) -> prefill_pb2.PrefillMessage:
        h = self.header = msg.header
        if not h.transfer_id or h.hold_timeout_s <= 0 or h.layout.num_layers != self.ctx.num_layers:
            raise PrefillUnavailable(f"the engine process's relay header has no hold, or {h.layout.num_layers} "
                                     f"layers where the sender's pool has {self.ctx.num_layers}")
        out = prefill_pb2.TransferHeader()
        out.CopyFrom(h)
        out.path, out.transfer_id, out.hold_timeout_s = PATH_GRPC, "", 0.0
        lanes = self.ctx.lanes.lanes_for(self.request.transfer.grpc_lanes, h.layout.num_layers, h.num_pages)
        if lanes > 1:
            self.lanes = self.ctx.lanes.open(lanes)
            out.transfer_id, out.lanes = self.lanes.transfer_id, lanes
        self.hold_deadline = time.monotonic() + h.hold_timeout_s
        self.sender = PageSender(self.ctx.exporter, self.request.request_id, self.ctx.per_message,
                                 self.ctx.num_layers, self.lanes, before_export=self._check_hold,
                                 exports_ahead=self.ctx.exports_ahead)
        return prefill_pb2.PrefillMessage(request_id=msg.request_id, header=out)

    def _check_hold(self) -> None:
        if time.monotonic() > self.hold_deadline - _hold_margin(self.header.hold_timeout_s):
            raise TransferTimeout(f"the pages were not sent within {self.header.hold_timeout_s:g} s of the "
                                  f"engine naming them (--kv-hold-timeout): the caller reads too slowly")

    def _pages(self, refs: prefill_pb2.KVPageRefs) -> AsyncIterator[bytes]:
        h = self.header
        layers = range(refs.layer, refs.layer + max(1, refs.num_layers))
        end = refs.first_page + len(refs.src_page_ids)
        if layers.start < 0 or layers.stop > self.ctx.num_layers or refs.first_page < h.first_page \
                or end > h.first_page + h.num_pages:
            raise PrefillUnavailable(f"the engine process named layers {layers.start}..{layers.stop - 1}, pages "
                                     f"{refs.first_page}..{end - 1} outside its header")
        self.hold_deadline = time.monotonic() + h.hold_timeout_s  # the engine's hold restarts at each message
        return self.sender.pages(list(refs.src_page_ids), refs.first_page, None, layers)

    async def _done(self, msg: prefill_pb2.PrefillMessage) -> AsyncIterator[prefill_pb2.PrefillMessage]:
        if self.lanes is not None:
            await self.lanes.end()
        # every export has run (each pages() completed): the engine may free the pages
        await self.ctx.upstream.ReleaseTransfer(
            prefill_pb2.ReleaseTransferRequest(transfer_id=self.header.transfer_id), timeout=_RELEASE_TIMEOUT_S)
        yield msg

    async def finish(self) -> None:
        if self.header is None:
            raise PrefillUnavailable("the engine process ended the stream before its header")
        if self.lanes is not None:
            await self.lanes.drained()
        self.completed = True
        if self.sender is not None:
            self.sender.log_line(time.perf_counter() - self.sender.t_start, "sender process")

    def close(self) -> None:
        if self.sender is not None:
            self.ctx.metrics.observe(self.sender, self.completed)
        if self.lanes is not None:
            self.ctx.lanes.close(self.lanes, None if self.completed else
                                 PrefillUnavailable("the Prefill stream of the transfer ended early"))


async def _one(msg):
    yield msg
