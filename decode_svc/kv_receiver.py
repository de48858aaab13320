"""The KV receive path: pull a prompt's missing pages from a prefill service into pages already
allocated here, checking the handshake and every message, under a deadline per state.

The header names the path (``nvfp4_serve/kv_transfer.py``); every pool write runs on the engine thread:

    grpc      KVPageRun bytes -> KVPool.import_pages
    cuda-ipc  KVPageRefs -> copy_pages from the prefill's pool (opened once, decode_svc/kv_ipc.py);
              after the last layer: fence (copies complete) -> ReleaseTransfer -> the stream ends
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial

import grpc

from decode_svc.config import Timeouts
from decode_svc.kv_ipc import PeerShare, PrefillShares
from engine.kv_pool import KVPool, PagePayload
from engine.request import PullStart
from engine.sampling import SamplingParams
from nvfp4_serve.convert import sampling_to_proto
from nvfp4_serve.errors import InvalidRequest, LayoutMismatch, PrefillUnavailable, TransferTimeout
from nvfp4_serve.grpc_server import server_options
from nvfp4_serve.kv_transfer import PATH_GRPC, PATH_IPC, PathChoice, TransferMetrics, select_path
from nvfp4_serve.kv_transfer_ipc import Fence, PoolView, copy_pages
from nvfp4_serve.layout import check_layout
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve.tls import TLSConfig, open_channel
from nvfp4_serve_proto import common_pb2, prefill_pb2, prefill_pb2_grpc

# A restarted prefill is reached again within a second (gRPC's default backoff grows to 120 s).
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                      ("grpc.max_reconnect_backoff_ms", 1000)]
_HOLD_MARGIN = 0.9  # cuda-ipc copies must complete within this share of the prefill's hold (header in flight)
_BYTES_IN_FLIGHT = 2  # grpc: page-run imports awaited this many messages behind (bounds memory to ~3 messages)
_RELEASE_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(self, pool: KVPool, layout: common_pb2.KVLayout, metrics: ServiceMetrics, timeouts: Timeouts,
                 max_message_bytes: int, run_on_engine: Callable[[Callable[[], object]], Awaitable[object]],
                 tls: TLSConfig | None = None, kv_transfer: str = "auto"):
        """``run_on_engine`` runs a pool write on the engine loop thread and returns its result: writes are
        ordered before any later abort of the request, so a page is never written after it was freed."""
        self.pool = pool
        self.run_on_engine = run_on_engine
        self.layout = layout
        self.metrics = metrics
        self.timeouts = timeouts
        self.max_message_bytes = max_message_bytes
        self.tls = tls or TLSConfig()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.transfer_metrics = TransferMetrics(metrics)
        self.shares = PrefillShares(pool, layout, kv_transfer)

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
        stub = self._stub(address)
        offer, peer = await self.shares.offer(address, stub)
        call = stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=start.rid, token_ids=token_ids, prefix_len=start.prefix_len,
            sampling=sampling_to_proto(sampling), expected_layout=self.layout, transfer=offer))
        t0 = time.perf_counter()
        writes = _Writes(self.run_on_engine)
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
            t_header = time.perf_counter()
            self.transfer_metrics.wait_seconds.inc(t_header - t0)
            path = self._path_of(address, h, offer, peer)
            missing = {(layer, p) for layer in range(self.layout.num_layers)
                       for p in range(first_page, first_page + num_pages)}
            writes.limit = _BYTES_IN_FLIGHT if path == PATH_GRPC else self.layout.num_layers
            received, done = await self._receive(stream, start, path, peer.view, missing, writes, address)
            await writes.drain()
            if path == PATH_IPC:
                fence = await self.run_on_engine(lambda: Fence(self.pool.device))
                await asyncio.to_thread(fence.wait)  # every copy is complete: the pages may be released
            seconds = time.perf_counter() - t_header
            if path == PATH_IPC:
                await self._release(stub, stream, h, seconds, address)
            self.metrics.observe_transfer(received, seconds)
            log.info("request %s: %d pages x %d layers from prefill %s via %s, %.1f MB in %.1f ms (%.2f GB/s)",
                     start.rid, num_pages, self.layout.num_layers, address, path, received / 1e6, seconds * 1e3,
                     received / max(seconds, 1e-9) / 1e9)
            return done.first_token_id
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
            writes.cancel()
            call.cancel()  # no-op when the stream completed; otherwise tells prefill to free its pages

    async def _receive(self, stream, start: PullStart, path: str, view: PoolView | None, missing: set,
                       writes: _Writes, address: str) -> tuple[int, prefill_pb2.PrefillDone]:
        """Read page messages up to PrefillDone, posting each one's pool write (bound now, run later on the
        engine thread); returns (bytes, done)."""
        received = 0
        while True:
            msg = await self._next(stream, self.timeouts.between_pages_s, "next KV page message", address)
            if msg.request_id != start.rid:
                raise PrefillUnavailable(f"message for request {msg.request_id!r} on the stream of {start.rid!r}")
            kind = msg.WhichOneof("payload")
            if kind == "pages" and path == PATH_GRPC:
                run = msg.pages
                missing -= self._claim(run.layer, run.first_page, run.num_pages, missing)
                pages = list(start.page_ids[run.first_page:run.first_page + run.num_pages])
                payload = PagePayload(run.k, run.k_scales, run.v, run.v_scales)
                await writes.post(partial(self.pool.import_pages, run.layer, pages, payload), "payload")
                received += payload.num_bytes
            elif kind == "page_refs" and path == PATH_IPC:
                refs = msg.page_refs
                n = len(refs.src_page_ids)
                missing -= self._claim(refs.layer, refs.first_page, n, missing)
                dst = list(start.page_ids[refs.first_page:refs.first_page + n])
                src = list(refs.src_page_ids)
                await writes.post(partial(copy_pages, self.pool, view, refs.layer, src, dst), "page refs")
                received += n * self.pool.page_bytes_per_layer
            elif kind == "done":
                if missing:
                    raise PrefillUnavailable(f"prefill {address} finished with {len(missing)} layer pages missing")
                return received, msg.done
            else:
                raise PrefillUnavailable(f"unexpected {kind} message on the {path} transfer from prefill {address}")

    def _path_of(self, address: str, h: prefill_pb2.TransferHeader, offer: prefill_pb2.TransferOffer,
                 peer: PeerShare) -> str:
        """The header's path, checked against the offer; counted (and a fallback explained) in the metrics."""
        path = h.path or PATH_GRPC
        if path == PATH_IPC:
            if peer.view is None or h.share_id != offer.ipc_share_id or not h.transfer_id or h.hold_timeout_s <= 0:
                raise PrefillUnavailable(f"prefill {address} chose cuda-ipc without a share this decode opened "
                                         f"or without a transfer id and hold")
            choice = peer.choice
        elif path != PATH_GRPC:
            raise PrefillUnavailable(f"prefill {address} announces an unknown transfer path {path[:40]!r}")
        elif offer.ipc_share_id and h.share_id != offer.ipc_share_id:
            self.shares.forget(address, offer.ipc_share_id)
            choice = PathChoice(PATH_GRPC, "share_changed", f"prefill {address} restarted since its pool was opened")
        elif offer.ipc_share_id:
            choice = select_path(self.shares.endpoint, h.endpoint, "decode", "prefill")
            if choice.path == PATH_IPC:
                choice = PathChoice(PATH_GRPC, "share_failed", f"prefill {address} declined the cuda-ipc offer")
        else:
            choice = peer.choice
        self.transfer_metrics.count(f"prefill {address}", choice, self.shares.wants_ipc)
        return path

    async def _next(self, stream, timeout: float, what: str, address: str):
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout)
        except TimeoutError:
            raise TransferTimeout(f"prefill {address} sent no {what} within {timeout:g} s") from None
        except StopAsyncIteration:
            raise PrefillUnavailable(f"prefill {address} ended the stream before it was done") from None

    @staticmethod
    def _claim(layer: int, first_page: int, num_pages: int, missing: set) -> set:
        keys = {(layer, p) for p in range(first_page, first_page + num_pages)}
        if num_pages < 1 or not keys <= missing:
            raise PrefillUnavailable(f"unexpected or repeated pages: layer {layer} pages [{first_page}, +{num_pages})")
        return keys

    async def _release(self, stub: prefill_pb2_grpc.PrefillStub, stream, h: prefill_pb2.TransferHeader,
                       elapsed: float, address: str) -> None:
        """Release the prefill's source pages (every copy is complete) and let its stream end.

        The copies must have completed before the prefill's hold ended (it frees the pages then, and may
        reuse them): too late, and the pages just copied cannot be trusted."""
        if elapsed > _HOLD_MARGIN * h.hold_timeout_s:
            raise PrefillUnavailable(f"cuda-ipc copies from prefill {address} completed {elapsed:.1f} s after the "
                                     f"header, past {_HOLD_MARGIN:.0%} of its {h.hold_timeout_s:g} s hold")
        try:
            released = (await stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(transfer_id=h.transfer_id),
                                                   timeout=_RELEASE_TIMEOUT_S)).released
        except grpc.aio.AioRpcError as e:  # the copies are complete: cancelling the stream frees the pages too
            log.debug("ReleaseTransfer to %s failed (%s); the stream's end frees the pages", address, e.code().name)
            return
        if not released:
            raise PrefillUnavailable(f"prefill {address} had freed the source pages before they were released")
        try:  # the prefill ends the stream once released; its status is of no consequence here
            await asyncio.wait_for(stream.__anext__(), _RELEASE_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError, grpc.aio.AioRpcError):
            pass


