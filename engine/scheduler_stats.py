"""``SchedulerStats``: one consistent record of the scheduler's counts, taken by ``Scheduler.stats()``.

What the services report (GetLoad, the Prometheus gauges) reads this record only, never the scheduler's
queues, allocator or cache. The record is taken between two steps on the thread that runs them (services go
through ``EngineLoop.stats()``), so its numbers agree with each other: ``pages_free + pages_cached +
pages_in_use == pages_total`` and the request counts are those of one moment. Taking it walks the radix tree
once (for ``pages_cached``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.host_pool import HostTierStats


@dataclass(frozen=True)
class SchedulerStats:
    page_size: int
    pages_total: int
    pages_free: int
    pages_cached: int  # held only by the prefix cache: what eviction (or a flush) could free now
    num_cached_pages: int  # every page the prefix cache holds a reference on (some also in use by requests)
    num_waiting: int  # queued for admission, holding no pages
    num_extending: int  # prompt computed here, in chunks
    num_pulling: int  # prompt pages arriving from a prefill service
    num_running: int  # decoding
    num_held: int  # finished prefill-only requests whose pages await export
    outstanding_tokens: int  # prompt tokens still to compute plus tokens still to generate, over every request
    num_retractions: int  # since start
    num_decode_tokens: int  # tokens produced by decode steps since start
    num_prompt_cache_hit_tokens: int  # prompt tokens served from the prefix cache since start
    num_evicted_pages: int  # since start, flushes included
    num_evicted_tokens: int
    num_flushed_pages: int  # evicted by flushes alone
    host_tier: HostTierStats | None  # None without a host tier

    @property
    def num_active(self) -> int:
        """Requests holding pages for their prompt or decode: extending, pulling or running."""
        return self.num_extending + self.num_pulling + self.num_running

    @property
    def pages_in_use(self) -> int:
        """Pages some request holds (possibly also cached)."""
        return self.pages_total - self.pages_free - self.pages_cached

    @property
    def max_total_tokens(self) -> int:
        return self.pages_total * self.page_size
