"""Page-ownership integrity check: allocator refcounts vs radix cache vs running requests.

Every page is in exactly one of three states (the ownership model of ``engine.page_allocator``):

    free      refcount 0, in the allocator's free set, in no page table, not cached
    cached    held only by the radix cache (refcount 1)
    in use    in at least one running request's page table (refcount = tables + 1 if cached)

and ``free + cached + in use == total``. Run in tests and whenever the scheduler is idle; a
violation means a leak (refcount too high) or a double free (refcount too low) somewhere.

With a host tier (``cache.host``) its pages are accounted for the same way, on their own tier: every
host page is either free (in the host pool's free set) or held by exactly one radix node, never both,
and ``host free + host cached == host total``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache

_MAX_LISTED = 8  # problems spelled out in one error message


class IntegrityError(RuntimeError):
    """Page ownership is inconsistent; the message lists each offending page."""


class IntegrityReport(NamedTuple):
    """Page counts by state; ``num_free + num_cached + num_in_use == num_total``."""

    num_total: int
    num_free: int
    num_cached: int  # held only by the radix cache
    num_in_use: int  # held by at least one request (possibly also cached)
    num_host_total: int = 0  # host tier pages (0: no host tier)
    num_host_free: int = 0
    num_host_cached: int = 0  # held by a radix node (on the host only, or on both tiers)


def check_integrity(
    allocator: PageAllocator, cache: RadixCache | None, held_page_tables: Iterable[Sequence[int]],
) -> IntegrityReport:
    """Verify page ownership; return the page counts or raise ``IntegrityError``.

    ``held_page_tables`` are the page tables of every request that holds references (running,
    prefilling, receiving KV). ``cache`` may be None when prefix caching is off. Reads only.
    Checks: each page's refcount == (1 if cached) + (number of tables holding it); the free set
    equals {refcount == 0} with no duplicates; no page appears twice in one table; the cache
    tree is sound; free + cached + in use == total.
    """
    total = allocator.num_pages
    problems: list[str] = []

    holders = [0] * total
    for i, table in enumerate(held_page_tables):
        seen: set[int] = set()
        for p in table:
            p = int(p)
            if not 0 <= p < total:
                problems.append(f"page table {i} holds page {p}, outside the pool (0..{total - 1})")
                continue
            if p in seen:
                problems.append(f"page table {i} holds page {p} twice")
            seen.add(p)
            holders[p] += 1

    cached = cache.cached_pages() if cache is not None else set()
    if cache is not None:
        problems.extend(f"radix cache: {msg}" for msg in cache.tree_problems())
    for p in sorted(cached):
        if not 0 <= p < total:
            problems.append(f"radix cache holds page {p}, outside the pool (0..{total - 1})")

    refcounts = allocator.refcounts()
    for p in range(total):
        expected = holders[p] + (1 if p in cached else 0)
        if refcounts[p] != expected:
            kind = "leaked page" if refcounts[p] > expected else "double free"
            problems.append(
                f"page {p}: refcount {refcounts[p]} but expected {expected} "
                f"({'cached' if p in cached else 'not cached'}, in {holders[p]} page tables): {kind}"
            )

    free = allocator.free_pages()
    zero = {p for p in range(total) if refcounts[p] == 0}
    if free != zero:
        problems.append(
            f"free set differs from refcount==0 pages: free but referenced {sorted(free - zero)[:16]}, "
            f"unreferenced but not free {sorted(zero - free)[:16]}"
        )
    if allocator.num_free != len(free):
        problems.append(f"allocator counts {allocator.num_free} free pages but {len(free)} distinct ids are free"
                        " (a page was freed twice)")

    num_in_use = sum(1 for h in holders if h > 0)
    num_cached = sum(1 for p in cached if 0 <= p < total and holders[p] == 0)
    num_free = len(free)
    if num_free + num_cached + num_in_use != total:
        problems.append(
            f"free {num_free} + cached {num_cached} + in use {num_in_use} = "
            f"{num_free + num_cached + num_in_use}, not the {total} pages of the pool"
        )

    host_counts = _check_host_tier(cache, problems) if cache is not None and cache.host is not None else (0, 0, 0)

    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise IntegrityError(
            f"KV page integrity violated ({len(problems)} problems):\n  "
            + "\n  ".join(problems[:_MAX_LISTED]) + more
        )
    return IntegrityReport(total, num_free, num_cached, num_in_use, *host_counts)


def _check_host_tier(cache: RadixCache, problems: list[str]) -> tuple[int, int, int]:
    """Host pages: each free or held by one node, exactly once; returns (total, free, cached)."""
    host = cache.host
    assert host is not None
    total = host.num_pages
    held: dict[int, int] = {}
    for h in cache.host_pages():
        held[h] = held.get(h, 0) + 1
    bad = sorted(h for h in held if not 0 <= h < total)
    if bad:
        problems.append(f"radix cache holds host pages {bad[:16]}, outside the host tier (0..{total - 1})")
    twice = sorted(h for h, c in held.items() if c > 1)
    if twice:
        problems.append(f"host pages held by more than one node: {twice[:16]}")
    free = host.free_pages()
    if host.num_free != len(free):
        problems.append(f"host tier counts {host.num_free} free pages but {len(free)} distinct ids are free "
                        "(a host page was freed twice)")
    both = sorted(free & set(held))
    if both:
        problems.append(f"host pages both free and held by a node: {both[:16]}")
    lost = sorted(set(range(total)) - free - set(held))
    if lost:
        problems.append(f"host pages neither free nor held by a node (leaked): {lost[:16]}")
    num_cached = len(set(held) - free)
    if len(free) + num_cached != total:
        problems.append(f"host free {len(free)} + host cached {num_cached} != the {total} pages of the host tier")
    return total, len(free), num_cached