class _Writes:
    """Pool writes posted to the engine thread in message order, awaited at most ``limit`` behind: the next
    message is read while earlier ones are written. The engine thread runs them in order, and before any
    later abort of the request (the worker aborts only after the pull has ended)."""

    def __init__(self, run_on_engine: Callable[[Callable[[], object]], Awaitable[object]], limit: int = 1):
        self.run_on_engine = run_on_engine
        self.limit = limit
        self._tasks: deque[asyncio.Task] = deque()

    async def post(self, fn: Callable[[], object], what: str) -> None:
        self._tasks.append(asyncio.ensure_future(self._apply(fn, what)))
        while len(self._tasks) > self.limit:
            await self._tasks.popleft()

    async def drain(self) -> None:
        while self._tasks:
            await self._tasks.popleft()

    def cancel(self) -> None:
        """Drop what is left (a write the engine has not started is skipped: its pages are being freed)."""
        for t in self._tasks:
            if not t.done():
                t.cancel()
            elif not t.cancelled():
                t.exception()  # retrieved: the pull already failed for another reason
        self._tasks.clear()

    async def _apply(self, fn: Callable[[], object], what: str) -> object:
        try:
            return await self.run_on_engine(fn)
        except ValueError as e:
            raise PrefillUnavailable(f"bad KV {what}: {e}") from None
