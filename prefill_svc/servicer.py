"""Thin gRPC servicer of the Prefill service: protobuf in, one worker call, protobuf out.

``add_to_server`` registers it like the generated ``add_PrefillServicer_to_server``, except that the Prefill
and PrefillLane streams' messages may also be bytes already serialized (``svc_common/kv_wire.py``: page runs framed without
protobuf copies); on the wire both are the same ``PrefillMessage``.
"""

from __future__ import annotations

import grpc

from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_svc.worker import PrefillWorker
from svc_common.load import LoadReporter


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.reporter = LoadReporter(worker.loop, "prefill", worker.layout, worker.metrics)

    async def Prefill(self, request, context):
        async for msg in self.worker.prefill(request):
            yield msg

    async def PrefillLane(self, request, context):
        async for msg in self.worker.lane(request):
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


def _serialize_message(msg: prefill_pb2.PrefillMessage | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


_UNARY = {  # method -> (request, response) message classes
    "GetLoad": (common_pb2.GetLoadRequest, common_pb2.WorkerLoad),
    "GetMetrics": (common_pb2.MetricsRequest, common_pb2.MetricsResponse),
    "GetKVShare": (prefill_pb2.KVShareRequest, prefill_pb2.KVShare),
    "ReleaseTransfer": (prefill_pb2.ReleaseTransferRequest, prefill_pb2.ReleaseTransferResponse),
}


def add_to_server(servicer: prefill_pb2_grpc.PrefillServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` (this module's, or the sender process's) on ``server``."""
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), request_deserializer=req.FromString,
                                                          response_serializer=resp.SerializeToString)
                for name, (req, resp) in _UNARY.items()}
    handlers["Prefill"] = grpc.unary_stream_rpc_method_handler(
        servicer.Prefill, request_deserializer=prefill_pb2.PrefillRequest.FromString,
        response_serializer=_serialize_message)
    handlers["PrefillLane"] = grpc.unary_stream_rpc_method_handler(
        servicer.PrefillLane, request_deserializer=prefill_pb2.PrefillLaneRequest.FromString,
        response_serializer=_serialize_message)
    service = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]
    assert set(handlers) == set(service.methods_by_name), "the Prefill service's methods changed: register each here"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
