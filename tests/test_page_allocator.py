"""PageAllocator: smallest-ids-first allocation, reference counts, errors that name the page."""

from __future__ import annotations

import random

import pytest

from engine.page_allocator import OutOfPages, PageAllocator


def test_fresh_allocator_has_every_page_free():
    a = PageAllocator(8)
    assert a.num_pages == 8
    assert a.num_free == 8
    assert a.free_pages() == set(range(8))
    assert all(a.refcount(p) == 0 for p in range(8))


def test_allocate_returns_smallest_free_ids_ascending():
    a = PageAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    assert a.decref([1, 3]) == [1, 3]
    # Freed holes are refilled first, smallest id first.
    assert a.allocate(3) == [1, 3, 5]
    assert a.num_free == 2
    assert a.free_pages() == {6, 7}


def test_allocate_sets_refcount_one_and_zero_pages_is_a_no_op():
    a = PageAllocator(4)
    assert a.allocate(0) == []
    pages = a.allocate(2)
    assert [a.refcount(p) for p in range(4)] == [1, 1, 0, 0]
    assert a.refcounts() == [1, 1, 0, 0]
    assert pages == [0, 1]


def test_can_allocate_matches_allocate():
    a = PageAllocator(4)
    a.allocate(3)
    assert a.can_allocate(1)
    assert not a.can_allocate(2)
    assert a.can_allocate(0)


def test_allocate_beyond_free_raises_out_of_pages_and_changes_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free"):
        a.allocate(2)
    assert isinstance(OutOfPages("x"), RuntimeError)
    assert a.num_free == 1
    assert a.allocate(1) == [3]


def test_incref_then_decref_frees_only_at_zero():
    a = PageAllocator(4)
    a.allocate(2)
    a.incref([0, 0, 1])
    assert a.refcount(0) == 3 and a.refcount(1) == 2
    assert a.decref([0, 1]) == []
    assert a.decref([1]) == [1]
    assert a.decref([0, 0]) == [0]
    assert a.free_pages() == {0, 1, 2, 3}


def test_decref_of_free_page_is_a_double_free_naming_the_page():
    a = PageAllocator(4)
    a.allocate(2)
    a.decref([1])
    with pytest.raises(RuntimeError, match="page 1 .*double free"):
        a.decref([1])


def test_decref_validates_all_pages_before_changing_any():
    a = PageAllocator(4)
    a.allocate(2)
    with pytest.raises(RuntimeError, match="page 1"):
        a.decref([0, 1, 1])
    assert a.refcount(0) == 1 and a.refcount(1) == 1
    assert a.num_free == 2


def test_incref_of_free_page_raises_naming_the_page():
    a = PageAllocator(4)
    a.allocate(1)
    with pytest.raises(RuntimeError, match="free page 2"):
        a.incref([0, 2])
    assert a.refcount(0) == 1  # nothing changed


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_out_of_range_pages_raise_naming_the_page(page):
    a = PageAllocator(4)
    a.allocate(4)
    with pytest.raises(RuntimeError, match=f"page {page} out of range"):
        a.incref([page])
    with pytest.raises(RuntimeError, match=f"page {page} out of range"):
        a.decref([page])
    with pytest.raises(RuntimeError, match=f"page {page} out of range"):
        a.refcount(page)


def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least 1 page"):
        PageAllocator(0)


def test_random_workload_matches_a_plain_model():
    """Against a dict model: free set, counts and smallest-first ids stay exact under churn."""
    rng = random.Random(0)
    a = PageAllocator(32)
    model = [0] * 32
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 5)
            free = sorted(p for p in range(32) if model[p] == 0)
            if n <= len(free):
                got = a.allocate(n)
                assert got == free[:n]
                for p in got:
                    model[p] = 1
                held += got
            else:
                with pytest.raises(OutOfPages):
                    a.allocate(n)
        elif op < 0.6 and held:
            p = rng.choice(held)
            a.incref([p])
            model[p] += 1
            held.append(p)
        elif held:
            p = held.pop(rng.randrange(len(held)))
            freed = a.decref([p])
            model[p] -= 1
            assert freed == ([p] if model[p] == 0 else [])
        assert a.refcounts() == model
        assert a.free_pages() == {p for p in range(32) if model[p] == 0}
        assert a.num_free == model.count(0)
