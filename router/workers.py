"""gRPC clients of the decode and prefill workers, their health, their load, and the routing glue.

Each worker is polled every ``health_check_interval_s`` with GetLoad (load, pool capacity) and the standard
grpc.health.v1 Check (service ""). A worker that refuses connections is skipped at once; one that times
out is skipped after ``health_failure_threshold`` polls in a row; a skipped worker that answers again is
used again (its prefix tree is cleared: a restarted worker has an empty cache).

Load the router routes on, per worker:
  decode:  max(requests the router has open there, running + waiting at the last poll)
  prefill: prompt tokens the router sent there whose first token has not come back + the last polled
           outstanding_tokens
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.openai_protocol import OpenAIError
from router.policy import CacheAwarePolicy, DecodeCandidate, DecodeChoice, PrefillCandidate, choose_prefill
from svc_common.tls import open_channel

log = logging.getLogger(__name__)

_SERVICE = {"decode": "nvfp4serve.v1.Decode", "prefill": "nvfp4serve.v1.Prefill"}


def channel_options(config: RouterConfig) -> list[tuple[str, Any]]:
    """Message limits, keepalive, and a short reconnect backoff so a restarted worker is seen quickly."""
    return [
        ("grpc.max_send_message_length", config.grpc_max_message_bytes),
        ("grpc.max_receive_message_length", config.grpc_max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", int(max(1.0, config.health_check_interval_s) * 1000)),
    ]


class Worker:
    """One decode or prefill service as the router sees it (used from the event loop only)."""

    def __init__(self, role: str, address: str, config: RouterConfig) -> None:
        if role not in _SERVICE:
            raise ValueError(f"worker role must be decode or prefill, got {role!r}")
        self.role = role
        self.address = address
        self._config = config
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self.healthy = False
        self.last_load: common_pb2.WorkerLoad | None = None
        self.last_error = "not checked yet"
        self.last_check_time = 0.0
        self.num_failures = 0  # consecutive failed polls
        self.num_in_flight = 0  # router requests open on this worker
        self.num_in_flight_prompt_tokens = 0  # prefill: prompt tokens sent, first token not back yet
        self.num_routed = 0

    def open(self) -> None:
        """Create the channel (inside the running event loop: grpc.aio binds channels to it)."""
        self._channel = open_channel(self.address, self._config.tls, channel_options(self._config))
        stub_cls = decode_pb2_grpc.DecodeStub if self.role == "decode" else prefill_pb2_grpc.PrefillStub
        self._stub = stub_cls(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    @property
    def load(self) -> int:
        polled = self.last_load.num_running + self.last_load.num_waiting if self.last_load else 0
        return max(self.num_in_flight, polled)

    @property
    def outstanding_tokens(self) -> int:
        polled = self.last_load.outstanding_tokens if self.last_load else 0
        return self.num_in_flight_prompt_tokens + polled

    @property
    def max_total_tokens(self) -> int:
        """The worker's pool capacity in tokens (0: not reported yet)."""
        return self.last_load.max_total_tokens if self.last_load else 0

    async def get_load(self, timeout: float) -> common_pb2.WorkerLoad:
        return await self._stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout)

    def generate(self, request: decode_pb2.GenerateRequest, timeout: float | None) -> grpc.aio.UnaryStreamCall:
        """Start Decode.Generate (a server stream); the caller reads it and cancels it when done."""
        if self.role != "decode":
            raise TypeError(f"{self.address} is a {self.role} worker: it has no Generate")
        return self._stub.Generate(request, timeout=timeout, wait_for_ready=False)

    async def get_metrics(self, timeout: float) -> str:
        """The worker's Prometheus text (its GetMetrics RPC, over the router's channel: the token travels)."""
        res = await self._stub.GetMetrics(common_pb2.MetricsRequest(), timeout=timeout, wait_for_ready=False)
        return res.prometheus_text

    async def flush_cache(self, timeout: float) -> decode_pb2.FlushCacheResponse:
        if self.role != "decode":
            raise TypeError(f"{self.address} is a {self.role} worker: it has no FlushCache")
        return await self._stub.FlushCache(decode_pb2.FlushCacheRequest(), timeout=timeout)

    async def check(self) -> bool:
        """Poll GetLoad + Health once and update ``healthy``; returns it."""
        timeout = self._config.health_check_timeout_s
        load, health = await asyncio.gather(
            self.get_load(timeout), self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout),
            return_exceptions=True)
        self.last_check_time = time.time()
        error, refused = "", False
        if isinstance(load, grpc.aio.AioRpcError):
            refused = load.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)
            error = f"GetLoad failed: {load.code().name}: {load.details()}"
            if load.code() == grpc.StatusCode.UNIMPLEMENTED:
                error += f" (is {self.address} really a {self.role} service? it does not serve {_SERVICE[self.role]})"
        elif isinstance(load, BaseException):
            raise load
        elif isinstance(health, health_pb2.HealthCheckResponse) and \
                health.status != health_pb2.HealthCheckResponse.SERVING:
            error = f"health check says {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
            refused = True
        elif isinstance(health, grpc.aio.AioRpcError) and health.code() not in (
                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
            error = f"health check failed: {health.code().name}: {health.details()}"
        if not error:
            self.last_load = load
            self.last_error = ""
            self.num_failures = 0
            self.healthy = True
            return True
        self.last_error = error
        self.num_failures += 1
        if refused or self.num_failures >= self._config.health_failure_threshold:
            self.healthy = False
        return self.healthy

    def describe(self) -> dict[str, Any]:
        """JSON for /server_info."""
        return {
            "address": self.address, "role": self.role, "healthy": self.healthy, "last_error": self.last_error,
            "last_check_time": self.last_check_time, "router_in_flight": self.num_in_flight,
            "router_in_flight_prompt_tokens": self.num_in_flight_prompt_tokens, "num_routed": self.num_routed,
            "load": MessageToDict(self.last_load, preserving_proto_field_name=True) if self.last_load else None,
        }


@dataclass(frozen=True)
class Route:
    decode: Worker
    prefill: Worker | None  # None: the decode worker runs the prompt itself (no prefill service configured)
    choice: DecodeChoice


@dataclass
class Dispatch:
    """One Generate attempt's claim on its workers; ``prefill_done`` and ``end`` are idempotent."""

    route: Route
    prompt_len: int
    metrics: RouterMetrics
    _prefill_open: bool = field(default=True, init=False)
    _open: bool = field(default=True, init=False)

    def prefill_done(self) -> None:
        if self._prefill_open and self.route.prefill is not None:
            self.route.prefill.num_in_flight_prompt_tokens -= self.prompt_len
            self._gauge(self.route.prefill)
        self._prefill_open = False

    def end(self) -> None:
        if not self._open:
            return
        self.prefill_done()
        self._open = False
        self.route.decode.num_in_flight -= 1
        self._gauge(self.route.decode)
        if self.route.prefill is not None:
            self.route.prefill.num_in_flight -= 1
            self._gauge(self.route.prefill)

    def _gauge(self, w: Worker) -> None:
        self.metrics.worker_in_flight.labels(w.role, w.address).set(w.num_in_flight)


class WorkerPool:
    """All workers, the health loop, and the choice of (decode, prefill) for one Generate attempt."""

    def __init__(self, config: RouterConfig, policy: CacheAwarePolicy, metrics: RouterMetrics) -> None:
        self.config = config
        self.policy = policy
        self.metrics = metrics
        self.decode = [Worker("decode", a, config) for a in config.decode_addresses]
        self.prefill = [Worker("prefill", a, config) for a in config.prefill_addresses]
        self._task: asyncio.Task[None] | None = None

    @property
    def workers(self) -> list[Worker]:
        return [*self.decode, *self.prefill]

    async def start(self) -> None:
        """Open the channels, poll every worker once, then keep polling in the background."""
        for w in self.workers:
            w.open()
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="router-health-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.gather(*(w.close() for w in self.workers))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def check(self, worker: Worker) -> bool:
        """Poll one worker; logs and handles health transitions."""
        was = worker.healthy
        ok = await worker.check()
        self.metrics.worker_healthy.labels(worker.role, worker.address).set(1 if ok else 0)
        if ok and worker.role == "decode":
            if not was:
                self.policy.forget(worker.address)  # back from the dead: assume an empty cache
            if worker.max_total_tokens > 0:
                self.policy.set_tree_budget(worker.address, worker.max_total_tokens)
        if ok != was:
            if ok:
                log.info("%s worker %s is healthy", worker.role, worker.address)
            else:
                log.warning("%s worker %s is unhealthy: %s", worker.role, worker.address, worker.last_error)
        return ok

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.check_all()
            except Exception:  # a poll must never kill the loop
                log.exception("health check round failed")

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in (self.decode if role == "decode" else self.prefill) if w.healthy]

    @property
    def ready(self) -> bool:
        """At least one healthy decode worker, and one healthy prefill worker when any is configured."""
        return bool(self.healthy("decode")) and (not self.prefill or bool(self.healthy("prefill")))

    def context_cap(self) -> int:
        """The smallest pool capacity (tokens) among healthy decode workers that reported one (0: none)."""
        caps = [w.max_total_tokens for w in self.healthy("decode") if w.max_total_tokens > 0]
        return min(caps) if caps else 0

    def has_untried(self, role: str, tried: set[str]) -> bool:
        """Whether a healthy ``role`` worker outside ``tried`` exists."""
        return any(w.address not in tried for w in self.healthy(role))

    def _unavailable(self, role: str) -> OpenAIError:
        workers = self.decode if role == "decode" else self.prefill
        why = "; ".join(f"{w.address}: {w.last_error or 'unhealthy'}" for w in workers)
        return OpenAIError(503, f"no healthy {role} worker ({why})", code="no_healthy_worker",
                           headers={"Retry-After": str(max(1, self.config.retry_after_s))})

    def _candidates(self, role: str, exclude: set[str], allow_excluded: bool) -> list[Worker]:
        healthy = self.healthy(role)
        if not healthy:
            raise self._unavailable(role)
        fresh = [w for w in healthy if w.address not in exclude]
        if fresh or allow_excluded:
            return fresh or healthy
        raise OpenAIError(429, f"every healthy {role} worker is busy; retry later", code="overloaded",
                          headers={"Retry-After": str(max(1, self.config.retry_after_s))})

    def choose(self, tokens: tuple[int, ...], exclude_decode: set[str] | None = None,
               exclude_prefill: set[str] | None = None, allow_excluded: bool = True) -> Route:
        """Pick the workers of one Generate attempt: healthy ones, preferring those not in ``exclude_*``
        (with ``allow_excluded`` False, only those). Raises 503 when a role has no healthy worker."""
        decodes = self._candidates("decode", exclude_decode or set(), allow_excluded)
        by_addr = {w.address: w for w in decodes}
        choice = self.policy.choose_decode(tokens, [DecodeCandidate(w.address, w.load) for w in decodes])
        prefill = None
        if self.prefill:
            prefills = self._candidates("prefill", exclude_prefill or set(), True)
            by_p = {w.address: w for w in prefills}
            prefill = by_p[choose_prefill(
                [PrefillCandidate(w.address, w.outstanding_tokens, w.num_routed) for w in prefills])]
        return Route(by_addr[choice.address], prefill, choice)

    def dispatch(self, route: Route, tokens: tuple[int, ...]) -> Dispatch:
        """Claim the route for one attempt: count it in the loads and record the prompt in the tree."""
        self.policy.record(route.decode.address, tokens)
        self.metrics.routing.labels(route.choice.reason).inc()
        for w in (route.decode, route.prefill):
            if w is not None:
                w.num_in_flight += 1
                w.num_routed += 1
                self.metrics.worker_in_flight.labels(w.role, w.address).set(w.num_in_flight)
        if route.prefill is not None:
            route.prefill.num_in_flight_prompt_tokens += len(tokens)
        return Dispatch(route, len(tokens), self.metrics)

    async def probe(self, route: Route) -> None:
        """Re-check the workers of a failed attempt now, so the retry skips the dead one."""
        await asyncio.gather(*(self.check(w) for w in (route.decode, route.prefill) if w is not None))
