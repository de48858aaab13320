"""The radix prefix cache's tree (engine/radix_cache.py): its node type and the walks that only read it.

A node's ``key`` holds whole pages of token ids, ``pages`` its device page ids and ``host_pages`` its host page
ids (either may be empty, never both outside the root); children are keyed by the token ids of their first page.
Everything here reads the tree (and, for ``evictable``, page refcounts); what changes the tree lives in
``RadixCache``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Node:
    __slots__ = ("children", "host_pages", "key", "last_access", "pages", "parent", "seq")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, seq: int) -> None:
        self.key = key
        self.pages = pages  # device page ids ([] when the node is on the host only)
        self.host_pages: list[int] = []  # host page ids ([] when the node is not on the host)
        # Children are keyed by the token ids of their first page.
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.last_access = 0
        self.seq = seq  # creation order: breaks LRU ties deterministically


def walk(top: Node) -> list[Node]:
    """Nodes of the subtree at ``top`` in pre-order: parents before children. Every tree walk goes through here."""
    out: list[Node] = []
    stack = [top]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def num_pages(node: Node, page_size: int) -> int:
    """Pages of a node's tokens (on whichever tier holds them)."""
    return len(node.key) // page_size


def device_children(node: Node) -> bool:
    return any(c.pages for c in node.children.values())


def page_key(tokens: Sequence[int], pos: int, page_size: int) -> tuple[int, ...]:
    """The child key of the page of ``tokens`` that starts at ``pos``."""
    return tuple(tokens[pos:pos + page_size])


def num_matching_pages(node: Node, tokens: Sequence[int], pos: int, page_size: int, limit: int | None = None) -> int:
    """Whole pages of ``node`` equal to ``tokens[pos:]`` (capped at ``limit`` pages)."""
    S = page_size
    n_max = min(num_pages(node, S), (len(tokens) - pos) // S)
    if limit is not None:
        n_max = min(n_max, limit)
    n = 0
    while n < n_max and tuple(tokens[pos + n * S:pos + (n + 1) * S]) == node.key[n * S:(n + 1) * S]:
        n += 1
    return n


def evictable(top: Node, refcount: Callable[[int], int]) -> tuple[int, bool]:
    """(evictable pages in the subtree of ``top``, whether that whole subtree is evictable), in one walk. A page
    is evictable when only the cache holds it (``refcount`` 1) and so is every page after it in its node and in
    all of its descendants."""
    result: dict[int, tuple[int, bool]] = {}
    for node in reversed(walk(top)):  # children before their parent
        total = 0
        all_children = True
        for child in node.children.values():
            n, full = result.pop(id(child))
            total += n
            all_children &= full
        tail = 0
        if all_children:
            for p in reversed(node.pages):
                if refcount(p) != 1:
                    break
                tail += 1
        result[id(node)] = (total + tail, all_children and tail == len(node.pages))
    return result[id(top)]


def tree_problems(root: Node, cached: set[int], page_size: int) -> list[str]:
    """Descriptions of broken tree invariants (empty when the tree is sound); ``cached`` is the set of device
    pages the cache believes it holds."""
    problems: list[str] = []
    seen: dict[int, int] = {}
    count = 0
    for node in walk(root):
        if node is root:
            continue
        if not node.pages and not node.host_pages:
            problems.append(f"node {node.seq}: {len(node.key)} tokens for 0 pages on either tier")
        if node.pages and len(node.key) != len(node.pages) * page_size:
            problems.append(f"node {node.seq}: {len(node.key)} tokens for {len(node.pages)} pages")
        if node.host_pages and len(node.key) != len(node.host_pages) * page_size:
            problems.append(f"node {node.seq}: {len(node.key)} tokens for {len(node.host_pages)} host pages")
        if node.pages and node.parent is not None and node.parent is not root and not node.parent.pages:
            problems.append(f"node {node.seq}: on the device under a parent that is not")
        parent = node.parent
        if parent is None or parent.children.get(node.key[:page_size]) is not node:
            problems.append(f"node {node.seq}: not reachable from its parent under its first page")
        for p in node.pages:
            seen[p] = seen.get(p, 0) + 1
        count += len(node.pages)
    dup = sorted(p for p, c in seen.items() if c > 1)
    if dup:
        problems.append(f"pages cached in more than one place: {dup[:16]}")
    if count != len(cached) or set(seen) != cached:
        problems.append(
            f"the cache's page set ({len(cached)} pages) differs from the tree's {count} pages"
        )
    return problems
