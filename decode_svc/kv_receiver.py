"""The KV receive path: pull a prompt's missing pages from a prefill service into pages already
allocated here, checking the handshake and every message, under a deadline per state.

Pages stream while the prefill computes the prompt (after each chunk, the pages it completed). The header
names the path (``svc_common/kv_transfer.py``); writes run on worker threads and a side CUDA stream
(``svc_common/page_import.py``), never on the engine thread, so a transfer neither waits for decode steps
nor delays them; the stream is read ahead of the handling (``decode_svc/read_ahead.py``), so the next
message is received while this one is checked:

    grpc      KVPageRun bytes (zero-copy views, ``svc_common/kv_wire.py``) -> PageImporter.write
    cuda-ipc  KVPageRefs -> PageImporter.copy_from the prefill's pool (opened once, decode_svc/kv_ipc.py), a run of
              pages of every layer in one writer task (decode_svc/page_refs.py); after PrefillDone: writes
              complete -> ReleaseTransfer -> the stream ends
    nixl      KVPageRefs -> NIXL READs per run of pages, every layer's refs of it together, posted at once
              (decode_svc/kv_nixl_reads.py), then the rows checked; after PrefillDone: as cuda-ipc

Every value the peer sends is checked before it touches the pool or the engine: request id, layer, page
ranges against the header (in sequence order per layer, nothing twice, no more than announced), part
sizes against the layout, source page ids against the opened pool, the first token inside the vocabulary;
scales (and fp8/bf16 values) are checked finite on the device as they are written, before any page reaches
the engine. A bad message fails this request's transfer only.

Invariant: ``pull`` returns (or raises) only once every write it issued is complete, so the caller may
then free the pages (abort) or hand them to the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from decode_svc.config import Timeouts
from decode_svc.kv_ipc import PeerShare, PrefillShares
from decode_svc.kv_nixl_reads import NixlReads
from decode_svc.page_refs import MAX_BATCH, PageRead, batches_of, copy_batch, layers_of
from decode_svc.peer_channels import PeerChannels, PeerStubs
from decode_svc.pull_writes import PullLanes, PullWrites, uncancellable
from decode_svc.read_ahead import ReadAhead
from decode_svc.transfer_phases import TransferClock, TransferPhases
from engine.kv_pool import KVPool
from engine.request import PullStart
from engine.sampling import SamplingParams
from nvfp4_serve_proto import common_pb2, prefill_pb2
from svc_common.convert import sampling_to_proto
from svc_common.errors import InvalidRequest, LayoutMismatch, PrefillUnavailable, TransferTimeout
from svc_common.kv_transfer import (
    PATH_GRPC,
    PATH_NIXL,
    PathChoice,
    TransferMetrics,
    by_reference,
    select_path,
)
from svc_common.kv_transfer_ipc import PoolView
from svc_common.kv_transfer_nixl import NixlView
from svc_common.kv_wire import PageRunView, WireError, decode_page_run
from svc_common.layout import check_layout
from svc_common.metrics import ServiceMetrics
from svc_common.page_import import PageImporter, PageTableCache
from svc_common.tls import TLSConfig

_HOLD_MARGIN = 0.9  # by-reference copies must complete within this share of the hold (messages in flight)
_WRITES_IN_FLIGHT = 2  # writes running behind the message being handled
_READ_AHEAD = 4  # messages received ahead of the one being handled (with the writes: ~7 messages of memory)
_RELEASE_TIMEOUT_S = 5.0
# How long a completed transfer's stream may take to end on the prefill's side (PrefillDone is its last message;
# the end follows at once from a working prefill): past it, the stream is cancelled and the pull goes on
_STREAM_END_S = 2.0

log = logging.getLogger(__name__)


@dataclass
class _Progress:
    """Which sequence pages of each layer arrived: pages of one layer come in order, each once."""

    first_page: int
    end_page: int
    next_page: list[int]  # per layer
    clock: TransferClock  # started at the header; every claimed run stamps it

    def claim(self, layer: int, first_page: int, num_pages: int, address: str) -> None:
        """Raise PrefillUnavailable unless the run is the next one of ``layer``, inside the announced pages
        (checked arithmetically before anything else is looked at or allocated)."""
        if not 0 <= layer < len(self.next_page):
            raise PrefillUnavailable(f"prefill {address} sent layer {layer}; the layout has {len(self.next_page)}")
        want = self.next_page[layer]
        if first_page != want or not 1 <= num_pages <= self.end_page - want:
            raise PrefillUnavailable(
                f"prefill {address} sent layer {layer} pages [{first_page}, +{num_pages}); expected the next run "
                f"to start at page {want} and end by page {self.end_page}")
        self.next_page[layer] = want + num_pages
        self.clock.page()

    def num_missing(self) -> int:
        return sum(self.end_page - p for p in self.next_page)


async def _stream_end(ahead: ReadAhead) -> None:
    """Let a completed transfer's stream end on its own (PrefillDone is its last message; a by-reference
    prefill ends it once released) before the caller's cancel: a cancel racing the prefill's last write would
    end its stream as a failure, and the transfer would go uncounted there. Its status is of no consequence
    here (every page is in and checked), and a prefill that holds the stream open past the bound is cancelled."""
    try:
        await asyncio.wait_for(ahead.next(), _STREAM_END_S)
    except (StopAsyncIteration, TimeoutError, grpc.aio.AioRpcError):
        pass


class KVReceiver:
    def __init__(self, pool: KVPool, layout: common_pb2.KVLayout, metrics: ServiceMetrics, timeouts: Timeouts,
                 max_message_bytes: int, vocab_size: int, tls: TLSConfig | None = None,
                 kv_transfer: str = "auto", grpc_lanes: int = 1):
        self.pool = pool
        self.layout = layout
        self.metrics = metrics
        self.timeouts = timeouts
        self.vocab_size = vocab_size
        self.channels = PeerChannels(tls or TLSConfig(), max_message_bytes)
        self.transfer_metrics = TransferMetrics(metrics)
        self.shares = PrefillShares(pool, layout, kv_transfer)
        self.grpc_lanes = grpc_lanes
        self._executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-write")
        self._tables = PageTableCache()  # the batched copies' tables, kept across pulls

    async def close(self) -> None:
        await self.channels.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def pull(self, address: str, start: PullStart, token_ids: list[int], sampling: SamplingParams) -> int:
        """Fill tokens [start.prefix_len, num_tokens) of ``start.page_ids``; return the first sampled token.

        Cancelling the awaiting task cancels the Prefill stream (the prefill frees its pages)."""
        async with self.channels.lease(address) as peer_stubs:
            return await self._pull(peer_stubs, address, start, token_ids, sampling)

    async def _pull(self, peer_stubs: PeerStubs, address: str, start: PullStart, token_ids: list[int],
                    sampling: SamplingParams) -> int:
        offer, peer = await self.shares.offer(address, peer_stubs.stub)
        offer.grpc_lanes = self.grpc_lanes
        offer.refs_all_layers = True  # KVPageRefs.num_layers is read (decode_svc/page_refs.py: layers_of)
        call = peer_stubs.prefill(prefill_pb2.PrefillRequest(
            request_id=start.rid, token_ids=token_ids, prefix_len=start.prefix_len,
            sampling=sampling_to_proto(sampling), expected_layout=self.layout, transfer=offer))
        t0 = time.perf_counter()
        importer = PageImporter(self.pool, self._tables)
        writes = PullWrites(self._executor, _WRITES_IN_FLIGHT)
        reads: NixlReads | None = None
        ahead: ReadAhead | None = None
        lanes = PullLanes(_READ_AHEAD)
        try:
            stream = call.__aiter__()
            h, progress = await self._header(stream, start, address)
            self.transfer_metrics.wait_seconds.inc(progress.clock.header - t0)
            path = self._path_of(address, h, offer, peer)
            if path == PATH_NIXL:
                reads = NixlReads(self.shares.nixl, peer.view, importer, self.timeouts.between_pages_s)
            ahead = ReadAhead(stream, _READ_AHEAD)
            num_lanes = self._lanes_of(h, path, address)
            receive = self._receive(ahead, start, path, peer.view, reads, progress, importer, writes, address,
                                    num_lanes)
            if num_lanes > 1:
                receive = self._with_lanes(receive, lanes, peer_stubs, h.transfer_id, num_lanes, start, progress,
                                           importer, address)
            received, done, t_last = await receive
            progress.clock.got_done()
            await self._complete(progress, writes, lanes, importer, address)
            if not 0 <= done.first_token_id < self.vocab_size:
                raise PrefillUnavailable(f"prefill {address} sent first token {done.first_token_id}, outside the "
                                         f"vocabulary [0, {self.vocab_size})")
            phases = progress.clock.phases()
            if not by_reference(path) or await self._release(peer_stubs.stub, h, time.perf_counter() - t_last,
                                                             address):
                await _stream_end(ahead)
            self._report(start, address, path, progress, received, phases, writes.busy_s + lanes.busy_s(),
                         (f" over {len(lanes.lanes) + 1} lanes" if lanes.lanes else "") + importer.times.summary()
                         if reads is None else reads.summary())
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
            call.cancel()  # no-op when the stream completed; otherwise tells prefill to free its pages
            if ahead is not None:
                ahead.close()
            lanes.cancel()
            if reads is not None:
                reads.stop()  # reads still in flight cancel and release their handles; settle waits for them
            await writes.settle()
            if reads is not None:
                self.transfer_metrics.nixl_reads.inc(reads.num_reads)
                self.transfer_metrics.nixl_descriptors.inc(reads.num_descriptors)
            await lanes.settle()
            await uncancellable(asyncio.to_thread(importer.settle))

    async def _header(self, stream, start: PullStart, address: str) -> tuple[prefill_pb2.TransferHeader, _Progress]:
        """The stream's first message: the transfer header of this pull, checked."""
        first = await self._next(stream.__anext__, self.timeouts.prefill_first_message_s, "transfer header", address)
        header = self._parse(first, address)
        if header.request_id != start.rid or header.WhichOneof("payload") != "header":
            raise PrefillUnavailable(f"prefill {address} sent {header.WhichOneof('payload')} for request "
                                     f"{header.request_id[:80]!r} before the header of {start.rid!r}")
        return header.header, self._check_header(header.header, start, address)

    @staticmethod
    async def _complete(progress: _Progress, writes: PullWrites, lanes: PullLanes, importer: PageImporter,
                        address: str) -> None:
        """After PrefillDone: every page arrived, every write is complete and the values are checked."""
        if missing := progress.num_missing():
            raise PrefillUnavailable(f"prefill {address} finished with {missing} layer pages missing")
        await writes.drain("pages", address)
        await lanes.drain(address)
        progress.clock.writes_drained()
        try:
            await asyncio.to_thread(importer.finish)  # every write complete; scales checked
        except ValueError as e:
            raise PrefillUnavailable(f"bad KV pages from prefill {address}: {e}") from None

    def _report(self, start: PullStart, address: str, path: str, progress: _Progress, received: int,
                phases: TransferPhases, busy_s: float, how: str) -> None:
        """A completed transfer's metrics and log line (``busy_s``: the time its pool writes ran)."""
        self.metrics.observe_transfer(received, phases.total, start.num_tokens - start.prefix_len)
        self.transfer_metrics.copy_seconds.inc(busy_s)
        for name, seconds in phases.items():
            self.transfer_metrics.phase_seconds.labels(name).inc(seconds)
        log.info("request %s: %d pages x %d layers from prefill %s via %s%s, %.1f MB in %.1f ms after the header "
                 "(%.1f ms of it copying: %.2f GB/s; %s)", start.rid, progress.end_page - progress.first_page,
                 self.layout.num_layers, address, path, how, received / 1e6, phases.total * 1e3, busy_s * 1e3,
                 received / max(busy_s, 1e-9) / 1e9, phases.summary())

    def _check_header(self, h: prefill_pb2.TransferHeader, start: PullStart, address: str) -> _Progress:
        check_layout(self.layout, h.layout, "decode", "prefill")
        ps = self.layout.page_size
        first_page = start.prefix_len // ps
        num_pages = math.ceil(start.num_tokens / ps) - first_page
        if (h.num_tokens, h.first_page, h.num_pages) != (start.num_tokens, first_page, num_pages):
            raise PrefillUnavailable(
                f"transfer header from {address} announces {h.num_tokens} tokens / pages "
                f"[{h.first_page}, +{h.num_pages}), expected {start.num_tokens} / [{first_page}, +{num_pages})")
        return _Progress(first_page, first_page + num_pages, [first_page] * self.layout.num_layers,
                         TransferClock(time.perf_counter()))

    async def _receive(self, ahead: ReadAhead, start: PullStart, path: str, view: PoolView | NixlView | None,
                       reads: NixlReads | None, progress: _Progress, importer: PageImporter, writes: PullWrites,
                       address: str, num_lanes: int = 1) -> tuple[int, prefill_pb2.PrefillDone, float]:
        """Read page messages up to PrefillDone, posting each one's pool write; returns (bytes, done, when the
        last page message arrived). With lanes, this stream is lane 0."""
        received, t_last = 0, time.perf_counter()
        # cuda-ipc, nixl: page refs not yet copied. A prefill names a run of pages for every layer in one message (or
        # in one per layer, back to back), so one writer task copies them all once the last layer's refs are in (or
        # MAX_BATCH are): decode_svc/page_refs.py
        batch: list[PageRead] = []

        async def post_batch() -> None:
            todo = batches_of(batch)
            batch.clear()
            for part in todo:
                await writes.post(lambda p=part: reads.read(p) if path == PATH_NIXL else copy_batch(importer, view, p),
                                  "page refs", address)

        last_layer = self.layout.num_layers - 1
        while True:
            raw = await self._next(ahead.next, self.timeouts.between_pages_s, "next KV page message", address)
            run = self._page_run(raw, address)
            if run is not None:
                if path != PATH_GRPC:
                    raise PrefillUnavailable(f"unexpected KV page bytes on the {path} transfer of {start.rid!r} from "
                                             f"prefill {address}")
                received += await self._post_run(run, start, progress, importer, writes, address, 0, num_lanes)
                t_last = time.perf_counter()
                continue
            msg = self._parse(raw, address)
            if msg.request_id != start.rid:
                raise PrefillUnavailable(f"message for request {msg.request_id[:80]!r} on the stream of {start.rid!r}")
            kind = msg.WhichOneof("payload")
            if kind == "page_refs" and by_reference(path):
                refs = msg.page_refs
                try:
                    layers = layers_of(refs.layer, refs.num_layers, self.layout.num_layers)
                except ValueError as e:
                    raise PrefillUnavailable(f"prefill {address} sent {e}") from None
                src = list(refs.src_page_ids)
                for layer in layers:
                    progress.claim(layer, refs.first_page, len(src), address)
                if min(src) < 0 or max(src) >= view.num_pages:
                    raise PrefillUnavailable(f"prefill {address} names source pages outside its pool "
                                             f"(0..{view.num_pages - 1})")
                dst = start.page_ids[refs.first_page:refs.first_page + len(src)]
                valid = self._tokens_in(start, refs.first_page, len(src))
                batch.extend(PageRead(layer, src, dst, valid) for layer in layers)
                if layers[-1] == last_layer or len(batch) >= MAX_BATCH:
                    await post_batch()
                received += len(src) * self.pool.page_bytes_per_layer * len(layers)
                t_last = time.perf_counter()
            elif kind == "done":
                await post_batch()
                return received, msg.done, t_last
            else:
                raise PrefillUnavailable(f"unexpected {kind} message on the {path} transfer from prefill {address}")

    def _with_lanes(self, receive: Awaitable, lanes: PullLanes, peer_stubs: PeerStubs, transfer_id: str,
                    num_lanes: int, start: PullStart, progress: _Progress, importer: PageImporter, address: str
                    ) -> Awaitable[tuple[int, prefill_pb2.PrefillDone, float]]:
        """``receive`` (lane 0) run with lanes 1 .. num_lanes - 1, each opened now on its own connection."""
        for k, call in enumerate(self.channels.lane_calls(address, peer_stubs, num_lanes), start=1):
            lanes.open(call(prefill_pb2.PrefillLaneRequest(transfer_id=transfer_id, lane=k)),
                       PullWrites(self._executor, _WRITES_IN_FLIGHT))
        return lanes.run(receive, [self._receive_lane(lane.ahead, start, progress, importer, lane.writes, address,
                                                      k, num_lanes) for k, lane in enumerate(lanes.lanes, start=1)])

    async def _receive_lane(self, ahead: ReadAhead, start: PullStart, progress: _Progress, importer: PageImporter,
                            writes: PullWrites, address: str, lane: int, num_lanes: int) -> tuple[int, float]:
        """Lane ``lane``'s page runs (only layers l % num_lanes == lane) up to its stream's end; returns
        (bytes, when its last page message arrived)."""
        received, t_last = 0, time.perf_counter()
        while True:
            raw = await self._next(ahead.next, self.timeouts.between_pages_s, f"message on lane {lane}", address,
                                   end_ok=True)
            if raw is None:
                return received, t_last
            run = self._page_run(raw, address)
            if run is None:
                raise PrefillUnavailable(f"prefill {address} sent a message other than page bytes on lane {lane}")
            received += await self._post_run(run, start, progress, importer, writes, address, lane, num_lanes)
            t_last = time.perf_counter()

    @staticmethod
    def _page_run(raw: bytes, address: str) -> PageRunView | None:
        try:
            return decode_page_run(raw)
        except WireError as e:
            raise PrefillUnavailable(f"prefill {address} sent an undecodable message: {e}") from None

    async def _post_run(self, run: PageRunView, start: PullStart, progress: _Progress, importer: PageImporter,
                        writes: PullWrites, address: str, lane: int, num_lanes: int) -> int:
        """Check one page run of lane ``lane`` and post its pool write; returns its bytes."""
        if run.request_id != start.rid:
            raise PrefillUnavailable(f"KV page bytes for {run.request_id[:80]!r} on the transfer of {start.rid!r} "
                                     f"from prefill {address}")
        if run.layer % num_lanes != lane:
            raise PrefillUnavailable(f"prefill {address} sent layer {run.layer} on lane {lane} of {num_lanes}")
        progress.claim(run.layer, run.first_page, run.num_pages, address)
        try:
            importer.check_sizes(run)
        except ValueError as e:
            raise PrefillUnavailable(f"bad KV page run from prefill {address}: {e}") from None
        pages = start.page_ids[run.first_page:run.first_page + run.num_pages]
        valid = self._tokens_in(start, run.first_page, run.num_pages)
        await writes.post(lambda: importer.write(run, pages, valid), "page run", address)
        return run.num_bytes

    def _lanes_of(self, h: prefill_pb2.TransferHeader, path: str, address: str) -> int:
        """The header's lane count, checked against this decode's offer."""
        lanes = max(1, h.lanes)
        if lanes > 1 and (path != PATH_GRPC or lanes > self.grpc_lanes or not h.transfer_id):
            raise PrefillUnavailable(f"prefill {address} announces {h.lanes} lanes on the {path} path (offered "
                                     f"{self.grpc_lanes}{'' if h.transfer_id else ', without a transfer id'})")
        return lanes

    def _tokens_in(self, start: PullStart, first_page: int, num_pages: int) -> int:
        """Prompt tokens in sequence pages [first_page, +num_pages) (a last, partial page holds fewer)."""
        ps = self.layout.page_size
        return min(start.num_tokens, (first_page + num_pages) * ps) - first_page * ps

    @staticmethod
    def _parse(raw: bytes, address: str) -> prefill_pb2.PrefillMessage:
        try:
            return prefill_pb2.PrefillMessage.FromString(raw)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            raise PrefillUnavailable(f"prefill {address} sent an undecodable message: {type(e).__name__}") from None

    def _path_of(self, address: str, h: prefill_pb2.TransferHeader, offer: prefill_pb2.TransferOffer,
                 peer: PeerShare) -> str:
        """The header's path, checked against the offer; counted (and a fallback explained) in the metrics."""
        path = h.path or PATH_GRPC
        if by_reference(path):
            if (peer.view is None or peer.choice.path != path or h.share_id != offer.ipc_share_id
                    or not h.transfer_id or h.hold_timeout_s <= 0):
                raise PrefillUnavailable(f"prefill {address} chose {path} without a share this decode opened "
                                         f"for it or without a transfer id and hold")
            choice = peer.choice
        elif path != PATH_GRPC:
            raise PrefillUnavailable(f"prefill {address} announces an unknown transfer path {path[:40]!r}")
        elif offer.ipc_share_id and h.share_id != offer.ipc_share_id:
            self.shares.forget(address, offer.ipc_share_id)
            choice = PathChoice(PATH_GRPC, "share_changed", f"prefill {address} restarted since its pool was opened")
        elif offer.ipc_share_id:
            choice = select_path(self.shares.endpoint, h.endpoint, "decode", "prefill")
            if by_reference(choice.path):
                choice = PathChoice(PATH_GRPC, "share_failed", f"prefill {address} declined the {choice.path} offer")
        else:
            choice = peer.choice
        self.transfer_metrics.count(f"prefill {address}", choice, self.shares.wanted)
        return path

    async def _next(self, read: Callable[[], Awaitable[bytes]], timeout: float, what: str, address: str,
                    end_ok: bool = False) -> bytes | None:
        """The next message within ``timeout``; the stream's end is None where ``end_ok`` (a lane's end), else
        PrefillUnavailable."""
        try:
            return await asyncio.wait_for(read(), timeout)
        except TimeoutError:
            raise TransferTimeout(f"prefill {address} sent no {what} within {timeout:g} s") from None
        except StopAsyncIteration:
            if end_ok:
                return None
            raise PrefillUnavailable(f"prefill {address} ended the stream before it was done") from None

    async def _release(self, stub, h: prefill_pb2.TransferHeader, since_last: float, address: str) -> bool:
        """Release the prefill's source pages (every copy is complete); its stream ends then. False: the
        release did not reach the prefill, and only cancelling the stream frees its pages.

        The copies must have completed before the prefill's hold ended (it frees the pages then, and may
        reuse them): too late, and the pages just copied cannot be trusted."""
        if since_last > _HOLD_MARGIN * h.hold_timeout_s:
            raise PrefillUnavailable(f"{h.path} copies from prefill {address} completed {since_last:.1f} s after "
                                     f"its last page message, past {_HOLD_MARGIN:.0%} of its {h.hold_timeout_s:g} s hold")
        try:
            released = (await stub.ReleaseTransfer(prefill_pb2.ReleaseTransferRequest(transfer_id=h.transfer_id),
                                                   timeout=_RELEASE_TIMEOUT_S)).released
        except grpc.aio.AioRpcError as e:  # the copies are complete: cancelling the stream frees the pages too
            log.debug("ReleaseTransfer to %s failed (%s); the stream's end frees the pages", address, e.code().name)
            return False
        if not released:
            raise PrefillUnavailable(f"prefill {address} had freed the source pages before they were released")
        return True
