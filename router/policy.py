"""Routing policies: cache-aware choice of decode worker, least-outstanding-tokens choice of prefill worker.

Decode (per request, over the healthy candidates):
  1. best = the worker whose prefix tree matches the longest prefix of the prompt (ties: lower load,
     then listed order).
  2. If best's match / prompt length >= cache_threshold, send it there, unless the load is imbalanced:
     best.load - min_load > balance_abs_threshold AND best.load > balance_rel_threshold * min_load;
     then (or when no worker matches enough) send it to the least-loaded worker (ties: the smaller prefix
     tree, i.e. the one with more room in its cache, then listed order).
Prefill: the worker with the fewest outstanding prompt tokens (ties: the one routed to least, then order).

The policy is pure bookkeeping: no I/O, no clocks, so every choice is reproducible in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from router.prefix_tree import PrefixTree


@dataclass(frozen=True)
class PolicyConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    tree_max_tokens: int = 1 << 21

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.tree_max_tokens < 1:
            raise ValueError(f"--tree-max-tokens must be >= 1, got {self.tree_max_tokens}")


class DecodeCandidate(NamedTuple):
    address: str
    load: int  # requests running or waiting there


class DecodeChoice(NamedTuple):
    address: str
    match_len: int  # prompt tokens the router believes that worker holds
    reason: str  # "cache_hit" | "balance" | "least_loaded"


class PrefillCandidate(NamedTuple):
    address: str
    outstanding_tokens: int
    num_routed: int  # requests sent there so far (round-robins ties)


class CacheAwarePolicy:
    """Decode choice over one PrefixTree per decode worker (created on first use)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._trees: dict[str, PrefixTree] = {}

    def tree(self, address: str) -> PrefixTree:
        tree = self._trees.get(address)
        if tree is None:
            tree = self._trees[address] = PrefixTree(self.config.tree_max_tokens)
        return tree

    def choose_decode(self, tokens: Sequence[int], candidates: Sequence[DecodeCandidate]) -> DecodeChoice:
        """Pick a decode worker for ``tokens``. Does not mutate: call ``record`` with the chosen one."""
        if not candidates:
            raise ValueError("choose_decode needs at least one candidate")
        tokens = tuple(tokens)
        matches = [self._trees[c.address].match_len(tokens) if c.address in self._trees else 0
                   for c in candidates]
        order = range(len(candidates))
        best = max(order, key=lambda i: (matches[i], -candidates[i].load, -i))
        least = min(order, key=lambda i: (candidates[i].load, self._tree_size(candidates[i].address), i))
        cfg = self.config
        if tokens and matches[best] > 0 and matches[best] / len(tokens) >= cfg.cache_threshold:
            load, min_load = candidates[best].load, candidates[least].load
            if load - min_load > cfg.balance_abs_threshold and load > cfg.balance_rel_threshold * min_load:
                return DecodeChoice(candidates[least].address, matches[least], "balance")
            return DecodeChoice(candidates[best].address, matches[best], "cache_hit")
        return DecodeChoice(candidates[least].address, matches[least], "least_loaded")

    def record(self, address: str, tokens: Sequence[int]) -> None:
        """Remember that ``address`` now holds (or soon will hold) ``tokens`` in its cache."""
        self.tree(address).insert(tokens)

    def set_tree_budget(self, address: str, max_tokens: int) -> None:
        """Bound ``address``'s tree (e.g. by the worker's pool capacity): min(config, max_tokens)."""
        self.tree(address).set_max_tokens(max(1, min(self.config.tree_max_tokens, max_tokens)))

    def forget(self, address: str) -> None:
        """The worker's cache is empty (flushed or restarted)."""
        if address in self._trees:
            self._trees[address].clear()

    def tree_sizes(self) -> dict[str, int]:
        return {addr: tree.num_tokens for addr, tree in self._trees.items()}

    def _tree_size(self, address: str) -> int:
        tree = self._trees.get(address)
        return tree.num_tokens if tree is not None else 0


def choose_prefill(candidates: Sequence[PrefillCandidate]) -> str:
    """The prefill worker with the fewest outstanding tokens (ties: least routed to, then listed order)."""
    if not candidates:
        raise ValueError("choose_prefill needs at least one candidate")
    order = range(len(candidates))
    i = min(order, key=lambda i: (candidates[i].outstanding_tokens, candidates[i].num_routed, i))
    return candidates[i].address
