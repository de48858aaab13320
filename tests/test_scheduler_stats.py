"""``Scheduler.stats()``: one record of what the allocator, the prefix cache and the request queues say, taken
with one radix-tree walk; and ``step()`` as the scheduler's only output channel (a remote-prefill admission is
a PullStart in the step's outputs)."""

from __future__ import annotations

import torch

import engine.radix_cache
import engine.radix_node
from engine.config import SchedulerConfig
from engine.integrity import check_integrity
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.request import PullStart, Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler

S = 4
SP = SamplingParams(temperature=0, max_tokens=5)


def _scheduler(num_pages: int = 32) -> tuple[PageAllocator, RadixCache, Scheduler]:
    a = PageAllocator(num_pages)
    c = RadixCache(S, a)
    for first in (0, 100):  # two cached sequences of 3 pages, held by nothing but the cache
        pages = a.allocate(3)
        c.insert(list(range(first, first + 3 * S)), pages)
        a.decref(pages)
    # no model: only admission runs (remote-prefill requests go to PULLING without a forward)
    sched = Scheduler(None, a, c, S, SchedulerConfig(max_running_requests=2, decode_reserve_tokens=0), 256, 256,
                      frozenset(), torch.device("cpu"))
    return a, c, sched


def _count_walks(monkeypatch) -> list[int]:
    calls = [0]
    walk = engine.radix_node.walk

    def counted(top):
        calls[0] += 1
        return walk(top)

    monkeypatch.setattr(engine.radix_node, "walk", counted)
    monkeypatch.setattr(engine.radix_cache, "walk", counted)
    return calls


def test_a_remote_prefill_admission_is_a_pull_start_in_the_steps_outputs():
    _, _, sched = _scheduler()
    reqs = [Request(f"r{i}", list(range(500 + 10 * i, 507 + 10 * i)), SP, remote_prefill=True) for i in range(2)]
    for r in reqs:
        sched.submit(r)
    outs = sched.step()
    assert outs == [PullStart(r.rid, tuple(r.page_ids), 0, 7) for r in reqs]
    assert all(len(r.page_ids) == 2 for r in reqs) and sched.step() == []  # nothing new: no event again


def test_stats_match_the_allocator_the_cache_and_the_queues_with_one_tree_walk(monkeypatch):
    a, c, sched = _scheduler()
    reqs = [Request(f"r{i}", list(range(500 + 10 * i, 509 + 10 * i)), SP, remote_prefill=True) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    sched.step()  # two pulling (3 pages each), one waiting (max_running_requests=2)
    c.evict(1)
    sched.num_retractions = 2
    walks = _count_walks(monkeypatch)
    st = sched.stats()
    assert walks[0] == 1
    monkeypatch.undo()
    assert (st.pages_total, st.pages_free, st.num_cached_pages) == (32, a.num_free, c.num_cached_pages)
    assert st.pages_cached == c.num_evictable_pages() == 5
    report = check_integrity(a, c, [r.page_ids for r in reqs[:2]])
    assert (st.pages_free, st.pages_cached, st.pages_in_use) == (report.num_free, report.num_cached,
                                                                report.num_in_use) == (21, 5, 6)
    assert (st.num_waiting, st.num_pulling, st.num_extending, st.num_running, st.num_held, st.num_active) == \
        (1, 2, 0, 0, 0, 2)
    assert st.outstanding_tokens == 3 * (9 + 5)
    assert (st.num_evicted_pages, st.num_evicted_tokens, st.num_flushed_pages) == (1, S, 0)
    assert (st.num_retractions, st.num_prompt_cache_hit_tokens, st.host_tier) == (2, 0, None)
    assert (st.page_size, st.max_total_tokens) == (S, 32 * S)
