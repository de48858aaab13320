"""Thin gRPC servicer of the Decode service: protobuf in, one worker/engine call, protobuf out."""

from __future__ import annotations

from decode_svc.worker import DecodeWorker
from engine.integrity import IntegrityError
from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc
from svc_common.load import LoadReporter


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self.reporter = LoadReporter(worker.loop, "decode", worker.layout, worker.metrics)

    async def Generate(self, request, context):
        async for msg in self.worker.generate(request):
            yield msg

    async def GetLoad(self, request, context):
        return await self.reporter.load_or_abort(context)

    async def GetMetrics(self, request, context):
        await self.reporter.load_or_abort(context)
        return common_pb2.MetricsResponse(prometheus_text=self.worker.metrics.text())

    async def FlushCache(self, request, context):
        freed, idle = await self.worker.flush_cache()
        return decode_pb2.FlushCacheResponse(num_pages_freed=freed, flushed=idle)

    async def CheckIntegrity(self, request, context):
        try:
            r = await self.worker.check_integrity()
        except IntegrityError as e:
            return decode_pb2.IntegrityReport(ok=False, message=str(e))
        return decode_pb2.IntegrityReport(ok=True, message="ok", num_total=r.num_total, num_free=r.num_free,
                                          num_cached=r.num_cached, num_in_use=r.num_in_use)
