"""WorkerLoad snapshots from the scheduler's stats record (``EngineLoop.stats()``: taken on the engine loop thread
between two steps, so its numbers are those of one moment; this module reads nothing else of the engine's state).

A snapshot waits for the loop to finish its current step or command. When that takes longer than
``fresh_wait_s`` (a first-use JIT compile of a FlashInfer kernel takes ~25 s) the report answers the last
snapshot instead (before the first snapshot it waits, within the RPC's deadline), so the router does not mark
a busy worker unhealthy and turn clients away; a loop that has not started a new iteration for
``max_stall_s`` is reported as failing (a hung engine must not look healthy).
Invariant: at most one snapshot command is queued on the loop at a time; the record is turned into the WorkerLoad
(and the gauges) on the loop thread, as it is taken, so ``_last`` is always the newest record.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import grpc

from engine.engine_loop import EngineLoop
from engine.host_pool import HostTierStats
from engine.scheduler_stats import SchedulerStats
from nvfp4_serve_proto import common_pb2
from svc_common.metrics import ServiceMetrics


class EngineStalled(RuntimeError):
    """The engine loop has been inside one step or command for longer than the service allows."""


class LoadReporter:
    def __init__(self, loop: EngineLoop, role: str, layout: common_pb2.KVLayout, metrics: ServiceMetrics,
                 fresh_wait_s: float = 0.5, max_stall_s: float = 120.0) -> None:
        self.loop, self.role, self.layout, self.metrics = loop, role, layout, metrics
        self.fresh_wait_s, self.max_stall_s = fresh_wait_s, max_stall_s
        self._last: common_pb2.WorkerLoad | None = None
        self._pending: Future | None = None
        # fixed for the process: read once here
        eng = loop.engine
        self._model_path, self._attention_backend = eng.config.model_dir, eng.backend.name
        layer0 = eng.pool.layers[0]
        self._decode_kernel = eng.backend.decode_kernel(eng.pool.kv_dtype, layer0.head_dim,
                                                        eng.paths.num_qo_heads // layer0.num_kv_heads, eng.device,
                                                        num_kv_heads=layer0.num_kv_heads,
                                                        page_size=layer0.page_size)

    def _snapshot(self) -> Future:
        """A future WorkerLoad: the stats record is taken between steps and published (``_publish``) by the loop
        thread as soon as it is taken."""
        out: Future = Future()

        def publish(taken: Future) -> None:  # on the loop thread, right after Scheduler.stats()
            try:
                out.set_result(self._publish(taken.result()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out.set_exception(e)

        self.loop.stats().add_done_callback(publish)
        return out

    def _publish(self, st: SchedulerStats) -> common_pb2.WorkerLoad:
        self.metrics.update_pool(st)
        self.metrics.update_host_tier(st.host_tier)
        self._last = common_pb2.WorkerLoad(
            role=self.role, num_running=st.num_active, num_waiting=st.num_waiting,
            outstanding_tokens=st.outstanding_tokens, pool_pages_total=st.pages_total, pool_pages_free=st.pages_free,
            pool_pages_cached=st.pages_cached, pool_pages_in_use=st.pages_in_use, page_size=st.page_size,
            max_total_tokens=st.max_total_tokens, layout=self.layout, model_path=self._model_path,
            host_cache=_host_cache(st.host_tier), attention_backend=self._attention_backend,
            decode_kernel=self._decode_kernel)
        return self._last

    async def load(self) -> common_pb2.WorkerLoad:
        """A fresh snapshot, or the last one while the loop is busy (raises EngineStalled past max_stall_s)."""
        if self._pending is None or self._pending.done():
            self._pending = self._snapshot()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._pending)), self.fresh_wait_s)
        except TimeoutError:
            busy = self.loop.busy_for_s()
            if busy > self.max_stall_s:
                raise EngineStalled(f"the engine loop has been busy in one step for {busy:.0f} s "
                                    f"(limit {self.max_stall_s:g} s)") from None
            if self._last is None:  # nothing to answer with yet (start-up): wait, within the caller's deadline
                return await asyncio.wrap_future(self._pending)
            return self._last

    async def load_or_abort(self, context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        """``load`` for a GetLoad/GetMetrics handler: a stalled engine ends the RPC as UNAVAILABLE."""
        try:
            return await self.load()
        except EngineStalled as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def _host_cache(st: HostTierStats | None) -> common_pb2.HostCacheStats | None:
    if st is None:
        return None
    return common_pb2.HostCacheStats(
        num_pages=st.num_pages, num_used_pages=st.num_used_pages, max_tokens=st.max_tokens,
        total_bytes=st.total_bytes, hit_tokens=st.hit_tokens, num_loads=st.num_loads, num_stores=st.num_stores,
        load_bytes=st.load_bytes, store_bytes=st.store_bytes, load_gbps=st.load_gbps, store_gbps=st.store_gbps,
        copy_path=st.copy_path.value)
