"""Thin gRPC servicer of the Prefill service: protobuf in, one worker call, protobuf out."""

from __future__ import annotations

from nvfp4_serve.load import LoadReporter
from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_svc.worker import PrefillWorker


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.reporter = LoadReporter(worker.loop, "prefill", worker.layout, worker.metrics)

    async def Prefill(self, request, context):
        async for msg in self.worker.prefill(request):
            yield msg

    async def GetLoad(self, request, context):
        return await self.reporter.load_or_abort(context)

    async def GetMetrics(self, request, context):
        await self.reporter.load_or_abort(context)
        return common_pb2.MetricsResponse(prometheus_text=self.worker.metrics.text())

    async def GetKVShare(self, request, context):
        return await self.worker.share.kv_share(request)

    async def ReleaseTransfer(self, request, context):
        return prefill_pb2.ReleaseTransferResponse(released=self.worker.share.holds.release(request.transfer_id))
