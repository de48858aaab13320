"""Radix prefix cache over token ids at PAGE granularity.

Every edge of the tree is a whole number of pages: a node's ``key`` holds ``len(pages) * page_size``
token ids and ``pages[i]`` holds the K/V of ``key[i*S:(i+1)*S]``. Only full pages are cached; a
sequence's trailing partial page stays with its request.

    root
     └─ [t0..t7 | p0 p1] ── [t8..t11 | p2]          two sequences that share 2 pages,
                       └─── [u8..u11 | p5]          split where they diverge

Ownership (see ``engine.page_allocator``): the cache holds exactly ONE reference on each page
it caches. ``insert`` increfs the pages it newly caches; ``evict`` decrefs the pages it drops.
``match_prefix`` never changes refcounts: a request that keeps matched pages increfs them.

A cached page is evictable iff its refcount is exactly 1 (only the cache holds it) and every
page after it in its node and in all of its descendants is evictable. Eviction drops pages from
the tail of least-recently-used leaves first (LRU time is a counter bumped on every match and
insert, never wall time) and removes a node once its last page is gone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from engine.page_allocator import PageAllocator


class PrefixMatch(NamedTuple):
    """Longest cached prefix: ``page_ids`` hold tokens ``[0, num_tokens)``; num_tokens = len(page_ids) * S."""

    page_ids: list[int]
    num_tokens: int


class _Node:
    __slots__ = ("children", "key", "last_access", "pages", "parent", "seq")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, seq: int) -> None:
        self.key = key
        self.pages = pages
        # Children are keyed by the token ids of their first page.
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.last_access = 0
        self.seq = seq  # creation order: breaks LRU ties deterministically


class RadixCache:
    """Prefix cache of full KV pages keyed by token ids; holds one allocator reference per cached page."""

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size}); set --page-size to a positive number")
        self.page_size = page_size
        self.allocator = allocator
        self._seq = itertools.count()
        self._clock = 0
        self._root = _Node((), [], None, next(self._seq))
        self._cached: set[int] = set()  # == the pages of all nodes; one allocator reference each
        # Since start, flushes included: pages and tokens dropped by evict(); pages dropped by flush() alone.
        self.num_evictions = 0
        self.num_evicted_tokens = 0
        self.num_flushed_pages = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        """Pages the cache currently holds a reference on."""
        return len(self._cached)

    def cached_pages(self) -> set[int]:
        """Snapshot of the cached page ids."""
        return set(self._cached)

    def num_evictable_pages(self) -> int:
        """Pages ``evict`` could free right now (``flush()`` would free exactly this many)."""
        return self._evictable(self._root)[0]

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` made of whole pages.

        MUTATES only LRU times (the matched path becomes most recently used); refcounts are
        unchanged, so the caller increfs the pages it keeps. A caller that must compute at least
        one token (for logits) matches ``tokens[:-1]``.
        """
        self._clock += 1
        pages: list[int] = []
        node = self._root
        pos = 0
        while True:
            node.last_access = self._clock
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._num_matching_pages(child, tokens, pos)
            pages.extend(child.pages[:n])
            pos += n * self.page_size
            if n < len(child.pages):
                child.last_access = self._clock
                break
            node = child
        return PrefixMatch(pages, pos)

    # -- mutations -------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], page_ids: Sequence[int]) -> int:
        """MUTATES: cache the first ``len(tokens) // page_size`` full pages of a sequence.

        ``page_ids`` is the sequence's page table (it may be longer, e.g. a partial last page).
        Pages whose tokens are already cached are not replaced: the tree's page wins and the
        caller's duplicate stays the caller's (the cache takes no reference on it). Each newly
        cached page is incref'd once. Returns the number of tokens that were already cached.
        """
        S = self.page_size
        num_pages = len(tokens) // S
        if len(page_ids) < num_pages:
            raise ValueError(
                f"insert of {len(tokens)} tokens needs {num_pages} page ids of {S} tokens, got {len(page_ids)}"
            )
        self._clock += 1
        node = self._root
        pos = 0
        while pos < num_pages * S:
            node.last_access = self._clock
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._num_matching_pages(child, tokens, pos, limit=num_pages - pos // S)
            if n < len(child.pages):
                child = self._split(child, n)
            node = child
            pos += n * S
        node.last_access = self._clock
        hit_tokens = pos
        if pos < num_pages * S:
            new_pages = [int(p) for p in page_ids[pos // S:num_pages]]
            already = [p for p in new_pages if p in self._cached]
            if already or len(set(new_pages)) != len(new_pages):
                raise RuntimeError(
                    f"insert would cache pages {already or new_pages} twice: a page table must not repeat "
                    "pages or reuse cached pages for other tokens"
                )
            self.allocator.incref(new_pages)
            leaf = _Node(tuple(tokens[pos:num_pages * S]), new_pages, node, next(self._seq))
            leaf.last_access = self._clock
            node.children[leaf.key[:S]] = leaf
            self._cached.update(new_pages)
        return hit_tokens

    def evict(self, num_pages: int) -> list[int]:
        """MUTATES: evict up to ``num_pages`` evictable pages; return the freed ids in eviction order.

        Least recently used leaves go first; within a leaf the last page goes first. A leaf whose
        last page is referenced by a request is skipped. Each evicted page is decref'd from 1 to 0
        and so becomes free.
        """
        leaves = [(n.last_access, n.seq, n) for n in self._nodes() if not n.children and n is not self._root]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < num_pages:
            _, _, node = heapq.heappop(leaves)
            first_page_key = node.key[:self.page_size]
            evicted: list[int] = []
            while node.pages and len(freed) + len(evicted) < num_pages:
                if self.allocator.refcount(node.pages[-1]) != 1:
                    break
                evicted.append(node.pages.pop())
            if evicted:
                node.key = node.key[:len(node.pages) * self.page_size]
                self.allocator.decref(evicted)
                freed.extend(evicted)
                self._cached.difference_update(evicted)
            if not node.pages:
                parent = node.parent
                assert parent is not None
                del parent.children[first_page_key]
                if parent is not self._root and not parent.children:
                    heapq.heappush(leaves, (parent.last_access, parent.seq, parent))
        self.num_evictions += len(freed)
        self.num_evicted_tokens += len(freed) * self.page_size
        return freed

    def flush(self) -> int:
        """MUTATES: evict every evictable page; return how many were evicted."""
        num_freed = len(self.evict(len(self._cached)))
        self.num_flushed_pages += num_freed
        return num_freed

    # -- structural self-check (used by engine.integrity) ---------------------------------------
    def tree_problems(self) -> list[str]:
        """Descriptions of broken tree invariants (empty when the tree is sound)."""
        problems: list[str] = []
        seen: dict[int, int] = {}
        count = 0
        for node in self._nodes():
            if node is self._root:
                continue
            if not node.pages or len(node.key) != len(node.pages) * self.page_size:
                problems.append(f"node {node.seq}: {len(node.key)} tokens for {len(node.pages)} pages")
            parent = node.parent
            if parent is None or parent.children.get(node.key[:self.page_size]) is not node:
                problems.append(f"node {node.seq}: not reachable from its parent under its first page")
            for p in node.pages:
                seen[p] = seen.get(p, 0) + 1
            count += len(node.pages)
        dup = sorted(p for p, c in seen.items() if c > 1)
        if dup:
            problems.append(f"pages cached in more than one place: {dup[:16]}")
        if count != len(self._cached) or set(seen) != self._cached:
            problems.append(
                f"the cache's page set ({len(self._cached)} pages) differs from the tree's {count} pages"
            )
        return problems

    # -- helpers -------------------------------------------------------------------------------
    def _page_key(self, tokens: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.page_size])

    def _num_matching_pages(self, node: _Node, tokens: Sequence[int], pos: int, limit: int | None = None) -> int:
        """Whole pages of ``node`` equal to ``tokens[pos:]`` (capped at ``limit`` pages)."""
        S = self.page_size
        n_max = min(len(node.pages), (len(tokens) - pos) // S)
        if limit is not None:
            n_max = min(n_max, limit)
        n = 0
        while n < n_max and tuple(tokens[pos + n * S:pos + (n + 1) * S]) == node.key[n * S:(n + 1) * S]:
            n += 1
        return n

    def _split(self, node: _Node, n: int) -> _Node:
        """Split ``node`` after its first ``n`` pages; return the new parent holding those pages."""
        S = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.pages)
        head = _Node(node.key[:n * S], node.pages[:n], parent, next(self._seq))
        head.last_access = node.last_access
        parent.children[head.key[:S]] = head
        node.key = node.key[n * S:]
        node.pages = node.pages[n:]
        node.parent = head
        head.children[node.key[:S]] = node
        return head

    def _evictable(self, top: _Node) -> tuple[int, bool]:
        """(evictable pages in the subtree of ``top``, whether that whole subtree is evictable)."""
        result: dict[int, tuple[int, bool]] = {}
        for node in reversed(self._nodes(top)):  # children before their parent
            total = 0
            all_children = True
            for child in node.children.values():
                n, full = result.pop(id(child))
                total += n
                all_children &= full
            tail = 0
            if all_children:
                for p in reversed(node.pages):
                    if self.allocator.refcount(p) != 1:
                        break
                    tail += 1
            result[id(node)] = (total + tail, all_children and tail == len(node.pages))
        return result[id(top)]

    def _nodes(self, top: _Node | None = None) -> list[_Node]:
        """Nodes of the subtree at ``top`` (default: root) in pre-order: parents before children."""
        out: list[_Node] = []
        stack = [self._root if top is None else top]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
