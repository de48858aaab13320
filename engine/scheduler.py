"""Continuous batching over the paged pool: admission, chunked extend, decode, retraction, finish.

Page ownership (engine/page_allocator.py): a request holds one reference on every page of its
page table; the radix cache holds one on every page it caches. Requests only ever WRITE to pages
past their cached prefix, so shared prefix pages are read-only.

Each ``step()`` admits what fits, runs at most one extend batch (chunk_size prompt tokens spread
over the extending requests, FIFO) and then one decode step for every running request; what it produced is
what it returns (``step()`` is the scheduler's only output channel). The pages a request gets at admission and
gives back are ``engine.request_pages``'s; ``stats()`` is the one record services report from
(``engine.scheduler_stats``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import torch

from engine.config import SchedulerConfig
from engine.fence import Fence
from engine.integrity import IntegrityReport, check_integrity
from engine.model_runner import ModelRunner
from engine.outcome import Failure, FailureKind, FinishReason, QueueFull, RequestRejected, failure_of
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.request import PrefillProgress, PullStart, Request, Status, StepOutput
from engine.request_pages import RequestPages
from engine.sampling import make_generator
from engine.scheduler_stats import SchedulerStats

log = logging.getLogger(__name__)

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
        return bool(self.waiting or self.extending or self.running)

    @property
    def num_active(self) -> int:
        return len(self.extending) + len(self.pulling) + len(self.running)

    # -- one step -------------------------------------------------------------------------------
    def step(self, on_device_wait: Callable[[], None] | None = None) -> list[StepEvent]:
        """One scheduling step; everything it produced, in order: the PullStart of each request admitted into
        PULLING, then each request's outputs (a prefill-only request's progress before its end). The step's only
        output channel. ``on_device_wait`` is called before the step blocks on the device: after the decode step
        is launched (ModelRunner.decode) and before an extend batch (which can take 100+ ms), so that the caller
        can hand out the previous step's outputs while the device computes."""
        outputs: list[StepEvent] = []
        self._admit(outputs)
        if self.extending:
            self._run_extend(outputs, on_device_wait)
        if self.running:
            self._run_decode(outputs, on_device_wait)
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
            batch, lens, tokens = self._extend_isolating(batch, lens, sample_mask, outputs)
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
                outputs.append(self._output(req, [tok]))
                continue
            req.status = Status.RUNNING
            self.running.append(req)
            self._check_stop(req)
            outputs.append(self._output(req, [tok]))
            if req.finish_reason:
                self._finish(req)

    # -- decode (path 3) ------------------------------------------------------------------------
    def _run_decode(self, outputs: list, on_device_wait: Callable[[], None] | None) -> None:
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue
            if req.kv_len == len(req.page_ids) * self.page_size:
                while not self.pages.make_room(1):
                    victim = _retraction_victim(self.running, exclude=req)
                    if victim is None:
                        break
                    self._retract(victim)
                if not self.allocator.can_allocate(1):
                    self._retract(req)
                    continue
                req.page_ids.extend(self.allocator.allocate(1))
        batch = [r for r in self.running if r.status is Status.RUNNING]
        if not batch:
            return
        try:
            tokens = self.runner.decode(batch, on_device_wait)
        except Exception:  # noqa: BLE001 - find the request(s) that fail, and fail only those
            batch, tokens = self._decode_isolating(batch, outputs)
        self.num_decode_tokens += len(batch)
        for req, tok in zip(batch, tokens):
            req.kv_len += 1
            req.output_ids.append(tok)
            self._check_stop(req)
            outputs.append(self._output(req, [tok]))
            if req.finish_reason:
                self._finish(req)

    def _decode_isolating(self, batch: list[Request], outputs: list) -> tuple[list[Request], list[int]]:
        """After a failed decode step: each request's step on its own; a request whose own step fails ends with
        an error (its pages freed, none cached), the others get their token as if nothing happened. Only a
        failure raised before the device work (bad ids, shapes) can be isolated; a device fault is fatal."""
        ok, tokens = [], []
        for req in batch:
            try:
                tokens += self.runner.decode([req])
                ok.append(req)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                log.warning("request %s failed its decode step and is ended: %s: %s", req.rid, type(e).__name__, e)
                self._fail(req, outputs, failure_of(e, "engine error in this request's decode step: "))
        return ok, tokens

    def _extend_isolating(self, batch: list[Request], lens: list[int], sample_mask: list[bool],
                          outputs: list) -> tuple[list[Request], list[int], list[int | None]]:
        """After a failed extend batch: each request's chunk on its own (it rewrites only its own pages); one whose
        own chunk fails ends with an error, the others go on as if nothing happened."""
        ok, ok_lens, tokens = [], [], []
        for req, n, m in zip(batch, lens, sample_mask, strict=True):
            try:
                tokens += self.runner.extend([req], [n], [m])
                ok.append(req)
                ok_lens.append(n)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                log.warning("request %s failed its prefill chunk and is ended: %s: %s", req.rid, type(e).__name__, e)
                self._fail(req, outputs, failure_of(e, "engine error in this request's prefill: "))
        return ok, ok_lens, tokens

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
        """Give back a running request's pages (its computed prefix stays in the cache) and requeue it."""
        self.running.remove(req)
        self.pages.release(req)
        req.status = Status.WAITING
        req.remote_prefill = False  # it resumes with the local extend path over prompt + outputs
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # -- finishing --------------------------------------------------------------------------------
    def _check_stop(self, req: Request) -> None:
        tok = req.output_ids[-1]
        sp = req.sampling
        if (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= sp.max_tokens or req.num_tokens >= self.max_context_len:
            req.finish_reason = FinishReason.LENGTH

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.release(req)
        req.status = Status.FINISHED
        self.requests.pop(req.rid, None)

    def _output(self, req: Request, tokens: list[int]) -> StepOutput:
        sp, lps = req.sampling, req.output_logprobs
        logprobs = lps[-len(tokens):] if sp.logprobs is not None and len(lps) == len(req.output_ids) else None
        first = len(req.output_ids) == len(tokens)
        prompt_lps = req.prompt_logprobs if sp.prompt_logprobs is not None and first else None
        return StepOutput(req.rid, tokens, req.finish_reason, req.prompt_len, req.num_cached_tokens,
                          logprobs=logprobs, prompt_logprobs=prompt_lps)

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
            self.pages.release(req)
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
        self._check_stop(req)
        out = self._output(req, [first_token])
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
        tables = [r.page_ids for r in (*self.extending, *self.pulling.values(), *self.running,
                                       *self.held.values())]
        return check_integrity(self.allocator, self.cache, tables)


def _retraction_victim(running: list[Request], exclude: Request) -> Request | None:
    """The request a decode step retracts to make room for ``exclude``'s next page: the newest running one."""
    candidates = [r for r in running if r is not exclude and r.status is Status.RUNNING]
    return candidates[-1] if candidates else None
