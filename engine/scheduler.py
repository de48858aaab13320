"""Continuous batching over the paged pool: admission, chunked extend, decode, retraction, finish.

Page ownership (engine/page_allocator.py): a request holds one reference on every page of its
page table; the radix cache holds one on every page it caches. Requests only ever WRITE to pages
past their cached prefix, so shared prefix pages are read-only.

Each ``step()`` admits what fits, runs at most one extend batch (chunk_size prompt tokens spread
over the extending requests, FIFO) and then one decode step for every running request; what it produced is
what it returns (``step()`` is the scheduler's only output channel). The pages a request gets at admission and
gives back are ``engine.request_pages``'s; ``stats()`` is the one record services report from
(``engine.scheduler_stats``).

Overlap scheduling (the default; ``--disable-overlap-schedule`` turns it off): a step launches its decode step
and only then reads the previous decode step's sampled ids, so those tokens come out of the step after the one
that launched them, and the host's work between steps runs while the device computes. The next step's input ids
are the previous step's on the device (``engine.carried_tokens``). A stop token is seen one step late: the
request's row in the step launched meanwhile is dropped. Invariants: ``engine.in_flight``. Penalties count a
token in flight on the device. A batch with a grammar request, whose matcher takes each token on the host,
samples late: its forward is queued, the previous step read meanwhile, and then the step is sampled.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch

from engine.config import SchedulerConfig
from engine.fence import Fence
from engine.in_flight import DecodeFlights, InFlightDecode
from engine.integrity import IntegrityReport, check_integrity
from engine.model_runner import ModelRunner
from engine.outcome import Failure, FailureKind, FinishReason, QueueFull, RequestRejected, StepFailed
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.request import PrefillProgress, PullStart, Request, Status, StepOutput
from engine.request_pages import RequestPages
from engine.sampling import make_generator
from engine.scheduler_stats import SchedulerStats
from engine.step_isolation import decode_each, extend_each

StepEvent = StepOutput | PrefillProgress | PullStart  # what one step() returns, in order


class Scheduler:
    def __init__(
        self, runner: ModelRunner, allocator: PageAllocator, cache: RadixCache, page_size: int,
        config: SchedulerConfig, max_context_len: int, workspace_tokens: int,
        eos_token_ids: frozenset[int], device: torch.device, vocab_size: int | None = None,
    ):
        self.runner = runner
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.config = config
        self.max_context_len = max_context_len
        self.workspace_tokens = workspace_tokens
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.vocab_size = vocab_size  # token ids a peer hands in (complete_pull) are checked against it
        self.waiting: deque[Request] = deque()
        self.extending: list[Request] = []
        self.pulling: dict[str, Request] = {}
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished prefill-only requests whose pages await export
        self.requests: dict[str, Request] = {}
        self.num_retractions = 0
        self.num_decode_tokens = 0  # tokens produced by decode steps (extends' first tokens not counted)
        self.num_prompt_cache_hit_tokens = 0
        self.pages = RequestPages(allocator, cache, page_size, config)
        self.flights = DecodeFlights(self.pages.release)  # the decode step launched and not read yet (overlap)

    # -- submission -----------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raise RequestRejected when the request can never run here."""
        n = req.prompt_len
        if n == 0:
            raise RequestRejected("the prompt is empty", FailureKind.INVALID)
        if n >= self.max_context_len:
            raise RequestRejected(
                f"prompt of {n} tokens does not fit the model context of {self.max_context_len} tokens")
        if n > self.workspace_tokens:
            raise RequestRejected(
                f"prompt of {n} tokens exceeds the extend workspace of {self.workspace_tokens} tokens")
        need_pages = math.ceil((n + 1) / self.page_size)
        if need_pages > self.allocator.num_pages:
            raise RequestRejected(
                f"prompt of {n} tokens needs {need_pages} pages, the KV pool holds {self.allocator.num_pages} "
                f"pages of {self.page_size} tokens")

    def submit(self, req: Request) -> None:
        if req.rid in self.requests:
            raise RequestRejected(f"duplicate request id {req.rid!r}", FailureKind.INVALID)
        self.validate(req)
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFull(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        if req.sampling.seed is not None:
            req.generator = make_generator(req.sampling.seed, self.device)
        self.requests[req.rid] = req
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.extending or self.running or self.flights.step)

    @property
    def num_active(self) -> int:
        return len(self.extending) + len(self.pulling) + len(self.running)

    # -- one step -------------------------------------------------------------------------------
    def step(self, on_device_wait: Callable[[], None] | None = None, overlap: bool = True,
             launch: bool = True) -> list[StepEvent]:
        """One scheduling step; everything it produced, in order: the PullStart of each request admitted into
        PULLING, then each request's outputs (a prefill-only request's progress before its end). The step's only
        output channel. ``on_device_wait`` is called before the step blocks on the device: after the decode step
        is launched (ModelRunner.launch_decode) and before an extend batch (which can take 100+ ms), so that the
        caller can hand out the previous step's outputs while the device computes. With a decode step left in
        flight (``flights.step``), the outputs returned were read while it runs: hand them out at once.
        ``overlap=False``: this step's decode step is read before it returns, whatever the configuration (the
        engine loop's paced steps: the GPU is left to a prefill between them, so their tokens must not wait).
        ``launch=False``: only read the step in flight (nothing admitted, extended or launched). Raises StepFailed
        (the cause chained) with what it produced before a failure."""
        outputs: list[StepEvent] = []
        try:
            if not launch:
                self._read(outputs)
                return outputs
            self._admit(outputs)
            if self.extending:
                self._run_extend(outputs, on_device_wait)
            if self.running or self.flights.step is not None:
                self._run_decode(outputs, on_device_wait, overlap)
        except Exception as e:
            raise StepFailed(outputs) from e
        return outputs

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, outputs: list) -> None:
        """Admit waiting requests, FIFO, while they fit (``RequestPages.admit``); a remote-prefill one's PullStart
        (its pages, to fill from a prefill service) goes to ``outputs``."""
        while self.waiting and self.num_active < self.config.max_running_requests:
            req = self.waiting[0]
            if not self.pages.admit(req, self.num_active):
                break
            self.waiting.popleft()
            cached = req.kv_len
            if req.num_retractions == 0:
                req.num_cached_tokens = cached
                self.num_prompt_cache_hit_tokens += cached
            if req.remote_prefill:
                req.status = Status.PULLING
                self.pulling[req.rid] = req
                outputs.append(PullStart(req.rid, tuple(req.page_ids), req.kv_len, req.prompt_len))
            elif cached == req.extend_target_len:
                req.status = Status.RUNNING
                self.running.append(req)
            else:
                req.status = Status.EXTENDING
                self.extending.append(req)

    # -- extend (paths 1 and 2) -----------------------------------------------------------------
    def _run_extend(self, outputs: list, on_device_wait: Callable[[], None] | None) -> None:
        budget, ws_left = self.config.chunk_size, self.workspace_tokens
        batch, lens = [], []
        for req in self.extending:
            n = min(req.extend_target_len - req.kv_len, budget)
            if n <= 0 or req.kv_len + n > ws_left:
                break
            batch.append(req)
            lens.append(n)
            budget -= n
            ws_left -= req.kv_len + n
            if budget == 0:
                break
        if not batch:
            return
        if on_device_wait is not None:
            on_device_wait()
        sample_mask = [r.kv_len + n == r.extend_target_len and not r.output_ids for r, n in zip(batch, lens)]
        try:
            tokens = self.runner.extend(batch, lens, sample_mask)
        except Exception:  # noqa: BLE001 - find the request(s) that fail, and fail only those
            batch, lens, tokens = extend_each(self.runner, batch, lens, sample_mask,
                                              lambda req, failure: self._fail(req, outputs, failure))
        fence = Fence(self.device) if any(r.prefill_only for r in batch) else None
        for req, n, tok in zip(batch, lens, tokens):
            req.kv_len += n
            if req.kv_len < req.extend_target_len:
                if req.prefill_only:  # its pages so far may stream out while the next chunks run
                    outputs.append(PrefillProgress(req.rid, req.kv_len, fence))
                continue
            self.extending.remove(req)
            self.cache.insert(req.tokens[:req.kv_len], req.page_ids)
            if tok is None:  # resumed after retraction: its last sampled token is still pending
                req.status = Status.RUNNING
                self.running.append(req)
                continue
            req.output_ids.append(tok)
            if req.prefill_only:
                req.status = Status.FINISHED
                req.finish_reason = FinishReason.PREFILLED
                self.held[req.rid] = req
                outputs.append(req.step_output([tok]))
                continue
            req.status = Status.RUNNING
            self.running.append(req)
            req.finish_reason = req.stop_reason(self.eos_token_ids, self.max_context_len)
            outputs.append(req.step_output([tok]))
            if req.finish_reason:
                self._finish(req)

    # -- decode (path 3) ------------------------------------------------------------------------
    def _run_decode(self, outputs: list, on_device_wait: Callable[[], None] | None, overlap: bool) -> None:
        """Launch one decode step for every running request, then read the step launched before it (overlap), or
        this one at once (no overlap). A batch with a grammar request samples late: its forward is queued, the step
        before it read meanwhile (the grammars take their tokens), and only then is it sampled, as SGLang does."""
        batch = self._decode_batch(outputs)
        sync = not overlap or self.config.disable_overlap_schedule
        if sync or not batch:
            self._read(outputs)
            batch = [r for r in batch if r.status is Status.RUNNING]
        if not batch:
            return
        late = self.flights.step is not None and any(r.grammar is not None for r in batch)
        try:
            carry = self.flights.carry(batch)
            launched = self.runner.decode_logits(batch, carry=carry) if late else self.runner.launch_decode(batch, carry)
        except Exception:  # noqa: BLE001 - find the request(s) that fail, and fail only those
            Fence(self.device).wait()  # what the failed launch queued is done before a page goes back
            self._read(outputs)  # every token on the host first: the isolated steps run without overlap
            self._decode_alone(batch, outputs)
            return
        for req in batch:
            req.kv_len += 1  # its K/V slot is written by the launched step
        prev = self.flights.launched(batch, None if late else launched, Fence(self.device))
        if on_device_wait is not None:
            on_device_wait()
        if prev is not None:
            self._read(outputs, prev)
        if late:
            try:  # every token of the batch is on the host now: nothing carried
                self.flights.step.sampled = self.runner.sample_decode(launched, batch)
            except Exception:  # noqa: BLE001 - the forward ran; each request's step again, alone
                Fence(self.device).wait()  # the queued forward is done with the slots before any page goes back
                self.flights.read_done(self.flights.pop())
                for req in batch:
                    if req.status is Status.RUNNING:  # an ended one gave its pages back: kv_len 0
                        req.kv_len -= 1
                self._decode_alone(batch, outputs)
                return
        if sync:
            self._read(outputs)

    def _decode_alone(self, batch: list[Request], outputs: list) -> None:
        """After a failed decode step (nothing in flight): each running request's step on its own and read at
        once; a request whose own step fails ends with an error (``step_isolation``)."""
        ok, tokens = decode_each(self.runner, [r for r in batch if r.status is Status.RUNNING],
                                 lambda req, failure: self._fail(req, outputs, failure))
        for req in ok:
            req.kv_len += 1
        self._take_tokens(ok, tokens, outputs)

    def _decode_batch(self, outputs: list) -> list[Request]:
        """The running requests that take part in the next decode step, each with a page for its slot (pool short:
        the newest are retracted). A request whose token in flight ends it by length, whatever it is, sits out."""
        def takes_part(req: Request) -> bool:
            n = self.flights.pending(req)
            return req.status is Status.RUNNING and not (n and (
                len(req.output_ids) + n >= req.sampling.max_tokens or req.num_tokens + n >= self.max_context_len))

        for req in list(self.running):
            if not takes_part(req):
                continue
            if req.kv_len == len(req.page_ids) * self.page_size:
                if not self.pages.make_room(1) and self.flights.step is not None:
                    self._read(outputs)  # a retracted request must have no token in flight
                    if req.status is not Status.RUNNING:
                        continue
                while not self.pages.make_room(1):
                    victim = _retraction_victim(self.running, exclude=req)
                    if victim is None:
                        break
                    self._retract(victim)
                if not self.allocator.can_allocate(1):
                    self._retract(req)
                    continue
                req.page_ids.extend(self.allocator.allocate(1))
        return [r for r in self.running if takes_part(r)]

    def _read(self, outputs: list, step: InFlightDecode | None = None) -> None:
        """A launched step's tokens reach its requests (those that ended meanwhile drop theirs); then the pages of
        the requests that ended while it was in flight go back. Default: the step in flight, read now."""
        step = step if step is not None else self.flights.pop()
        if step is None:
            return
        keep = [r.status is Status.RUNNING for r in step.batch]
        try:
            tokens = self.runner.finish_decode(step.batch, step.sampled, keep)
        finally:  # even when reading fails (the loop then aborts everyone), the ended requests' pages go back
            self.flights.read_done(step)
        self._take_tokens([r for r, k in zip(step.batch, keep) if k], [t for t, k in zip(tokens, keep) if k],
                          outputs)

    def _take_tokens(self, batch: list[Request], tokens: list[int], outputs: list) -> None:
        self.num_decode_tokens += len(batch)
        for req, tok in zip(batch, tokens):
            req.output_ids.append(tok)
            req.finish_reason = req.stop_reason(self.eos_token_ids, self.max_context_len)
            outputs.append(req.step_output([tok]))
            if req.finish_reason:
                self._finish(req)

    def _fail(self, req: Request, outputs: list, failure: Failure) -> None:
        """End ``req`` with ``failure``: its pages go back to the pool without entering the prefix cache (their
        content is not to be trusted), and its caller gets the failure."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.EXTENDING:
            self.extending.remove(req)
        elif req.status is Status.PULLING:
            del self.pulling[req.rid]
        self.allocator.decref(req.page_ids)
        req.page_ids, req.kv_len = [], 0
        req.status, req.finish_reason = Status.FINISHED, FinishReason.ABORT
        self.requests.pop(req.rid, None)
        outputs.append(StepOutput(req.rid, [], FinishReason.ABORT, req.prompt_len, req.num_cached_tokens,
                                  failure=failure))

    def _retract(self, req: Request) -> None:
        """Give back a running request's pages (its computed prefix stays in the cache) and requeue it. Never with
        a token of it in flight."""
        assert not self.flights.pending(req), "retracting a request with a token in flight"
        self.running.remove(req)
        self.pages.release(req)
        req.status = Status.WAITING
        req.remote_prefill = False  # it resumes with the local extend path over prompt + outputs
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # -- finishing --------------------------------------------------------------------------------
    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.flights.give_back(req)
        req.status = Status.FINISHED
        self.requests.pop(req.rid, None)

    # -- external control (services) ----------------------------------------------------------------
    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Stop a request wherever it is and free everything it holds. Returns it, or None if unknown."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.EXTENDING:
            self.extending.remove(req)
            self.pages.release(req)
        elif req.status is Status.PULLING:
            del self.pulling[req.rid]
            self.allocator.decref(req.page_ids)
            req.page_ids = []
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self.flights.give_back(req)
        elif req.rid in self.held:  # its prompt's pages are exported: they stay cached
            del self.held[req.rid]
            req.kv_len = req.prompt_len
            self.pages.release(req)
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason
        return req

    def complete_pull(self, rid: str, first_token: int) -> StepOutput:
        """The prompt's pages arrived: cache them and start decoding from ``first_token``. A token outside the
        vocabulary (a broken peer) ends only this request, with an error."""
        if self.vocab_size is not None and not 0 <= first_token < self.vocab_size:
            failed: list[StepOutput] = []
            # the receiver checks the token before it gets here: this is a broken invariant, not bad input
            why = f"the prefill's first token {first_token} is outside the vocabulary [0, {self.vocab_size})"
            self._fail(self.pulling[rid], failed, Failure(FailureKind.INTERNAL, why))
            return failed[0]
        req = self.pulling.pop(rid)
        req.kv_len = req.prompt_len
        self.cache.insert(req.tokens[:req.kv_len], req.page_ids)
        req.output_ids.append(first_token)
        req.status = Status.RUNNING
        self.running.append(req)
        req.finish_reason = req.stop_reason(self.eos_token_ids, self.max_context_len)
        out = req.step_output([first_token])
        if req.finish_reason:
            self._finish(req)
        return out

    # -- inspection ---------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """The scheduler's counts as one record (one radix-tree walk). Call it where ``step()`` runs, between
        steps (services: ``EngineLoop.stats()``), so that the numbers are those of one moment."""
        alloc, cache = self.allocator, self.cache
        outstanding = sum(r.prompt_len - r.kv_len + max(r.sampling.max_tokens - len(r.output_ids), 0)
                          for r in self.requests.values())
        return SchedulerStats(
            page_size=self.page_size, pages_total=alloc.num_pages, pages_free=alloc.num_free,
            pages_cached=cache.num_evictable_pages(), num_cached_pages=cache.num_cached_pages,
            num_waiting=len(self.waiting), num_extending=len(self.extending), num_pulling=len(self.pulling),
            num_running=len(self.running), num_held=len(self.held), outstanding_tokens=outstanding,
            num_retractions=self.num_retractions, num_decode_tokens=self.num_decode_tokens,
            num_prompt_cache_hit_tokens=self.num_prompt_cache_hit_tokens, num_evicted_pages=cache.num_evictions,
            num_evicted_tokens=cache.num_evicted_tokens, num_flushed_pages=cache.num_flushed_pages,
            host_tier=cache.host.stats() if cache.host is not None else None)

    def check_integrity(self) -> IntegrityReport:
        ending = self.flights.ending()
        tables = [r.page_ids for r in (*self.extending, *self.pulling.values(), *self.running,
                                       *self.held.values(), *ending)]
        return check_integrity(self.allocator, self.cache, tables)


def _retraction_victim(running: list[Request], exclude: Request) -> Request | None:
    """The request a decode step retracts to make room for ``exclude``'s next page: the newest running one."""
    candidates = [r for r in running if r is not exclude and r.status is Status.RUNNING]
    return candidates[-1] if candidates else None
