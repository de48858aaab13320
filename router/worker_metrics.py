"""The deployment's metrics in one scrape: the router's own families plus every worker's, labelled by worker.

Each prefill and decode service's text comes from its GetMetrics RPC (the router's channels, so the service
token travels), all workers at once, each under a short deadline. A worker that does not answer in time is
left out of that scrape and counted in ``nvfp4_router_worker_metrics_failures``; /metrics never waits longer
than the deadline. Families are merged by name across workers (one HELP and TYPE line each), every sample
gaining ``worker="host:port"``:

    nvfp4_decode_pool_pages_used{worker="127.0.0.1:50061"} 12.0
    nvfp4_decode_pool_pages_used{worker="127.0.0.1:50062"} 3.0
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator

import grpc
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from router.metrics import RouterMetrics
from router.workers import Worker

log = logging.getLogger(__name__)

WORKER_LABEL = "worker"


def relabel(text: str, worker: str) -> Iterator[Metric]:
    """The families of one worker's exposition text, every sample with ``worker`` added."""
    for family in text_string_to_metric_families(text):
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples = [Sample(s.name, {WORKER_LABEL: worker, **s.labels}, s.value, s.timestamp, s.exemplar)
                       for s in family.samples]
        yield out


def merge(per_worker: Iterable[tuple[str, str]]) -> list[Metric]:
    """Families of ``(worker address, exposition text)`` pairs merged by name (first HELP/TYPE wins; a worker's
    family whose type differs from the first one's is dropped rather than emitted as a second TYPE line)."""
    merged: dict[str, Metric] = {}
    for address, text in per_worker:
        for family in relabel(text, address):
            have = merged.get(family.name)
            if have is None:
                merged[family.name] = family
            elif have.type == family.type:
                have.samples.extend(family.samples)
            else:
                log.warning("metric %s from %s is a %s, other workers' a %s: left out", family.name, address,
                            family.type, have.type)
    return list(merged.values())


class _Families:
    """What ``generate_latest`` renders: anything with ``collect()``."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


async def scrape(workers: list[Worker], timeout: float, metrics: RouterMetrics) -> list[tuple[str, str]]:
    """Every worker's metrics text at once; those that fail or time out are counted and skipped."""

    async def one(w: Worker) -> str | None:
        try:
            return await asyncio.wait_for(w.get_metrics(timeout), timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            why = e.code().name if isinstance(e, grpc.aio.AioRpcError) else "DEADLINE_EXCEEDED"
            log.debug("GetMetrics of %s %s failed: %s", w.role, w.address, why)
            metrics.worker_metrics_failures.labels(w.role, w.address).inc()
            return None

    texts = await asyncio.gather(*(one(w) for w in workers))
    return [(w.address, t) for w, t in zip(workers, texts, strict=True) if t is not None]


async def render_deployment(metrics: RouterMetrics, workers: list[Worker], timeout: float) -> bytes:
    """The router's families, then every answering worker's, as one Prometheus text exposition."""
    per_worker = await scrape(workers, timeout, metrics)
    return metrics.render() + generate_latest(_Families(merge(per_worker)))  # type: ignore[arg-type]
