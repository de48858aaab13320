"""The KV receive path: pull a prompt's missing pages from a prefill service into pages already
allocated here, checking the handshake and every message, under a deadline per state."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import grpc

from decode_svc.config import Timeouts
from engine.kv_pool import KVPool, PagePayload
from engine.request import PullStart
from engine.sampling import SamplingParams
from nvfp4_serve.convert import sampling_to_proto
from nvfp4_serve.errors import InvalidRequest, LayoutMismatch, PrefillUnavailable, TransferTimeout
from nvfp4_serve.grpc_server import server_options
from nvfp4_serve.layout import check_layout
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve.tls import TLSConfig, open_channel
from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc

# A restarted prefill is reached again within a second (gRPC's default backoff grows to 120 s).
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                      ("grpc.max_reconnect_backoff_ms", 1000)]


class KVReceiver:
    def __init__(self, pool: KVPool, layout: common_pb2.KVLayout, metrics: ServiceMetrics, timeouts: Timeouts,
                 max_message_bytes: int, run_on_engine: Callable[[Callable[[], None]], Awaitable[None]],
                 tls: TLSConfig | None = None):
        """``run_on_engine`` runs a pool write on the engine loop thread: writes are ordered before any
        later abort of the request, so a page is never written after it was freed."""
        self.pool = pool
        self.run_on_engine = run_on_engine
        self.layout = layout
        self.metrics = metrics
        self.timeouts = timeouts
        self.max_message_bytes = max_message_bytes
        self.tls = tls or TLSConfig()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(
                address, self.tls, [*server_options(self.max_message_bytes), *_RECONNECT_OPTIONS])
        return prefill_pb2_grpc.PrefillStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    async def pull(self, address: str, start: PullStart, token_ids: list[int], sampling: SamplingParams) -> int:
        """Fill tokens [start.prefix_len, num_tokens) of ``start.page_ids``; return the first sampled token.

        Cancelling the awaiting task cancels the Prefill stream (the prefill frees its pages)."""
        call = self._stub(address).Prefill(prefill_pb2.PrefillRequest(
            request_id=start.rid, token_ids=token_ids, prefix_len=start.prefix_len,
            sampling=sampling_to_proto(sampling), expected_layout=self.layout))
        t0, received = time.perf_counter(), 0
        try:
            stream = call.__aiter__()
            header = await self._next(stream, self.timeouts.prefill_first_message_s, "transfer header", address)
            if header.WhichOneof("payload") != "header":
                raise PrefillUnavailable(f"prefill {address} sent {header.WhichOneof('payload')} before its header")
            h = header.header
            check_layout(self.layout, h.layout, "decode", "prefill")
            ps = self.layout.page_size
            first_page = start.prefix_len // ps
            num_pages = math.ceil(start.num_tokens / ps) - first_page
            if (h.num_tokens, h.first_page, h.num_pages) != (start.num_tokens, first_page, num_pages):
                raise PrefillUnavailable(
                    f"transfer header from {address} announces {h.num_tokens} tokens / pages "
                    f"[{h.first_page}, +{h.num_pages}), expected {start.num_tokens} / [{first_page}, +{num_pages})")
            missing = {(layer, p) for layer in range(self.layout.num_layers)
                       for p in range(first_page, first_page + num_pages)}
            while True:
                msg = await self._next(stream, self.timeouts.between_pages_s, "next KV page message", address)
                if msg.request_id != start.rid:
                    raise PrefillUnavailable(f"message for request {msg.request_id!r} on the stream of {start.rid!r}")
                kind = msg.WhichOneof("payload")
                if kind == "pages":
                    received += await self._store(msg.pages, start, missing)
                elif kind == "done":
                    if missing:
                        raise PrefillUnavailable(f"prefill {address} finished with {len(missing)} layer pages missing")
                    self.metrics.observe_transfer(received, time.perf_counter() - t0)
                    return msg.done.first_token_id
                else:
                    raise PrefillUnavailable(f"unexpected {kind} message from prefill {address}")
        except grpc.aio.AioRpcError as e:
            self.metrics.failed_transfers.labels(e.code().name.lower()).inc()
            if e.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise LayoutMismatch(e.details()) from None
            if e.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"prefill rejected the request: {e.details()}") from None
            raise PrefillUnavailable(f"prefill {address} failed: {e.code().name}: {e.details()}") from None
        except (LayoutMismatch, PrefillUnavailable, TransferTimeout) as e:
            self.metrics.failed_transfers.labels(type(e).__name__.lower()).inc()
            raise
        finally:
            call.cancel()  # no-op when the stream completed; otherwise tells prefill to free its pages

    async def _next(self, stream, timeout: float, what: str, address: str):
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout)
        except TimeoutError:
            raise TransferTimeout(f"prefill {address} sent no {what} within {timeout:g} s") from None
        except StopAsyncIteration:
            raise PrefillUnavailable(f"prefill {address} ended the stream before it was done") from None

    async def _store(self, run: prefill_pb2.KVPageRun, start: PullStart, missing: set) -> int:
        keys = {(run.layer, p) for p in range(run.first_page, run.first_page + run.num_pages)}
        if run.num_pages < 1 or not keys <= missing:
            raise PrefillUnavailable(f"unexpected or repeated pages: layer {run.layer} pages "
                                     f"[{run.first_page}, +{run.num_pages})")
        pages = list(start.page_ids[run.first_page:run.first_page + run.num_pages])
        payload = PagePayload(run.k, run.k_scales, run.v, run.v_scales)
        try:
            await self.run_on_engine(lambda: self.pool.import_pages(run.layer, pages, payload))
        except ValueError as e:
            raise PrefillUnavailable(f"bad KV payload: {e}") from None
        missing -= keys
        return len(run.k) + len(run.k_scales) + len(run.v) + len(run.v_scales)
