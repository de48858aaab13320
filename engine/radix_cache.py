"""Radix prefix cache over token ids at PAGE granularity.

Every edge of the tree is a whole number of pages: a node's ``key`` holds ``len(pages) * page_size``
token ids and ``pages[i]`` holds the K/V of ``key[i*S:(i+1)*S]``. Only full pages are cached; a
sequence's trailing partial page stays with its request. The node type and the walks that only read the tree
(matching a page, the evictable count, the structural check) are ``engine.radix_node``'s.

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

With a host tier (``engine.host_pool.HostPool``) every node lives on the device (``pages``), on the
host (``host_pages``) or both, always whole nodes:

    root ── [A | dev p0 p1 | host -]  ── [B | dev p2 | host h3]  ── [C | dev - | host h0 h1]
             device only                  both                        host only

Invariants: a node on the device has its parent on the device (device nodes are a top subtree, so a
match walks device pages first and host pages after); a node is on at least one tier; the cache owns
each host page of a node (one owner per host page, checked by ``engine.integrity``). Eviction from the
device then works per LRU device leaf (a node with no child on the device): it splits off the evictable
tail of the node, copies that tail to the host in one batch per ``evict`` call (pages already on the host
are not copied again) and frees the device pages; only when the host cannot take them (full of nodes a
load holds) or the store fails (its host pages then hold nothing to trust) is the node dropped. The host
evicts LRU too: a node's host copy whose node is also on the device, or a host-only leaf, never one the same
eviction is storing (each host page is written once per store). ``load_from_host`` brings the host part of a prefix back into fresh device
pages (one batch) before a request matches it; a host page is read only by that copy, never while a store
into it is pending (``HostPool`` orders them on one stream).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, NamedTuple

from engine.page_allocator import PageAllocator
from engine.radix_node import (
    Node,
    device_children,
    evictable,
    num_matching_pages,
    page_key,
    tree_problems,
    walk,
)
from engine.radix_node import num_pages as node_pages

# With a host tier an eviction frees at least this many bytes of device pages (as many as are evictable): a
# store of a few pages is latency-bound (on the H200, 36 layers: 4-35 GB/s for 1-8 pages, 44-49 GB/s for 64 pages
# of 42-76 MB, 50-52 GB/s for 340-600 MB; docs/benchmarks/host_tier_copy.md), and a full pool otherwise evicts a
# page or two per admission. In bytes, not pages: a page of an 8-layer model is a fifth of a 36-layer one's (64
# pages of it stored at 38 GB/s in the agentic sweep; 64 MiB batches did too, so the sweep's store rate is not
# set by the batch size; a probe points at the launching thread's GIL waits, docs/benchmarks/host_tier_launch_h100.md). The
# extra pages are the least recently used and stay on the host, so a later hit loads them instead of prefilling.
HOST_STORE_MIN_BYTES = 64 << 20


def host_store_min_pages(page_bytes: int) -> int:
    """Pages one eviction stores at least by default: ``HOST_STORE_MIN_BYTES`` of pages of ``page_bytes``."""
    return max(1, -(-HOST_STORE_MIN_BYTES // page_bytes))

if TYPE_CHECKING:
    from engine.host_pool import HostPool

log = logging.getLogger(__name__)


class PrefixMatch(NamedTuple):
    """Longest cached prefix: ``page_ids`` hold tokens ``[0, num_tokens)``; num_tokens = len(page_ids) * S."""

    page_ids: list[int]
    num_tokens: int


class RadixCache:
    """Prefix cache of full KV pages keyed by token ids; holds one allocator reference per cached page."""

    def __init__(self, page_size: int, allocator: PageAllocator, host: HostPool | None = None,
                 store_min_pages: int | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size}); set --page-size to a positive number")
        if store_min_pages is None:
            store_min_pages = 1 if host is None else host_store_min_pages(host.page_bytes)
        if store_min_pages < 1:
            raise ValueError(f"store_min_pages must be >= 1, got {store_min_pages}")
        if host is not None and host.page_size != page_size:
            raise ValueError(f"host tier pages hold {host.page_size} tokens, the cache's {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.host = host  # None: no host tier (evicted pages are dropped)
        self.store_min_pages = store_min_pages  # with a host tier: device pages one eviction frees at least
        self._locked: set[int] = set()  # seq of host nodes a load_from_host is reading: never host-evicted
        self._seq = itertools.count()
        self._clock = 0
        self._root = Node((), [], None, next(self._seq))
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
        return evictable(self._root, self.allocator.refcount)[0]  # one tree walk

    def host_pages(self) -> list[int]:
        """Every host page the tree holds, one entry per node page (a repeat would be a bug)."""
        return [h for node in walk(self._root) for h in node.host_pages]

    def residency(self, tokens: Sequence[int]) -> list[str]:
        """Where each cached whole page of ``tokens``'s longest cached prefix lives: "device", "host" or "both".
        Reads only (LRU times unchanged)."""
        S, out, node, pos = self.page_size, [], self._root, 0
        while (child := node.children.get(page_key(tokens, pos, self.page_size))) is not None:
            n = num_matching_pages(child, tokens, pos, S)
            tier = "both" if child.pages and child.host_pages else "device" if child.pages else "host"
            out += [tier] * n
            pos += n * S
            if n < node_pages(child, S):
                break
            node = child
        return out

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
            child = node.children.get(page_key(tokens, pos, self.page_size))
            if child is None or not child.pages:  # a host-only node: load_from_host brings it back first
                break
            n = num_matching_pages(child, tokens, pos, self.page_size)
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
            child = node.children.get(page_key(tokens, pos, self.page_size))
            if child is None:
                break
            n = num_matching_pages(child, tokens, pos, S, limit=num_pages - pos // S)
            if n < node_pages(child, S):
                child = self._split(child, n)
            if not child.pages and not self._adopt(child, page_ids[pos // S:pos // S + n]):
                return pos  # nothing below a node that stays off the device may go on it
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
            leaf = Node(tuple(tokens[pos:num_pages * S]), new_pages, node, next(self._seq))
            leaf.last_access = self._clock
            node.children[leaf.key[:S]] = leaf
            self._cached.update(new_pages)
        return hit_tokens

    def evict(self, num_pages: int) -> list[int]:
        """MUTATES: evict up to ``num_pages`` evictable pages; return the freed ids in eviction order.

        Least recently used leaves go first; within a leaf the last page goes first. A leaf whose
        last page is referenced by a request is skipped. Each evicted page is decref'd from 1 to 0
        and so becomes free. With a host tier the evicted pages are copied to the host first (one
        batch of at least ``store_min_pages``, ``HOST_STORE_MIN_BYTES`` of pages unless set, where that many are
        evictable) and their nodes stay in the tree, on the host.
        """
        if self.host is not None:
            return self._evict_tiered(max(num_pages, self.store_min_pages) if num_pages > 0 else 0, store=True)
        leaves = [(n.last_access, n.seq, n) for n in walk(self._root) if not n.children and n is not self._root]
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
        """MUTATES: evict every evictable page (and empty the host tier); return how many device pages were
        evicted."""
        if self.host is None:
            num_freed = len(self.evict(len(self._cached)))
        else:
            num_freed = len(self._evict_tiered(len(self._cached), store=False))
            for node in walk(self._root):
                if node.host_pages and node.seq not in self._locked:
                    self._drop_host_copy(node)
        self.num_flushed_pages += num_freed
        return num_freed

    def load_from_host(self, tokens: Sequence[int]) -> int:
        """MUTATES: bring the host-only part of ``tokens``'s longest cached prefix back onto the device.

        The nodes after the device part of the match get fresh device pages (the cache's reference, as if
        inserted) filled from their host pages in one batched copy; they stay on the host too. Device room is
        made by ``evict`` (to the host), never from the prefix being loaded. Returns the tokens loaded (0 when
        there is no host tier, nothing on the host, or no device room). A copy that fails frees the new device
        pages and drops the host nodes it read (their bytes are not trusted): everything stays accounted for.
        """
        if self.host is None:
            return 0
        S = self.page_size
        self._clock += 1
        node, pos, path_pages = self._root, 0, []
        while True:  # the device part of the match
            node.last_access = self._clock
            child = node.children.get(page_key(tokens, pos, self.page_size))
            if child is None:
                return 0
            n = num_matching_pages(child, tokens, pos, S)
            if not child.pages:
                break
            path_pages += child.pages[:n]
            pos += n * S
            if n < len(child.pages):
                return 0
            node = child
        chain: list[Node] = []  # host-only nodes of the match (their descendants are host-only too)
        while child is not None and not child.pages and (n := num_matching_pages(child, tokens, pos, S)):
            if n < node_pages(child, S):
                child = self._split(child, n)
            child.last_access = self._clock
            chain.append(child)
            pos += n * S
            child = child.children.get(page_key(tokens, pos, self.page_size))
        if not chain:
            return 0
        self.allocator.incref(path_pages)  # the device part must survive the room made below
        self._locked.update(c.seq for c in chain)
        try:
            want = sum(len(c.host_pages) for c in chain)
            if want > self.allocator.num_free:
                self.evict(want - self.allocator.num_free)
            room, kept = self.allocator.num_free, []
            for c in chain:
                if room < len(c.host_pages):
                    if room:
                        kept.append(self._split(c, room))
                    break
                kept.append(c)
                room -= len(c.host_pages)
            if not kept:
                return 0
            host_flat = [h for c in kept for h in c.host_pages]
            dev = self.allocator.allocate(len(host_flat))
            try:
                self.host.load(host_flat, dev)
            except Exception as e:  # noqa: BLE001 - the request recomputes; nothing may leak
                log.warning("host tier: loading %d pages failed, dropping them: %s: %s", len(dev), type(e).__name__, e)
                self.allocator.decref(dev)
                self._remove_subtree(kept[0])
                return 0
            i = 0
            for c in kept:
                c.pages = dev[i:i + len(c.host_pages)]
                i += len(c.pages)
            self._cached.update(dev)
            self.host.hit_tokens += len(dev) * S
            return len(dev) * S
        finally:
            self._locked.clear()  # only this call locks (splits above may have locked new heads)
            self.allocator.decref(path_pages)

    # -- tiered eviction (host tier on) ----------------------------------------------------------
    def _evict_tiered(self, num_pages: int, store: bool) -> list[int]:
        """``evict`` with a host tier: LRU device leaves lose their evictable tail, which goes to the host
        (``store``) unless it is there already; returns the freed device pages in eviction order."""
        S = self.page_size
        leaves = [(n.last_access, n.seq, n) for n in walk(self._root) if n.pages and not device_children(n)]
        heapq.heapify(leaves)
        freed: list[int] = []
        to_dev: list[int] = []
        to_host: list[int] = []
        stored: list[Node] = []  # nodes whose host pages this call's store writes: never host-evicted by it
        keep: set[int] = set()  # their seqs (a host page handed out twice in one store would be written twice)
        while leaves and len(freed) < num_pages:
            _, _, node = heapq.heappop(leaves)
            k = 0
            while k < len(node.pages) and len(freed) + k < num_pages and \
                    self.allocator.refcount(node.pages[-1 - k]) == 1:
                k += 1
            if k == 0:
                continue
            if k < len(node.pages):
                self._split(node, len(node.pages) - k)  # node keeps the evictable tail
            pages, parent = node.pages, node.parent
            assert parent is not None
            if store and not node.host_pages:
                hp = self._host_room(len(pages), keep)
                if hp is not None:
                    node.host_pages = hp
                    to_dev += pages
                    to_host += hp
                    stored.append(node)
                    keep.add(node.seq)
            node.pages = []
            if not node.host_pages:  # nowhere to keep it: drop it with its host-only subtree
                self._remove_subtree(node)
            freed.extend(reversed(pages))
            if parent is not self._root and parent.pages and not device_children(parent):
                heapq.heappush(leaves, (parent.last_access, parent.seq, parent))
        if to_dev:
            assert self.host is not None
            try:
                self.host.store(to_dev, to_host)  # issued before any freed page can be reallocated and rewritten
            except Exception as e:  # noqa: BLE001 - the pages are dropped as without a tier; nothing may leak
                log.warning("host tier: storing %d pages failed, dropping them: %s: %s", len(to_dev),
                            type(e).__name__, e)
                for node in stored:  # their host pages were never (fully) written: never read them
                    if node.parent is not None and not node.pages:
                        self._remove_subtree(node)
        self._cached.difference_update(freed)
        self.allocator.decref(freed)
        self.num_evictions += len(freed)
        self.num_evicted_tokens += len(freed) * S
        return freed

    def _host_room(self, n: int, keep: AbstractSet[int] = frozenset()) -> list[int] | None:
        """MUTATES: ``n`` host pages for a store, evicting LRU host copies (not those of nodes in ``keep``) to
        make room; None if impossible."""
        host = self.host
        assert host is not None
        if n > host.num_pages:
            return None
        if host.num_free < n:
            cands = [(x.last_access, x.seq, x) for x in walk(self._root) if self._host_evictable(x, keep)]
            heapq.heapify(cands)
            while cands and host.num_free < n:
                _, _, x = heapq.heappop(cands)
                if not self._host_evictable(x, keep):
                    continue
                parent = x.parent
                self._drop_host_copy(x)
                if parent is not None and self._host_evictable(parent, keep):
                    heapq.heappush(cands, (parent.last_access, parent.seq, parent))
            if host.num_free < n:
                return None
        return host.allocate(n)

    def _host_evictable(self, x: Node, keep: AbstractSet[int] = frozenset()) -> bool:
        """A host copy may go when no load reads it, no store of the current eviction writes it (``keep``),
        and the node stays reachable: it is on the device too, or it is a host-only leaf."""
        return bool(x.host_pages) and x.seq not in self._locked and x.seq not in keep and \
            (bool(x.pages) or not x.children)

    def _drop_host_copy(self, x: Node) -> None:
        if x.pages:
            assert self.host is not None
            self.host.free(x.host_pages)
            x.host_pages = []
        else:
            self._remove_subtree(x)

    def _remove_subtree(self, top: Node) -> None:
        """Unlink ``top`` and free the host pages of its subtree; its nodes hold no device page (callers see
        to that: below a node that is off the device nothing is on it)."""
        for x in walk(top):
            assert not x.pages or x is top
            if x.host_pages:
                assert self.host is not None
                self.host.free(x.host_pages)
                x.host_pages = []
        parent = top.parent
        assert parent is not None
        if parent.children.get(top.key[:self.page_size]) is top:
            del parent.children[top.key[:self.page_size]]

    def _adopt(self, node: Node, page_ids: Sequence[int]) -> bool:
        """MUTATES: put a host-only node back on the device with a request's own pages for its tokens (the
        request computed them); False (nothing changed) when those pages are cached elsewhere."""
        pages = [int(p) for p in page_ids]
        if len(pages) != node_pages(node, self.page_size) or len(set(pages)) != len(pages) or \
                any(p in self._cached for p in pages):
            return False
        self.allocator.incref(pages)
        node.pages = pages
        self._cached.update(pages)
        return True

    # -- structural self-check (used by engine.integrity) ---------------------------------------
    def tree_problems(self) -> list[str]:
        """Descriptions of broken tree invariants (empty when the tree is sound)."""
        return tree_problems(self._root, self._cached, self.page_size)

    # -- helpers -------------------------------------------------------------------------------
    def _split(self, node: Node, n: int) -> Node:
        """Split ``node`` after its first ``n`` pages; return the new parent holding those pages."""
        S = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < node_pages(node, S)
        head = Node(node.key[:n * S], node.pages[:n], parent, next(self._seq))
        head.host_pages = node.host_pages[:n]
        head.last_access = node.last_access
        parent.children[head.key[:S]] = head
        if node.seq in self._locked:
            self._locked.add(head.seq)
        node.key = node.key[n * S:]
        node.pages = node.pages[n:]
        node.host_pages = node.host_pages[n:]
        node.parent = head
        head.children[node.key[:S]] = node
        return head
