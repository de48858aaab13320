"""The raw grpcio anchor of the KV transfer benchmark: what grpcio itself carries on this machine.

    python -m benchmarks.transfer.raw_grpc serve --port P [--http2-max-frame-bytes F]
    python -m benchmarks.transfer.raw_grpc client --address HOST:PORT --total-bytes N --message-bytes M \\
        [--channels C] [--distinct-connections] [--http2-max-frame-bytes F] [--repeat R]
                                           (prints one JSON line: GB/s per repeat and the best)

A grpc.aio unary-stream method returning ``bytes`` with identity serializers (no protobuf at all): the
server sends one prebuilt bytes object M bytes long, N / M times; the client (another process, C channels,
one stream each, concurrently) receives them. Channels of one process with the same arguments share one TCP
connection (gRPC's global subchannel pool) unless ``--distinct-connections`` gives each its own;
``--http2-max-frame-bytes`` sets the HTTP/2 frame size both ends announce (gRPC's default: 16 KiB).
This is the ceiling of any gRPC page path: our own path must
additionally read pages out of the pool and write them into another one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time

import grpc

METHOD = "/nvfp4serve.bench.Raw/Stream"
_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def options(max_frame_bytes: int, distinct: bool = False) -> list[tuple[str, int]]:
    out = list(_OPTIONS)
    if max_frame_bytes:
        out.append(("grpc.http2.max_frame_size", max_frame_bytes))
    if distinct:
        out.append(("grpc.use_local_subchannel_pool", 1))
    return out


async def serve(port: int, max_frame_bytes: int = 0) -> None:
    cache: dict[int, bytes] = {}

    async def stream(request: bytes, context):
        total, size = struct.unpack("<QQ", request)
        if size not in cache:
            cache[size] = bytes(bytearray(size))
        payload = cache[size]
        for _ in range(max(1, total // size)):
            yield payload

    handler = grpc.method_handlers_generic_handler("nvfp4serve.bench.Raw", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)})
    server = grpc.aio.server(options=options(max_frame_bytes))
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"raw grpc ready on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


async def client(address: str, total_bytes: int, message_bytes: int, channels: int, repeat: int,
                 distinct: bool = False, max_frame_bytes: int = 0) -> dict:
    chans = [grpc.aio.insecure_channel(address, options=options(max_frame_bytes, distinct)) for _ in range(channels)]
    calls = [ch.unary_stream(METHOD, request_serializer=None, response_deserializer=None) for ch in chans]
    per = max(message_bytes, total_bytes // channels)

    async def one(call) -> int:
        n = 0
        async for msg in call(struct.pack("<QQ", per, message_bytes)):
            n += len(msg)
        return n

    await asyncio.gather(*(one(c) for c in calls))  # connect and warm up
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = sum(await asyncio.gather(*(one(c) for c in calls)))
        rates.append(got / (time.perf_counter() - t0) / 1e9)
    for ch in chans:
        await ch.close()
    return {"channels": channels, "distinct_connections": distinct, "http2_max_frame_bytes": max_frame_bytes,
            "message_bytes": message_bytes, "total_bytes": per * channels,
            "gb_s": rates, "best_gb_s": max(rates)}


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("NVFP4_KEEP_FREED_BLOCKS") == "1":  # the services' heap setting (svc_common/host_malloc.py)
        from svc_common.host_malloc import keep_freed_blocks

        keep_freed_blocks()
    p = argparse.ArgumentParser("raw_grpc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--http2-max-frame-bytes", type=int, default=0, help="0: gRPC's default")
    c = sub.add_parser("client")
    c.add_argument("--address", required=True)
    c.add_argument("--total-bytes", type=int, default=1 << 30)
    c.add_argument("--message-bytes", type=int, default=1 << 20)
    c.add_argument("--channels", type=int, default=1)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--distinct-connections", action="store_true", help="one TCP connection per channel")
    c.add_argument("--http2-max-frame-bytes", type=int, default=0, help="0: gRPC's default")
    a = p.parse_args(argv)
    if a.command == "serve":
        asyncio.run(serve(a.port, a.http2_max_frame_bytes))
        return 0
    print(json.dumps(asyncio.run(client(a.address, a.total_bytes, a.message_bytes, a.channels, a.repeat,
                                        a.distinct_connections, a.http2_max_frame_bytes))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
