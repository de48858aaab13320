"""RadixCache and check_integrity on tiny pools (8 pages of 4 tokens) with exact page ids and eviction order.

Each test plays the request lifecycle the scheduler uses:
    match = cache.match_prefix(tokens); allocator.incref(match.page_ids)   # keep the cached prefix
    table = match.page_ids + allocator.allocate(k)                          # pages for the rest
    cache.insert(tokens, table); allocator.decref(table)                    # finish: cache, then release
"""

from __future__ import annotations

import random

import pytest

from engine.integrity import IntegrityError, IntegrityReport, check_integrity
from engine.page_allocator import PageAllocator
from engine.radix_cache import PrefixMatch, RadixCache

S = 4


def toks(*pages: int, extra: int = 0) -> list[int]:
    """Tokens made of whole pages: page value v is the 4 tokens [v*10, v*10+1, v*10+2, v*10+3]."""
    out = [v * 10 + i for v in pages for i in range(S)]
    return out + [9000 + i for i in range(extra)]


def fresh(num_pages: int = 8) -> tuple[PageAllocator, RadixCache]:
    a = PageAllocator(num_pages)
    return a, RadixCache(S, a)


def run_request(a: PageAllocator, c: RadixCache, tokens: list[int]) -> list[int]:
    """Admit, 'compute', cache and release one request; return its page table."""
    match = c.match_prefix(tokens)
    a.incref(match.page_ids)
    table = match.page_ids + a.allocate(-(-len(tokens) // S) - len(match.page_ids))
    c.insert(tokens, table)
    a.decref(table)
    return table


# -- match / insert -------------------------------------------------------------------------------

def test_empty_cache_matches_nothing():
    _, c = fresh()
    assert c.match_prefix(toks(1, 2)) == PrefixMatch([], 0)
    assert c.num_cached_pages == 0 and c.num_evictable_pages() == 0


def test_insert_caches_full_pages_only_and_match_returns_them():
    a, c = fresh()
    table = a.allocate(3)  # 10 tokens: 2 full pages + a partial one
    assert c.insert(toks(1, 2, extra=2), table) == 0
    assert c.cached_pages() == {0, 1}
    assert a.refcounts()[:3] == [2, 2, 1]  # cache ref + request ref; partial page is the request's
    assert a.decref(table) == [2]
    assert c.match_prefix(toks(1, 2, extra=2)) == PrefixMatch([0, 1], 8)
    assert c.match_prefix(toks(1, 2)) == PrefixMatch([0, 1], 8)
    assert c.match_prefix(toks(1, 2)[:7]) == PrefixMatch([0], 4)  # a partial page never matches
    assert c.match_prefix(toks(1, 3)) == PrefixMatch([0], 4)
    assert c.match_prefix(toks(2, 1)) == PrefixMatch([], 0)


def test_sequence_shorter_than_a_page_caches_nothing():
    a, c = fresh()
    table = a.allocate(1)
    assert c.insert(toks(extra=3), table) == 0
    assert c.num_cached_pages == 0
    assert a.decref(table) == [0]


def test_match_does_not_change_refcounts():
    a, c = fresh()
    run_request(a, c, toks(1, 2))
    before = a.refcounts()
    assert c.match_prefix(toks(1, 2)).page_ids == [0, 1]
    assert a.refcounts() == before


def test_diverging_sequences_share_two_pages_and_split_the_node():
    a, c = fresh()
    assert run_request(a, c, toks(1, 2, 3)) == [0, 1, 2]
    # B shares the first two pages; its table reuses them and gets page 3 for its own third page.
    match = c.match_prefix(toks(1, 2, 4, extra=1))
    assert match == PrefixMatch([0, 1], 8)
    a.incref(match.page_ids)
    table = match.page_ids + a.allocate(2)
    assert table == [0, 1, 3, 4]
    assert a.refcounts()[:5] == [2, 2, 1, 1, 1]
    assert c.insert(toks(1, 2, 4, extra=1), table) == 8  # 8 tokens were already cached
    assert c.cached_pages() == {0, 1, 2, 3}
    assert a.decref(table) == [4]
    assert a.refcounts()[:5] == [1, 1, 1, 1, 0]
    assert c.match_prefix(toks(1, 2, 3)) == PrefixMatch([0, 1, 2], 12)
    assert c.match_prefix(toks(1, 2, 4)) == PrefixMatch([0, 1, 3], 12)
    assert c.match_prefix(toks(1, 2, 5)) == PrefixMatch([0, 1], 8)
    assert c.tree_problems() == []


def test_duplicate_insert_keeps_the_trees_pages_and_leaves_the_callers_to_the_caller():
    a, c = fresh()
    run_request(a, c, toks(1, 2, 3))  # cached as pages 0, 1, 2
    # Two requests computed the same prefix concurrently; the second finishes later.
    dup = a.allocate(3)
    assert dup == [3, 4, 5]
    assert c.insert(toks(1, 2, 3), dup) == 12
    assert c.cached_pages() == {0, 1, 2}
    assert a.refcounts()[:6] == [1, 1, 1, 1, 1, 1]  # no reference taken on 3, 4, 5
    assert a.decref(dup) == [3, 4, 5]
    # Partial overlap: the tree keeps pages 0, 1 for the shared tokens and caches only page 5.
    table = a.allocate(3)
    assert table == [3, 4, 5]
    assert c.insert(toks(1, 2, 7), table) == 8
    assert c.cached_pages() == {0, 1, 2, 5}
    assert a.decref(table) == [3, 4]
    assert c.match_prefix(toks(1, 2, 7)) == PrefixMatch([0, 1, 5], 12)


def test_insert_validates_page_table():
    a, c = fresh()
    with pytest.raises(ValueError, match="needs 2 page ids"):
        c.insert(toks(1, 2), [0])
    with pytest.raises(RuntimeError, match="free page 0"):
        c.insert(toks(1, 2), [0, 1])  # pages never allocated
    assert c.num_cached_pages == 0
    run_request(a, c, toks(1))  # page 0 caches tokens of page value 1
    a.allocate(1)
    with pytest.raises(RuntimeError, match=r"pages \[0\] twice"):
        c.insert(toks(5), [0])  # page 0 already caches other tokens
    assert c.cached_pages() == {0}


# -- eviction ------------------------------------------------------------------------------------

def test_eviction_order_is_lru_leaves_first_tail_page_first():
    a, c = fresh()
    run_request(a, c, toks(1, 2, 3))          # [0,1,2]
    run_request(a, c, toks(1, 2, 4))          # shares [0,1], adds [3] (the split leaves [2] older)
    assert c.num_evictable_pages() == 4
    assert c.evict(1) == [2]
    assert c.evict(2) == [3, 1]               # B's leaf, then the shared node once it is a leaf
    assert c.match_prefix(toks(1, 2)) == PrefixMatch([0], 4)
    assert c.flush() == 1
    assert c.num_cached_pages == 0
    assert a.num_free == 8
    assert c.num_evictions == 4


def test_a_match_makes_a_path_most_recently_used():
    a, c = fresh()
    run_request(a, c, toks(1, 2, 3))
    run_request(a, c, toks(1, 2, 4))
    c.match_prefix(toks(1, 2, 3))             # A is now the most recent
    assert c.evict(8) == [3, 2, 1, 0]
    assert a.free_pages() == set(range(8))


def test_eviction_skips_pages_a_request_holds():
    a, c = fresh()
    run_request(a, c, toks(1, 2, 3))          # [0,1,2]
    run_request(a, c, toks(5, 6))             # [3,4]
    match = c.match_prefix(toks(1, 2, 9))     # a running request keeps pages 0, 1
    assert match.page_ids == [0, 1]
    a.incref(match.page_ids)
    assert a.refcounts()[:5] == [2, 2, 1, 1, 1]
    assert c.num_evictable_pages() == 3
    assert c.evict(8) == [4, 3, 2]            # B (older) first, then A's unreferenced tail
    assert c.cached_pages() == {0, 1}
    assert c.num_evictable_pages() == 0
    assert c.evict(8) == []
    assert a.decref([0, 1]) == []             # still cached
    assert c.num_evictable_pages() == 2
    assert c.flush() == 2
    assert c.num_evictions == 5


def test_interior_node_stays_while_a_child_is_referenced():
    a, c = fresh()
    run_request(a, c, toks(1, 2, 3))          # [0,1,2]
    run_request(a, c, toks(1, 2, 4))          # [0,1] + [3]
    match = c.match_prefix(toks(1, 2, 4))
    a.incref(match.page_ids)                  # holds 0, 1, 3
    assert c.num_evictable_pages() == 1
    assert c.evict(8) == [2]
    assert c.cached_pages() == {0, 1, 3}
    a.decref(match.page_ids)
    assert c.evict(8) == [3, 1, 0]


def test_partial_eviction_shrinks_the_leaf_and_it_can_grow_again():
    a, c = fresh()
    run_request(a, c, toks(1, 2, 3))          # [0,1,2]
    assert c.evict(2) == [2, 1]
    assert c.match_prefix(toks(1, 2, 3)) == PrefixMatch([0], 4)
    assert run_request(a, c, toks(1, 2, 3)) == [0, 1, 2]   # smallest free ids come back
    assert c.match_prefix(toks(1, 2, 3)) == PrefixMatch([0, 1, 2], 12)
    assert c.tree_problems() == []


def test_evicted_pages_are_free_and_reused_smallest_first():
    a, c = fresh()
    run_request(a, c, toks(1, 2))             # [0,1]
    run_request(a, c, toks(3, 4, 5, 6))       # [2,3,4,5]
    assert a.num_free == 2
    assert not a.can_allocate(3)
    assert c.evict(3 - a.num_free) == [1]
    assert a.allocate(3) == [1, 6, 7]


# -- integrity -----------------------------------------------------------------------------------

def test_integrity_counts_free_cached_and_in_use():
    a, c = fresh()
    run_request(a, c, toks(1, 2))             # cached [0,1]
    match = c.match_prefix(toks(1, 2, 3))
    a.incref(match.page_ids)
    table = match.page_ids + a.allocate(1)    # running: [0,1,2]
    other = a.allocate(2)                     # running, nothing cached: [3,4]
    run_request(a, c, toks(7))                # cached [5]
    assert check_integrity(a, c, [table, other]) == IntegrityReport(8, 2, 1, 5)
    a.decref(table)
    a.decref(other)
    assert check_integrity(a, c, []) == IntegrityReport(8, 5, 3, 0)
    c.flush()
    assert check_integrity(a, c, []) == IntegrityReport(8, 8, 0, 0)
    assert check_integrity(a, None, []) == IntegrityReport(8, 8, 0, 0)


def test_integrity_detects_a_leaked_page():
    a, c = fresh()
    table = a.allocate(2)
    a.decref(table[:1])                       # the request "finished" but forgot page 1
    with pytest.raises(IntegrityError, match=r"page 1: refcount 1 but expected 0 .*leaked page"):
        check_integrity(a, c, [])


def test_integrity_detects_a_double_free():
    a, c = fresh()
    run_request(a, c, toks(1, 2))             # cached [0,1]
    match = c.match_prefix(toks(1, 2))
    a.incref(match.page_ids)
    a.decref([1, 1])                          # released the cache's reference as well as its own
    with pytest.raises(IntegrityError, match=r"page 1: refcount 0 but expected 2 .*double free"):
        check_integrity(a, c, [match.page_ids])


def test_integrity_detects_a_page_in_the_free_heap_twice():
    a, c = fresh(4)
    a.allocate(1)
    a._free_heap.append(1)                    # planted: page 1 freed twice into the heap
    with pytest.raises(IntegrityError, match="freed twice"):
        check_integrity(a, c, [])


def test_integrity_detects_a_referenced_page_in_the_free_set():
    a, c = fresh(4)
    a.allocate(1)
    a._refcount[2] = 1                        # planted: page 2 referenced yet free
    with pytest.raises(IntegrityError, match=r"free but referenced \[2\]"):
        check_integrity(a, c, [[2]])


def test_integrity_detects_bad_page_tables():
    a, c = fresh(4)
    pages = a.allocate(2)
    a.incref([0])
    with pytest.raises(IntegrityError, match="page table 0 holds page 0 twice"):
        check_integrity(a, c, [[0, 0, 1]])
    with pytest.raises(IntegrityError, match="holds page 9, outside the pool"):
        check_integrity(a, c, [pages, [9]])


def test_integrity_detects_a_broken_tree():
    a, c = fresh(4)
    run_request(a, c, toks(1))
    c._cached.add(3)                          # planted: bookkeeping says page 3 is cached
    with pytest.raises(IntegrityError, match="radix cache: the cache's page set"):
        check_integrity(a, c, [])


# -- randomized against a plain model -------------------------------------------------------------

def test_random_workload_keeps_integrity_and_matches_a_prefix_model():
    """Model: cached page of prefix tokens[:k*S] keyed by that prefix; the tree must agree exactly."""
    rng = random.Random(1)
    a = PageAllocator(24)
    c = RadixCache(S, a)
    model: dict[tuple[int, ...], int] = {}
    running: list[tuple[list[int], list[int]]] = []
    bases = [[rng.randint(0, 9) for _ in range(4 * S)] for _ in range(3)]

    def evict(n: int) -> None:
        for p in c.evict(n):
            prefix = next(key for key, page in model.items() if page == p)
            # Only leaves go: no cached page extends the evicted one's prefix.
            assert not any(len(key) > len(prefix) and key[:len(prefix)] == prefix for key in model)
            assert a.refcount(p) == 0
            del model[prefix]

    for _ in range(400):
        if running and (rng.random() < 0.45 or not a.can_allocate(6)):
            tokens, table = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.8:
                hit = 0
                while (hit + 1) * S <= len(tokens) and tuple(tokens[:(hit + 1) * S]) in model:
                    hit += 1
                assert c.insert(tokens, table) == hit * S
                for k in range(1, len(tokens) // S + 1):
                    model.setdefault(tuple(tokens[:k * S]), table[k - 1])
            a.decref(table)
        else:
            base = bases[rng.randrange(len(bases))]
            tokens = base[:rng.randint(0, len(base))] + [rng.randint(0, 9) for _ in range(rng.randint(1, 2 * S))]
            match = c.match_prefix(tokens)
            k = 0
            while (k + 1) * S <= len(tokens) and tuple(tokens[:(k + 1) * S]) in model:
                k += 1
            assert match == PrefixMatch([model[tuple(tokens[:i * S])] for i in range(1, k + 1)], k * S)
            need = -(-len(tokens) // S) - k
            if not a.can_allocate(need):
                evict(need - a.num_free)
            if not a.can_allocate(need):
                continue
            a.incref(match.page_ids)
            running.append((tokens, match.page_ids + a.allocate(need)))
        if rng.random() < 0.1:
            evict(rng.randint(1, 4))
        assert c.cached_pages() == set(model.values())
        check_integrity(a, c, [t for _, t in running])
