"""The router's Prometheus metrics, in its own CollectorRegistry (never the process-global one)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """All router metrics. Labels stay low-cardinality: endpoints are route paths, never raw URLs."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "nvfp4_router_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.request_latency = Histogram(p + "request_latency_seconds", "HTTP request latency (to last byte)",
                                         ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "completion tokens streamed back", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens sent to decode workers", registry=r)
        self.cached_prompt_tokens = Counter(p + "cached_prompt_tokens",
                                            "prompt tokens the decode workers served from their prefix cache",
                                            registry=r)
        self.in_flight = Gauge(p + "in_flight_requests", "requests holding a generation slot", registry=r)
        self.queued = Gauge(p + "queued_requests", "requests waiting for a generation slot", registry=r)
        self.worker_healthy = Gauge(p + "worker_healthy", "1 when the worker passed its last health check",
                                    ["role", "address"], registry=r)
        self.worker_in_flight = Gauge(p + "worker_in_flight_requests", "router requests open on a worker",
                                      ["role", "address"], registry=r)
        self.worker_metrics_failures = Counter(
            p + "worker_metrics_failures", "GetMetrics calls of /metrics that failed or timed out (worker skipped)",
            ["role", "address"], registry=r)
        self.failures = Counter(p + "failures", "failed generations by kind", ["kind"], registry=r)
        self.retries = Counter(p + "retries", "generations retried on another worker, by kind", ["kind"],
                               registry=r)
        self.routing = Counter(p + "routing_decisions", "decode choices by reason", ["reason"], registry=r)

    def bind_queue(self, num_active: Callable[[], float], num_queued: Callable[[], float]) -> None:
        """Read the in-flight and queue gauges live from the admission gate."""
        self.in_flight.set_function(num_active)
        self.queued.set_function(num_queued)

    def render(self) -> bytes:
        """Prometheus text exposition of every router metric."""
        return generate_latest(self.registry)
