"""Thin gRPC servicer of a prefill's sender process: the Prefill service as callers know it. Prefill streams go
through ``sender_stream.relay_prefill``, lanes are served here, every other call is the engine process's
answer (its status included; GetMetrics with the sender's own counters appended)."""

from __future__ import annotations

import grpc

from nvfp4_serve_proto import prefill_pb2_grpc
from prefill_svc.sender_stream import SenderContext, UpstreamError, relay_prefill

_UNARY_TIMEOUT_S = 30.0


class SenderServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, ctx: SenderContext):
        self.ctx = ctx

    async def Prefill(self, request, context):
        async for msg in relay_prefill(self.ctx, request):
            yield msg

    async def PrefillLane(self, request, context):
        async for msg in self.ctx.lanes.serve_lane(request):
            yield msg

    async def _forward(self, name: str, request):
        try:
            return await getattr(self.ctx.upstream, name)(request, timeout=_UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise UpstreamError(e) from None

    async def GetLoad(self, request, context):
        return await self._forward("GetLoad", request)

    async def GetMetrics(self, request, context):
        """The engine process's metrics, then the sender's own (``prefill_svc/sender_metrics.py``)."""
        out = await self._forward("GetMetrics", request)
        out.prometheus_text += self.ctx.metrics.text()
        return out

    async def GetKVShare(self, request, context):
        return await self._forward("GetKVShare", request)

    async def ReleaseTransfer(self, request, context):
        return await self._forward("ReleaseTransfer", request)
