"""The radix cache's since-start counters (evicted pages and tokens, flushed pages) and the decode metrics
that publish them (what `nvfp4-serve bench --trace` reads before and after each point)."""

from __future__ import annotations

import torch

from benchmarks.serving.server import parse_prometheus
from engine.config import SchedulerConfig
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.scheduler import Scheduler
from svc_common.metrics import ServiceMetrics

S = 4


def _cache_two_sequences() -> tuple[PageAllocator, RadixCache]:
    a = PageAllocator(8)
    c = RadixCache(S, a)
    for first in (0, 100):
        tokens = list(range(first, first + 3 * S))
        pages = a.allocate(3)
        c.insert(tokens, pages)
        a.decref(pages)
    return a, c


def test_evictions_count_pages_and_tokens_and_a_flush_counts_apart():
    a, c = _cache_two_sequences()
    assert (c.num_evictions, c.num_evicted_tokens, c.num_flushed_pages) == (0, 0, 0)
    assert len(c.evict(2)) == 2
    assert (c.num_evictions, c.num_evicted_tokens, c.num_flushed_pages) == (2, 2 * S, 0)
    assert c.flush() == 4
    assert (c.num_evictions, c.num_evicted_tokens, c.num_flushed_pages) == (6, 6 * S, 4)
    assert a.num_free == 8


def test_decode_metrics_publish_the_counters_as_since_start_gauges():
    _, c = _cache_two_sequences()
    c.evict(1)
    c.flush()
    metrics = ServiceMetrics("decode")
    scheduler = Scheduler(None, c.allocator, c, S, SchedulerConfig(), 64, 64, frozenset(), torch.device("cpu"))
    scheduler.num_retractions = 3
    metrics.update_pool(scheduler.stats())
    parsed = parse_prometheus(metrics.text())
    assert parsed["evicted_pages"] == 6 and parsed["evicted_tokens"] == 6 * S
    assert parsed["flushed_pages"] == 5 and parsed["retractions"] == 3
