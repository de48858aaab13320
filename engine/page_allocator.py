"""Page allocator: hands out KV-pool page ids and keeps one reference count per page.

Ownership model (shared with ``engine.radix_cache`` and checked by ``engine.integrity``):

  * ``allocate(n)`` returns n free pages, each with refcount 1, owned by the caller.
  * The radix cache holds ONE reference on each page it caches.
  * A running request holds one reference on each page of its page table: the pages it
    allocated, plus the cached prefix pages it matched (which it ``incref``s).
  * A page is free iff its refcount is 0; ``decref`` returning a page to 0 frees it.

Allocation is deterministic: ``allocate`` always returns the SMALLEST free ids in ascending
order (a min-heap of free ids), so tests and logs can pin exact page ids.

Invariants between calls:
    refcount[p] == 0  <=>  p is in the free heap (exactly once)
    num_free == len(free heap)
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Raised by ``allocate`` when fewer pages are free than asked for (check ``can_allocate`` first)."""


class PageAllocator:
    """Reference-counted page ids ``0 .. num_pages-1`` of one KV pool (the pool's layers share ids)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator needs at least 1 page (got {num_pages}); enlarge the KV pool")
        self._num_pages = num_pages
        self._refcount = [0] * num_pages
        # A sorted list is a valid min-heap.
        self._free_heap = list(range(num_pages))

    # -- queries (no state change) -------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Total pages managed (free or not)."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages currently free (refcount 0)."""
        return len(self._free_heap)

    def can_allocate(self, n: int) -> bool:
        """True iff ``allocate(n)`` would succeed now."""
        return 0 <= n <= len(self._free_heap)

    def refcount(self, page: int) -> int:
        """Reference count of ``page`` (0 means free)."""
        self._check_range(page)
        return self._refcount[page]

    def refcounts(self) -> list[int]:
        """Snapshot of every page's reference count, indexed by page id."""
        return list(self._refcount)

    def free_pages(self) -> set[int]:
        """Snapshot of the free page ids."""
        return set(self._free_heap)

    # -- mutations -------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """MUTATES: take the ``n`` smallest free ids (ascending), set their refcount to 1, return them.

        Raises ``OutOfPages`` ("need N pages, M free") without changing state when too few are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_heap):
            raise OutOfPages(f"need {n} pages, {len(self._free_heap)} free")
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """MUTATES: add one reference to each page (a page listed twice gets two).

        Only pages already held (refcount >= 1) can gain a reference: a free page must be
        ``allocate``d. Validates every page before changing any refcount.
        """
        pages = list(pages)
        for p in pages:
            self._check_range(p)
            if self._refcount[p] == 0:
                raise RuntimeError(f"incref of free page {p}: allocate pages before sharing them")
        for p in pages:
            self._refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """MUTATES: drop one reference from each page; return the pages that became free, in order.

        Raises RuntimeError naming the page (a double free) if a page would go below zero;
        every page is validated before any refcount changes.
        """
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            self._check_range(p)
            drops[p] = drops.get(p, 0) + 1
            if drops[p] > self._refcount[p]:
                state = "a free page" if self._refcount[p] == 0 else f"refcount {self._refcount[p]}"
                raise RuntimeError(f"decref of page {p} below zero ({state}): double free")
        freed: list[int] = []
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                heapq.heappush(self._free_heap, p)
                freed.append(p)
        return freed

    # -- helpers -------------------------------------------------------------------------------
    def _check_range(self, page: int) -> None:
        if not 0 <= page < self._num_pages:
            raise RuntimeError(f"page {page} out of range: the pool has pages 0..{self._num_pages - 1}")

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._num_pages}, num_free={self.num_free})"
