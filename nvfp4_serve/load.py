"""WorkerLoad snapshots, taken on the engine loop thread so they see a consistent scheduler."""

from __future__ import annotations

import asyncio

from engine.engine_loop import EngineLoop
from nvfp4_serve.metrics import ServiceMetrics
from nvfp4_serve_proto import common_pb2


async def worker_load(loop: EngineLoop, role: str, layout: common_pb2.KVLayout,
                      metrics: ServiceMetrics) -> common_pb2.WorkerLoad:
    def snapshot() -> common_pb2.WorkerLoad:
        s = loop.scheduler
        metrics.update_pool(s)
        outstanding = sum(r.prompt_len - r.kv_len + max(r.sampling.max_tokens - len(r.output_ids), 0)
                          for r in s.requests.values())
        in_use = s.allocator.num_pages - s.allocator.num_free - s.cache.num_evictable_pages()
        return common_pb2.WorkerLoad(
            role=role, num_running=s.num_active, num_waiting=len(s.waiting), outstanding_tokens=outstanding,
            pool_pages_total=s.allocator.num_pages, pool_pages_free=s.allocator.num_free,
            pool_pages_cached=s.cache.num_evictable_pages(), pool_pages_in_use=in_use,
            page_size=s.page_size, max_total_tokens=s.allocator.num_pages * s.page_size, layout=layout,
            model_path=loop.engine.config.model_dir)

    return await asyncio.wrap_future(loop.call(snapshot))
