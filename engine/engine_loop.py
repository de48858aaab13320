"""Runs an Engine's scheduler on one dedicated thread; services talk to it through thread-safe calls.

All scheduler state is touched only by the loop thread: every call here enqueues a command that
the loop applies between steps. Outputs reach callers through the callback they registered, called
on the loop thread (services hop back to their event loop with ``call_soon_threadsafe``).

Streaming overlaps the GPU: a step's outputs are handed to the callbacks once the *next* decode step's
device work is queued, or before the next extend batch (the loop hands ``Scheduler.step`` its ``on_device_wait``),
so the services' per-token work runs while the GPU computes instead of between steps. With overlap scheduling
(``engine.scheduler``) a step's tokens are read after the next decode step is launched: they go out as soon as
the step returns. A step's PullStart events
go out as soon as the step returns: the pull overlaps the next step. Invariants: a request's outputs reach its
callback in step order, and outputs never wait past the end of the next step (or past the moment the loop goes
idle).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.engine import Engine
from engine.integrity import IntegrityReport
from engine.outcome import Failure, FailureKind, FinishReason, StepFailed, failure_of
from engine.request import PrefillProgress, PullStart, Request, StepOutput
from engine.scheduler_stats import SchedulerStats
from engine.step_stats import StepStats

log = logging.getLogger(__name__)

Event = StepOutput | PullStart | PrefillProgress
OutputCallback = Callable[[Event], None]

ENGINE_SWITCH_INTERVAL_S = 5e-4


def favour_engine_thread(interval_s: float = ENGINE_SWITCH_INTERVAL_S) -> None:
    """Shorten the GIL switch interval (CPython's default is 5 ms) for a service process: the engine thread,
    back from waiting on the GPU, must not wait milliseconds for the GIL while the gRPC thread streams
    tokens, or every decode step pays that wait. Process-wide, so only services call it."""
    sys.setswitchinterval(interval_s)


class EngineLoop:
    def __init__(self, engine: Engine, check_integrity_when_idle: bool = True, stats_interval_s: float = 10.0,
                 decode_interval_while_pulling_s: float = 0.0):
        if decode_interval_while_pulling_s < 0:
            raise ValueError(f"the decode interval while pulling must be >= 0 s, got {decode_interval_while_pulling_s}")
        self.engine = engine
        # While a prompt is being pulled from a prefill that shares this GPU, decode-only steps start at least
        # this far apart, so the prefill's kernels get the GPU in between (0: never paced). See ``_paced_for``.
        self.decode_interval_while_pulling_s = decode_interval_while_pulling_s
        self._next_decode_at = 0.0  # perf_counter time before which a paced decode-only step waits
        self.scheduler = engine.scheduler
        self._pending: list[Event] = []  # the last step's outputs, not yet handed to their callbacks
        self._stats_interval_s = stats_interval_s
        self._beat = time.monotonic()  # when the loop last began an iteration (idle iterations last <= 0.5 s)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._check_idle = check_integrity_when_idle
        self.last_integrity_error: str | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # -- commands (any thread) --------------------------------------------------------------------
    def submit(self, req: Request, on_output: OutputCallback) -> None:
        """Queue a request. Raises RequestRejected at once when it can never run (scheduler.validate
        reads only immutable configuration, so it is safe off the loop thread)."""
        self.scheduler.validate(req)

        def cmd() -> None:
            self._callbacks[req.rid] = on_output
            try:
                self.scheduler.submit(req)
            except Exception as e:  # noqa: BLE001 - reported through the callback (QueueFull: OVERLOADED)
                self._callbacks.pop(req.rid, None)
                on_output(StepOutput(req.rid, [], FinishReason.ABORT, req.prompt_len, 0, failure=failure_of(e)))

        self._post(cmd)

    def abort(self, rid: str) -> None:
        def cmd() -> None:
            self._callbacks.pop(rid, None)
            self.scheduler.abort(rid)

        self._post(cmd)

    def complete_pull(self, rid: str, first_token: int) -> None:
        def cmd() -> None:
            if rid in self.scheduler.pulling:
                self._dispatch([self.scheduler.complete_pull(rid, first_token)])

        self._post(cmd)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the loop thread between steps; the future holds its result. A future the caller
        cancelled before the loop got to it (e.g. through asyncio.wrap_future) skips ``fn``."""
        fut: Future = Future()

        def cmd() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self._post(cmd)
        return fut

    # -- inspection (any thread): each runs on the loop thread between steps, so it sees one consistent
    # scheduler; the caller gets a future (nothing here reads scheduler state off the loop thread) --------------
    def stats(self) -> Future[SchedulerStats]:
        """The scheduler's stats record (``Scheduler.stats``), taken between two steps."""
        return self.call(self.scheduler.stats)

    def flush_cache(self) -> Future[tuple[int, bool]]:
        """Evict every cached page no request holds: (pages freed, whether no request was active, so that nothing
        cached stayed behind for a request)."""
        def flush() -> tuple[int, bool]:
            sch = self.scheduler
            sch.flights.settle()  # pages of requests that ended while a step was in flight go back (and in) first
            return self.engine.cache.flush(), sch.num_active == 0 and sch.flights.step is None

        return self.call(flush)

    def check_integrity(self) -> Future[IntegrityReport]:
        """``Scheduler.check_integrity`` between two steps (the future raises its IntegrityError)."""
        return self.call(self.scheduler.check_integrity)

    def _post(self, cmd: Callable[[], None]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        checked = False  # integrity is checked once each time the scheduler goes idle
        runner = self.engine.runner
        stats = StepStats(self._stats_interval_s, time.perf_counter(), runner.decode_wait_s)
        while not self._stop.is_set():
            self._beat = time.monotonic()
            self._drain()
            if not self.scheduler.has_work:
                self._flush_pending()
                if self._check_idle and not checked and not self.scheduler.pulling:
                    self._idle_check()
                    checked = True
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            checked = False
            # a paced wait (see _paced_for) first reads a step left in flight: its tokens must not wait it out
            launch = (wait := self._paced_for()) <= 0
            if not launch and self.scheduler.flights.step is None:
                self._flush_pending()  # the last step's tokens go out now, not after the wait
                self._wake.wait(timeout=wait)  # a command (a new request, an abort) ends the wait early
                self._wake.clear()
                continue
            t0, tokens0 = time.perf_counter(), self.scheduler.num_decode_tokens
            try:
                # a paced step is read before the wait after it, for the same reason
                paced = bool(self.decode_interval_while_pulling_s and self.scheduler.pulling)
                outputs = self.scheduler.step(on_device_wait=self._flush_pending, overlap=not paced, launch=launch)
            except Exception as e:  # a failing batch must not take the service down
                cause = e.__cause__ if isinstance(e, StepFailed) and e.__cause__ is not None else e
                log.error("engine step failed; aborting the requests of this step", exc_info=cause)
                done = e.outputs if isinstance(e, StepFailed) else []  # what ended or came before the failure
                outputs = done + self._abort_all(Failure(FailureKind.INTERNAL, f"engine error: {cause}"))
            self._flush_pending()  # when this step ran no decode, the last step's outputs are still here
            if self.scheduler.flights.step is not None:
                self._dispatch(outputs)  # read while the device runs the step in flight: out now
            else:
                starts = [o for o in outputs if isinstance(o, PullStart)]
                self._pending = [o for o in outputs if not isinstance(o, PullStart)] if starts else outputs
                self._dispatch(starts)  # pulls start now, not after the next step's launch
            now = time.perf_counter()
            if launch and self.scheduler.num_decode_tokens > tokens0:
                self._next_decode_at = t0 + self.decode_interval_while_pulling_s
            stats.add(now - t0, self.scheduler.num_decode_tokens - tokens0)
            if (summary := stats.poll(now, runner.decode_wait_s)) is not None and summary.decode_steps:
                log.info("%s", summary.line())

    def _paced_for(self) -> float:
        """Seconds the next step waits: > 0 only when it would be decode-only (nothing to admit or extend)
        while a pull is in flight, and the last decode step began less than the interval ago. Pulled prompts
        are computed by a prefill service; on a GPU shared with it, every decode step here takes GPU time
        from that prompt, so a paced decode trades inter-token latency (the interval) for prompt throughput.
        Steps are never paced once nothing is pulled: the last requests decode at full speed."""
        if not self.decode_interval_while_pulling_s:
            return 0.0
        sch = self.scheduler
        if not sch.pulling or sch.waiting or sch.extending or not sch.running:
            return 0.0
        return self._next_decode_at - time.perf_counter()

    def _flush_pending(self) -> None:
        """Hand the last step's outputs to their callbacks (on the loop thread, in step order)."""
        if self._pending:
            outputs, self._pending = self._pending, []
            self._dispatch(outputs)

    def busy_for_s(self) -> float:
        """Seconds since the loop began its current iteration: how long one step or command has held it."""
        return time.monotonic() - self._beat

    def is_alive(self) -> bool:
        """False once the loop thread has ended (stopped, or died): a service must not keep serving then."""
        return self._thread.is_alive()

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                cmd()
            except Exception:  # no command may end the loop thread: every request would hang
                log.exception("engine loop command failed")

    def _dispatch(self, outputs: list[Event]) -> None:
        for out in outputs:
            cb = self._callbacks.get(out.rid)
            if isinstance(out, StepOutput) and out.finish_reason not in (None, FinishReason.PREFILLED):
                self._callbacks.pop(out.rid, None)
            if cb is not None:
                try:
                    cb(out)
                except Exception:
                    log.exception("output callback failed for %s", out.rid)

    def _abort_all(self, failure: Failure) -> list[StepOutput]:
        self.scheduler.flights.abandon()  # the step in flight is dropped; pages it held go back
        outs = []
        for rid in list(self.scheduler.requests):
            req = self.scheduler.abort(rid)
            if req is not None:
                outs.append(StepOutput(rid, [], FinishReason.ABORT, req.prompt_len, req.num_cached_tokens,
                                       failure=failure))
        return outs

    def _idle_check(self) -> None:
        try:
            self.scheduler.check_integrity()
            self.last_integrity_error = None
        except Exception as e:  # noqa: BLE001 - logged, the loop goes on
            if str(e) != self.last_integrity_error:
                log.error("pool integrity check failed: %s", e)
            self.last_integrity_error = str(e)
