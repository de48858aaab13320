"""Approximate radix tree of the token prefixes the router sent to ONE decode worker.

It mirrors, approximately, what that worker's radix prefix cache holds, so the router can send a prompt
where its prefix is likely cached. Approximate because the worker evicts on its own schedule; the tree
evicts least-recently-used leaves once it holds more than ``max_tokens`` tokens.

    root ──(1 2 3)──> a ──(4 5)──> b          every node's key is its edge label (>= 1 token);
                       └──(9)────> c          children are keyed by the first token of their label

Invariants: a node's ``last_access`` >= each of its children's (an insert touches the whole path), so
evicting leaves in ``last_access`` order evicts least-recently-used prefixes first; ``num_tokens`` is the
sum of the label lengths of all nodes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

_CHUNK = 64  # tokens compared per slice while looking for the first mismatch


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two int sequences (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:
        i += _CHUNK
    end = min(i + _CHUNK, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


class _Node:
    __slots__ = ("children", "key", "last_access", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = last_access


class PrefixTree:
    """Token prefixes with LRU eviction beyond ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"PrefixTree max_tokens must be >= 1, got {max_tokens}")
        self._max_tokens = max_tokens
        self._clock = 0  # logical time: deterministic eviction order
        self._root = _Node((), None, 0)
        self._num_tokens = 0
        self._num_nodes = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    def set_max_tokens(self, max_tokens: int) -> None:
        """Change the budget; evicts at once when the tree is over the new one."""
        if max_tokens < 1:
            raise ValueError(f"PrefixTree max_tokens must be >= 1, got {max_tokens}")
        self._max_tokens = max_tokens
        self._evict()

    def match_len(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of ``tokens`` in the tree. Does not mutate (no LRU touch)."""
        tokens = tokens if isinstance(tokens, tuple) else tuple(tokens)  # tuple == list is always False
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int]) -> None:
        """Add ``tokens`` (truncated to ``max_tokens``), mark its whole path most recently used, then
        evict least-recently-used leaves until the tree fits its budget again. Mutates the tree."""
        tokens = tuple(tokens[:self._max_tokens])
        self._clock += 1
        now = self._clock
        node, pos = self._root, 0
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tokens[pos:], node, now)
                node.children[tokens[pos]] = leaf
                self._num_tokens += len(leaf.key)
                self._num_nodes += 1
                break
            n = _common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        self._evict()

    def clear(self) -> None:
        """Forget everything (the worker flushed its cache or restarted)."""
        self._root = _Node((), None, 0)
        self._num_tokens = 0
        self._num_nodes = 0

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s label after ``n`` tokens; returns the new upper node (label = first n tokens)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = _Node(child.key[:n], parent, child.last_access)
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        self._num_nodes += 1
        return upper

    def _evict(self) -> None:
        if self._num_tokens <= self._max_tokens:
            return
        heap: list[tuple[int, int, _Node]] = []  # (last_access, tie-breaker, leaf)
        seq = itertools.count()
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last_access, next(seq), node))
        heapq.heapify(heap)
        while self._num_tokens > self._max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._num_tokens -= len(leaf.key)
            self._num_nodes -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(seq), parent))
