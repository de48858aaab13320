"""Continuous batching over the paged pool: admission, chunked extend, decode, retraction, finish.

Page ownership (engine/page_allocator.py): a request holds one reference on every page of its
page table; the radix cache holds one on every page it caches. Requests only ever WRITE to pages
past their cached prefix, so shared prefix pages are read-only.

Each ``step()`` admits what fits, runs at most one extend batch (chunk_size prompt tokens spread
over the extending requests, FIFO) and then one decode step for every running request.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import torch

from engine.config import SchedulerConfig
from engine.fence import Fence
from engine.host_pool import HostTierStats
from engine.integrity import IntegrityReport, check_integrity
from engine.model_runner import ModelRunner
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.request import PrefillProgress, Request, Status, StepOutput
from engine.sampling import make_generator

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never be served with this configuration (the message says why)."""


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
        # Called before the step blocks on the device: after a decode step is launched (ModelRunner.decode)
        # and before an extend batch (which can take 100+ ms), so the outputs of the previous step never wait.
        self.on_device_wait: Callable[[], None] | None = None
        self.pull_starts: list[Request] = []  # admitted into PULLING during the last step

    # -- submission -----------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raise RequestRejected when the request can never run here."""
        n = req.prompt_len
        if n == 0:
            raise RequestRejected("the prompt is empty")
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
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        self.validate(req)
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise OverflowError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
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
    def step(self) -> list[StepOutput | PrefillProgress]:
        """One scheduling step; its outputs in order (a prefill-only request's progress before its end)."""
        outputs: list[StepOutput | PrefillProgress] = []
        self._admit(outputs)
        if self.extending:
            self._run_extend(outputs)
        if self.running:
            self._run_decode(outputs)
        return outputs

    # -- admission ------------------------------------------------------------------------------
    def _reserve_pages(self) -> int:
        per_req = math.ceil(self.config.decode_reserve_tokens / self.page_size)
        return per_req * (len(self.running) + len(self.pulling) + len(self.extending))

    def _admit(self, outputs: list) -> None:
        while self.waiting and self.num_active < self.config.max_running_requests:
            req = self.waiting[0]
            target = req.extend_target_len
            self._load_from_host(req, target)
            match = self.cache.match_prefix(req.tokens[:target])
            cached = match.num_tokens
            if req.sampling.prompt_logprobs is not None and not req.output_ids:
                cached = 0  # every prompt position's logits are needed
            if not req.output_ids and not req.remote_prefill:
                # keep at least one prompt token to compute: its logits give the first output token
                cached = min(cached, (target - 1) // self.page_size * self.page_size)
            if req.remote_prefill and cached >= self.config.local_extend_min_cached_ratio * req.prompt_len:
                # the cache holds most of the prompt: extend locally instead of pulling
                req.remote_prefill = False
                cached = min(cached, (target - 1) // self.page_size * self.page_size)
            prefix_pages = list(match.page_ids[: cached // self.page_size])
            total_pages = math.ceil(max(target, 1) / self.page_size)
            if not req.prefill_only and not req.remote_prefill and target % self.page_size == 0:
                total_pages += 1  # the first decode token starts a new page
            need = total_pages - len(prefix_pages)
            self.allocator.incref(prefix_pages)  # protect the matched prefix from eviction
            reserve = self._reserve_pages() if self.num_active else 0
            if not self._make_room(need + reserve):
                self.allocator.decref(prefix_pages)
                break
            self.waiting.popleft()
            req.page_ids = prefix_pages + self.allocator.allocate(need)
            req.kv_len = cached
            if req.num_retractions == 0:
                req.num_cached_tokens = cached
                self.num_prompt_cache_hit_tokens += cached
            if req.remote_prefill:
                req.status = Status.PULLING
                self.pulling[req.rid] = req
                self.pull_starts.append(req)
            elif cached == target:
                req.status = Status.RUNNING
                self.running.append(req)
            else:
                req.status = Status.EXTENDING
                self.extending.append(req)

    def _load_from_host(self, req: Request, target: int) -> None:
        """With a host tier: the host part of the prefix this admission can use comes back onto the device (one
        batched copy, ordered before the request's extend reads it) so that the match below finds it; it then
        serves as cached tokens instead of being prefilled or pulled again."""
        if self.cache.host is None or (req.sampling.prompt_logprobs is not None and not req.output_ids):
            return
        self.cache.load_from_host(req.tokens[:(target - 1) // self.page_size * self.page_size])

    def host_tier_stats(self) -> HostTierStats | None:
        """The host tier's counters (None without one): what metrics and GetLoad report."""
        return self.cache.host.stats() if self.cache.host is not None else None

    def _make_room(self, num_pages: int) -> bool:
        """Evict unreferenced cached pages until ``num_pages`` are free; True when they are."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.can_allocate(num_pages)

    # -- extend (paths 1 and 2) -----------------------------------------------------------------
    def _run_extend(self, outputs: list) -> None:
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
        if self.on_device_wait is not None:
            self.on_device_wait()
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
                req.finish_reason = "prefill"
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
    def _run_decode(self, outputs: list) -> None:
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue
            if req.kv_len == len(req.page_ids) * self.page_size:
                while not self._make_room(1):
                    victim = self._retraction_victim(exclude=req)
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
            tokens = self.runner.decode(batch, self.on_device_wait)
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
                self._fail(req, outputs, f"engine error in this request's decode step: {type(e).__name__}: {e}")
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
                self._fail(req, outputs, f"engine error in this request's prefill: {type(e).__name__}: {e}")
        return ok, ok_lens, tokens

    def _fail(self, req: Request, outputs: list, message: str) -> None:
        """End ``req`` with an error: its pages go back to the pool without entering the prefix cache (their
        content is not to be trusted), and its caller gets ``message``."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.EXTENDING:
            self.extending.remove(req)
        elif req.status is Status.PULLING:
            del self.pulling[req.rid]
        self.allocator.decref(req.page_ids)
        req.page_ids, req.kv_len = [], 0
        req.status, req.finish_reason = Status.FINISHED, "abort"
        self.requests.pop(req.rid, None)
        outputs.append(StepOutput(req.rid, [], "abort", req.prompt_len, req.num_cached_tokens, error=message))

    def _retraction_victim(self, exclude: Request) -> Request | None:
        candidates = [r for r in self.running if r is not exclude and r.status is Status.RUNNING]
        return candidates[-1] if candidates else None

    def _retract(self, req: Request) -> None:
        """Give back a running request's pages (its computed prefix stays in the cache) and requeue it."""
        self.running.remove(req)
        self._release_pages(req)
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
            req.finish_reason = "stop"
        elif len(req.output_ids) >= sp.max_tokens or req.num_tokens >= self.max_context_len:
            req.finish_reason = "length"

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self._release_pages(req)
        req.status = Status.FINISHED
        self.requests.pop(req.rid, None)

    def _release_pages(self, req: Request) -> None:
        if req.kv_len >= self.page_size:
            self.cache.insert(req.tokens[:req.kv_len], req.page_ids)
        self.allocator.decref(req.page_ids)
        req.page_ids = []
        req.kv_len = 0

    def _output(self, req: Request, tokens: list[int]) -> StepOutput:
        sp, lps = req.sampling, req.output_logprobs
        logprobs = lps[-len(tokens):] if sp.logprobs is not None and len(lps) == len(req.output_ids) else None
        first = len(req.output_ids) == len(tokens)
        prompt_lps = req.prompt_logprobs if sp.prompt_logprobs is not None and first else None
        return StepOutput(req.rid, tokens, req.finish_reason, req.prompt_len, req.num_cached_tokens,
                          logprobs=logprobs, prompt_logprobs=prompt_lps)

    # -- external control (services) ----------------------------------------------------------------
    def abort(self, rid: str, reason: str = "abort") -> Request | None:
        """Stop a request wherever it is and free everything it holds. Returns it, or None if unknown."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.EXTENDING:
            self.extending.remove(req)
            self._release_pages(req)
        elif req.status is Status.PULLING:
            del self.pulling[req.rid]
            self.allocator.decref(req.page_ids)
            req.page_ids = []
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self._release_pages(req)
        elif req.rid in self.held:
            self._release_held(req)
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason
        return req

    def complete_pull(self, rid: str, first_token: int) -> StepOutput:
        """The prompt's pages arrived: cache them and start decoding from ``first_token``. A token outside the
        vocabulary (a broken peer) ends only this request, with an error."""
        if self.vocab_size is not None and not 0 <= first_token < self.vocab_size:
            failed: list[StepOutput] = []
            self._fail(self.pulling[rid], failed, f"the prefill's first token {first_token} is outside the "
                                                  f"vocabulary [0, {self.vocab_size})")
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

    def _release_held(self, req: Request) -> None:
        del self.held[req.rid]
        req.kv_len = req.prompt_len
        self._release_pages(req)

    def flush_cache(self) -> int:
        """Evict every cached page no request holds; returns the number of pages freed."""
        return self.cache.flush()

    def check_integrity(self) -> IntegrityReport:
        tables = [r.page_ids for r in (*self.extending, *self.pulling.values(), *self.running,
                                       *self.held.values())]
        return check_integrity(self.allocator, self.cache, tables)
