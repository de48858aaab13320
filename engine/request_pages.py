"""A request's pool pages over its life in the scheduler: what it gets at admission and how it gives them back.

Admission (``admit``): with a host tier the host part of the prompt's cached prefix comes back first; then the
longest cached prefix is matched (those pages are shared, read-only, one reference more each) and fresh pages
are allocated for the rest, evicting unreferenced cached pages when the pool is short. Admission keeps a reserve
of ``decode_reserve_tokens`` per active request free for their next decode tokens. Release (``release``): the
request's computed full pages go into the prefix cache and its references are dropped.

Ownership is ``engine.page_allocator``'s: the request holds one reference on every page of ``page_ids``.
"""

from __future__ import annotations

import math

from engine.config import SchedulerConfig
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.request import Request


class RequestPages:
    def __init__(self, allocator: PageAllocator, cache: RadixCache, page_size: int, config: SchedulerConfig):
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.config = config

    def admit(self, req: Request, num_active: int) -> bool:
        """Give the waiting ``req`` its pages: ``page_ids`` = matched prefix + fresh pages, ``kv_len`` = the cached
        tokens it starts from. False (no pages taken) when the pool cannot hold it and the reserve of the
        ``num_active`` requests now. A remote-prefill request whose prompt is mostly cached turns local."""
        S = self.page_size
        target = req.extend_target_len
        self._load_from_host(req, target)
        match = self.cache.match_prefix(req.tokens[:target])
        cached = match.num_tokens
        if req.sampling.prompt_logprobs is not None and not req.output_ids:
            cached = 0  # every prompt position's logits are needed
        if not req.output_ids and not req.remote_prefill:
            # keep at least one prompt token to compute: its logits give the first output token
            cached = min(cached, (target - 1) // S * S)
        if req.remote_prefill and cached >= self.config.local_extend_min_cached_ratio * req.prompt_len:
            # the cache holds most of the prompt: extend locally instead of pulling
            req.remote_prefill = False
            cached = min(cached, (target - 1) // S * S)
        prefix_pages = list(match.page_ids[: cached // S])
        total_pages = math.ceil(max(target, 1) / S)
        if not req.prefill_only and not req.remote_prefill and target % S == 0:
            total_pages += 1  # the first decode token starts a new page
        need = total_pages - len(prefix_pages)
        self.allocator.incref(prefix_pages)  # protect the matched prefix from eviction
        if not self.make_room(need + self.reserve(num_active)):
            self.allocator.decref(prefix_pages)
            return False
        req.page_ids = prefix_pages + self.allocator.allocate(need)
        req.kv_len = cached
        return True

    def reserve(self, num_active: int) -> int:
        """Pages kept free for the next decode tokens of ``num_active`` requests."""
        return math.ceil(self.config.decode_reserve_tokens / self.page_size) * num_active

    def make_room(self, num_pages: int) -> bool:
        """Evict unreferenced cached pages until ``num_pages`` are free; True when they are."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.can_allocate(num_pages)

    def release(self, req: Request) -> None:
        """``req`` gives back its pages: its computed full pages stay in the prefix cache."""
        if req.kv_len >= self.page_size:
            self.cache.insert(req.tokens[:req.kv_len], req.page_ids)
        self.allocator.decref(req.page_ids)
        req.page_ids = []
        req.kv_len = 0

    def _load_from_host(self, req: Request, target: int) -> None:
        """With a host tier: the host part of the prefix this admission can use comes back onto the device (one
        batched copy, ordered before the request's extend reads it) so that the match finds it; it then
        serves as cached tokens instead of being prefilled or pulled again."""
        if self.cache.host is None or (req.sampling.prompt_logprobs is not None and not req.output_ids):
            return
        self.cache.load_from_host(req.tokens[:(target - 1) // self.page_size * self.page_size])
