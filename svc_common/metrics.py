"""Prometheus metrics of the prefill and decode services (one registry per service process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

if TYPE_CHECKING:
    from engine.host_pool import HostTierStats
    from engine.scheduler_stats import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServiceMetrics:
    def __init__(self, role: str):
        self.role = role
        r = self.registry = CollectorRegistry()
        p = f"nvfp4_{role}"
        self.requests = Counter(f"{p}_requests", "requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram(f"{p}_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "time between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter(f"{p}_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens received", registry=r)
        self.cache_hit_tokens = Counter(f"{p}_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                        registry=r)
        self.queue_length = Gauge(f"{p}_queue_length", "requests waiting for admission", registry=r)
        self.running = Gauge(f"{p}_running_requests", "requests holding pages", registry=r)
        self.pages_total = Gauge(f"{p}_pool_pages_total", "KV pool pages", registry=r)
        self.pages_used = Gauge(f"{p}_pool_pages_used", "KV pool pages not free", registry=r)
        self.pages_cached = Gauge(f"{p}_pool_pages_cached", "pages held only by the prefix cache", registry=r)
        self.evictions = Gauge(f"{p}_evicted_pages", "pages evicted from the prefix cache since start", registry=r)
        self.evicted_tokens = Gauge(f"{p}_evicted_tokens",
                                    "tokens of the pages evicted from the prefix cache since start (flushes "
                                    "included)", registry=r)
        self.flushed_pages = Gauge(f"{p}_flushed_pages", "pages evicted by cache flushes since start",
                                   registry=r)
        self.retractions = Gauge(f"{p}_retractions", "requests retracted under pool pressure since start", registry=r)
        self.transfer_bytes = Counter(f"{p}_kv_transfer_bytes", "KV page bytes sent or received", registry=r)
        self.transfer_seconds = Counter(f"{p}_kv_transfer_seconds", "time spent in KV transfers", registry=r)
        self.transfer_tokens = Counter(f"{p}_kv_transfer_tokens", "prompt tokens whose KV pages were sent or received",
                                       registry=r)
        self.transfer_gbps = Gauge(f"{p}_kv_transfer_last_gbps", "GB/s of the last KV transfer", registry=r)
        # The host tier (--host-cache-size); all 0 without one. Counters since start, mirrored from the engine.
        self.host_pages_total = Gauge(f"{p}_host_pages_total", "host tier pages", registry=r)
        self.host_pages_used = Gauge(f"{p}_host_pages_used", "host tier pages holding evicted KV", registry=r)
        self.host_max_tokens = Gauge(f"{p}_host_max_tokens", "tokens the host tier holds (its KV dtype)", registry=r)
        self.host_hit_tokens = Gauge(f"{p}_host_hit_tokens", "prompt tokens loaded back from the host tier",
                                     registry=r)
        self.host_loads = Gauge(f"{p}_host_loads", "host -> device load batches", registry=r)
        self.host_stores = Gauge(f"{p}_host_stores", "device -> host store batches (evictions)", registry=r)
        self.host_load_bytes = Gauge(f"{p}_host_load_bytes", "bytes loaded from the host tier", registry=r)
        self.host_store_bytes = Gauge(f"{p}_host_store_bytes", "bytes stored into the host tier", registry=r)
        self.host_load_seconds = Gauge(f"{p}_host_load_seconds", "time host -> device copies took", registry=r)
        self.host_store_seconds = Gauge(f"{p}_host_store_seconds", "time device -> host copies took", registry=r)
        self.host_load_gbps = Gauge(f"{p}_host_load_gbps", "host -> device GB/s (all loads since start)", registry=r)
        self.host_store_gbps = Gauge(f"{p}_host_store_gbps", "device -> host GB/s (all stores since start)",
                                     registry=r)
        self.failed_transfers = Counter(f"{p}_failed_transfers", "KV transfers that failed", ["reason"], registry=r)

    def observe_transfer(self, num_bytes: int, seconds: float, num_tokens: int) -> None:
        self.transfer_bytes.inc(num_bytes)
        self.transfer_tokens.inc(num_tokens)
        self.transfer_seconds.inc(seconds)
        if seconds > 0:
            self.transfer_gbps.set(num_bytes / seconds / 1e9)

    def update_pool(self, st: SchedulerStats) -> None:
        """Refresh the pool and scheduler gauges from one stats record (``Scheduler.stats()``; any thread)."""
        self.pages_total.set(st.pages_total)
        self.pages_used.set(st.pages_total - st.pages_free)
        self.pages_cached.set(st.pages_cached)
        self.evictions.set(st.num_evicted_pages)
        self.evicted_tokens.set(st.num_evicted_tokens)
        self.flushed_pages.set(st.num_flushed_pages)
        self.retractions.set(st.num_retractions)
        self.queue_length.set(st.num_waiting)
        self.running.set(st.num_active)

    def update_host_tier(self, st: HostTierStats | None) -> None:
        """Refresh the host tier gauges from ``SchedulerStats.host_tier`` (None: no host tier)."""
        if st is None:
            return
        self.host_pages_total.set(st.num_pages)
        self.host_pages_used.set(st.num_used_pages)
        self.host_max_tokens.set(st.max_tokens)
        self.host_hit_tokens.set(st.hit_tokens)
        self.host_loads.set(st.num_loads)
        self.host_stores.set(st.num_stores)
        self.host_load_bytes.set(st.load_bytes)
        self.host_store_bytes.set(st.store_bytes)
        self.host_load_seconds.set(st.load_seconds)
        self.host_store_seconds.set(st.store_seconds)
        self.host_load_gbps.set(st.load_gbps)
        self.host_store_gbps.set(st.store_gbps)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve_http(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
