"""One concurrency point of a trace replay: C sessions in flight, turn after turn.

    flush caches -> decode counters -> [pool sampler on]  C workers: take the next unstarted session, run its
    turns (wait think time, send prompt, read the answer's ids), take the next ...  [sampler off]
    -> decode counters -> CheckIntegrity on every decode worker -> figures

A session's turn t+1 is sent ``think_time_s`` after turn t's answer ended, with the prompt ``prompt(t) +
output_ids(t) + new_ids(t+1)``. A failed turn ends its session (the rest of its turns count as not sent).
``max_duration_s`` bounds a point: after it no new turn is sent and the turns in flight finish.

Figures (besides ``benchmarks.serving.stats.summarize`` over the turns: throughput, TTFT, ITL, TPOT, tokens/s
per user, peak-batch decode):

- input-token cache hit rate: sum of usage cached_tokens / sum of prompt tokens, over completed turns (also
  over turns t > 0 alone: turn 0 can only hit the shared prefix).
- re-prefilled tokens: for a turn t > 0, the tokens of turn t-1's context that the server could have kept
  (its computed K/V in whole pages: ``floor((prompt(t-1) + output(t-1) - 1) / page) * page``; the last output
  token's K/V is never computed) minus the cached tokens it reported, if positive; summed.
- evictions (pages and tokens dropped from the radix caches), retractions and the decode workers' own
  prefix-cache hit tokens: differences of the decode services' counters over the point, per worker and summed.
- integrity: ``Decode.CheckIntegrity`` of every decode worker after the point, retried for a few seconds until
  no page is in use; the point is ``ok`` only when every worker reports ok with zero pages in use.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from benchmarks.agentic.client import send_turn
from benchmarks.agentic.prompts import PromptBuilder
from benchmarks.agentic.trace import Trace
from benchmarks.serving.client import RequestResult, make_http_client
from benchmarks.serving.progress import make_progress
from benchmarks.serving.server import PoolSampler, decode_metrics, flush_cache, metrics_delta
from benchmarks.serving.stats import summarize


@dataclass(frozen=True)
class PointConfig:
    """One point: the first ``num_sessions`` sessions of the trace, ``concurrency`` of them in flight."""

    concurrency: int
    num_sessions: int
    think_time_scale: float = 1.0
    max_duration_s: float = math.inf
    flush_cache: bool = True
    request_timeout_s: float = 3600.0
    sample_interval_s: float = 0.5
    peak_window_s: float = 1.0
    num_gpus: int = 1
    save_turns: bool = True

    def __post_init__(self) -> None:
        for name in ("concurrency", "num_sessions", "num_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.think_time_scale) and self.think_time_scale >= 0):
            raise ValueError(f"--think-time-scale must be >= 0, got {self.think_time_scale}")
        for name in ("max_duration_s", "request_timeout_s", "sample_interval_s", "peak_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


@dataclass
class TurnRecord:
    """One sent turn: its timings (``result``) and what the server could have reused."""

    session_id: str
    turn: int
    result: RequestResult
    new_tokens: int
    prev_context_len: int  # tokens of turn t-1's prompt + output (0 for turn 0)
    cacheable_tokens: int  # whole pages of turn t-1's computed K/V (0 for turn 0)

    @property
    def reprefill_tokens(self) -> int:
        return max(0, self.cacheable_tokens - self.result.cached_tokens) if self.result.ok else 0

    def to_json(self) -> dict[str, Any]:
        r = self.result
        out = {"session_id": self.session_id, "turn": self.turn, "new_tokens": self.new_tokens,
               "prev_context_len": self.prev_context_len, "cacheable_tokens": self.cacheable_tokens,
               "reprefill_tokens": self.reprefill_tokens, **r.to_json()}
        tpot = r.tpot
        out["decode_tok_s"] = 1.0 / tpot if tpot else None
        return out


@dataclass
class Replay:
    """What the sessions did during one point."""

    records: list[TurnRecord]
    num_not_sent: int  # turns never sent: after max_duration_s, or after a failed turn of their session
    num_sessions_completed: int
    duration_s: float


async def replay_sessions(client: httpx.AsyncClient, model: str, trace: Trace, builder: PromptBuilder,
                          cfg: PointConfig, page_size: int, t0: float,
                          on_turn: Callable[[], None] | None = None) -> Replay:
    """Run the first ``cfg.num_sessions`` sessions, ``cfg.concurrency`` at a time (see the module
    docstring)."""
    pending = deque(trace.sessions[:cfg.num_sessions])
    records: list[TurnRecord] = []
    counts = {"not_sent": 0, "completed": 0, "sent": 0}
    deadline = t0 + cfg.max_duration_s

    async def run_one() -> None:
        while pending:
            session = pending.popleft()
            context = list(builder.shared)
            prev_len = 0
            for i, turn in enumerate(session.turns):
                wait = turn.think_time_s * cfg.think_time_scale
                if time.perf_counter() + wait >= deadline:
                    counts["not_sent"] += len(session.turns) - i
                    break
                if wait > 0:
                    await asyncio.sleep(wait)
                new = builder.new_ids(turn)
                prompt = context + new
                counts["sent"] += 1
                result, output = await send_turn(client, model, prompt, turn.output_tokens,
                                                 counts["sent"] - 1, t0)
                cacheable = (prev_len - 1) // page_size * page_size if prev_len > 0 else 0
                records.append(TurnRecord(session.session_id, turn.turn, result, len(new), prev_len,
                                          cacheable))
                if on_turn is not None:
                    on_turn()
                if not result.ok:
                    counts["not_sent"] += len(session.turns) - i - 1
                    break
                context = prompt + output
                prev_len = len(context)
            else:
                counts["completed"] += 1

    await asyncio.gather(*(run_one() for _ in range(cfg.concurrency)))
    return Replay(records, counts["not_sent"], counts["completed"], time.perf_counter() - t0)


async def check_integrity(addresses: list[str], settle_s: float = 10.0,
                          timeout_s: float = 10.0) -> dict[str, Any]:
    """address -> IntegrityReport as a dict (or {"ok": False, "error": ...}); retried until no page is in use
    on any worker or ``settle_s`` passed (a finished stream's pages are released just after its last
    token)."""
    import grpc

    from nvfp4_serve_proto import decode_pb2, decode_pb2_grpc
    from svc_common.service_auth import resolve_service_token
    from svc_common.tls import TLSConfig, open_channel

    links = TLSConfig(service_token=resolve_service_token(None))  # the deployment's token, from the environment

    async def one(address: str) -> dict[str, Any]:
        try:
            async with open_channel(address, links, []) as channel:
                stub = decode_pb2_grpc.DecodeStub(channel)
                r = await stub.CheckIntegrity(decode_pb2.CheckIntegrityRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return {"ok": False, "error": f"{exc.code().name}: {exc.details()}"}
        return {"ok": r.ok, "message": r.message, "num_total": r.num_total, "num_free": r.num_free,
                "num_cached": r.num_cached, "num_in_use": r.num_in_use}

    give_up = time.monotonic() + settle_s
    while True:
        reports = dict(zip(addresses, await asyncio.gather(*(one(a) for a in addresses)), strict=True))
        settled = all(r["ok"] and r["num_in_use"] == 0 for r in reports.values())
        if settled or time.monotonic() > give_up or any("error" in r for r in reports.values()):
            return reports
        await asyncio.sleep(0.2)


def integrity_ok(reports: dict[str, Any]) -> bool:
    """Every worker answered ok with no page in use (and there was at least one)."""
    return bool(reports) and all(r.get("ok") and r.get("num_in_use") == 0 for r in reports.values())


async def run_point(base: Any, trace: Trace, builder: PromptBuilder, cfg: PointConfig, page_size: int,
                    progress: bool = True, label: str = "") -> dict[str, Any]:
    """Run one point against ``base`` (a ``benchmarks.serving.runner.Session``) and return its JSON."""
    target, addresses = base.target, base.decode_addresses
    sessions = trace.sessions[:cfg.num_sessions]
    async with make_http_client(target, cfg.concurrency, cfg.request_timeout_s) as client:
        flushed = await flush_cache(client) if cfg.flush_cache else None
        if flushed and "error" in flushed:
            print(f"warning: /flush_cache failed, the prefix caches keep their content: {flushed['error']}",
                  file=sys.stderr)
        before = await decode_metrics(addresses)
        bar = make_progress(sum(len(s.turns) for s in sessions), f"{label} C={cfg.concurrency}".strip(),
                            progress)
        t0 = time.perf_counter()
        sampler = PoolSampler(client, cfg.sample_interval_s, t0)
        sampler.start()
        try:
            replay = await replay_sessions(client, target.model, trace, builder, cfg, page_size, t0,
                                           lambda: bar.update())
        finally:
            await sampler.stop()
            bar.close()
        after = await decode_metrics(addresses)
    integrity = await check_integrity(addresses)
    return point_json(cfg, replay, page_size, flushed, sampler.summary(), metrics_delta(before, after),
                      integrity)


def point_json(cfg: PointConfig, replay: Replay, page_size: int, flushed: dict[str, Any] | None,
               pool: dict[str, Any], decode: dict[str, Any], integrity: dict[str, Any]) -> dict[str, Any]:
    """The point's figures (see the module docstring) as JSON."""
    records = replay.records
    results = [r.result for r in records]
    point: dict[str, Any] = {"config": {**asdict(cfg), "max_duration_s": str(cfg.max_duration_s)},
                             "concurrency": cfg.concurrency, "num_sessions": cfg.num_sessions}
    point.update(summarize(results, replay.duration_s, cfg.concurrency, cfg.peak_window_s, cfg.num_gpus))
    ok = [r for r in records if r.result.ok]
    later = [r for r in ok if r.turn > 0]
    prompt_tokens = sum(r.result.prompt_tokens for r in ok)
    later_prompt = sum(r.result.prompt_tokens for r in later)
    cacheable = sum(r.cacheable_tokens for r in later)
    server = decode.get("sum", {})
    point.update({
        "turns_sent": len(records), "turns_not_sent": replay.num_not_sent,
        "sessions_completed": replay.num_sessions_completed,
        "cache_hit_rate": sum(r.result.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else None,
        "cache_hit_rate_later_turns": sum(r.result.cached_tokens for r in later) / later_prompt
        if later_prompt else None,
        # the later-turn hit rate's ceiling: the share of later prompts that an earlier turn computed (whole pages);
        # the rest is new in its turn (tool results, user text) and no cache can hold it
        "later_prompt_tokens": later_prompt, "later_hit_ceiling": cacheable / later_prompt if later_prompt else None,
        "cacheable_tokens": cacheable, "reprefill_tokens": sum(r.reprefill_tokens for r in later),
        "reprefill_fraction": sum(r.reprefill_tokens for r in later) / cacheable if cacheable else None,
        "max_context_len": max((r.result.prompt_tokens + r.result.completion_tokens for r in ok), default=0),
        "page_size": page_size,
        **{k: round(server.get(k, 0.0)) for k in ("evicted_pages", "evicted_tokens", "retractions")},
        # the host tier (--host-cache-size; all 0 without one): prompt tokens loaded back, copies, GB/s
        **{k: round(server.get(k, 0.0)) for k in ("host_hit_tokens", "host_loads", "host_stores",
                                                    "host_load_bytes", "host_store_bytes")},
        "host_load_gbps": _gbps(server, "load"), "host_store_gbps": _gbps(server, "store"),
        "integrity_ok": integrity_ok(integrity),
    })
    point["failed_point"] = not point["integrity_ok"] or point["completed"] == 0
    point["server"] = {"flush_cache": flushed, "pool": pool, "decode_metrics": decode, "integrity": integrity}
    if cfg.save_turns:
        point["turns"] = [r.to_json() for r in records]
    return point


def _gbps(server: dict[str, float], kind: str) -> float | None:
    """GB/s of the point's host tier copies (bytes / copy time, from the decode counters); None without any."""
    seconds = server.get(f"host_{kind}_seconds", 0.0)
    return server.get(f"host_{kind}_bytes", 0.0) / seconds / 1e9 if seconds > 0 else None
