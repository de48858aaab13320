"""A by-reference transfer's page refs (cuda-ipc, nixl), batched: a prefill names each run of pages it completed
for every layer in one KVPageRefs message (``layers_of``; older prefills sent one message per layer, back to
back), so the decode copies a run of pages of every layer in one writer-thread task (cuda-ipc: one launch per
kind of part for all the layers of a run of pages; nixl: one READ of all of them) instead of one task, one
thread hand-off and one lock hand-off per layer.

Invariant: a ``PageRead``'s ids were checked by the receiver (sources against the prefill's pool, destinations
the request's own pages) before it is batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from svc_common.kv_transfer_ipc import PoolView
from svc_common.page_import import PageImporter
from svc_common.pool_parts import PARTS

MAX_BATCH = 64  # page refs messages one task carries at most (nixl: a READ's descriptors, parts x runs x messages)


@dataclass(frozen=True)
class PageRead:
    """One KVPageRefs message's pages: source pages ``src_ids`` of ``layer`` into pages ``dst_ids``, of which
    the first ``num_tokens`` token slots hold the prompt."""

    layer: int
    src_ids: Sequence[int]
    dst_ids: Sequence[int]
    num_tokens: int


def layers_of(layer: int, num_layers: int, layout_layers: int) -> range:
    """The layers a KVPageRefs message names: ``num_layers`` of them from ``layer`` (0: ``layer`` alone).
    ValueError unless they lie within the layout's ``layout_layers``."""
    n = 1 if num_layers == 0 else num_layers
    if layer < 0 or n < 0 or layer + n > layout_layers:
        raise ValueError(f"page refs of layers [{layer}, +{num_layers}) outside the layout's {layout_layers}")
    return range(layer, layer + n)


def batches_of(reads: Sequence[PageRead]) -> list[tuple[PageRead, ...]]:
    """``reads`` in order, cut into writer tasks of at most ``MAX_BATCH``."""
    return [tuple(reads[i:i + MAX_BATCH]) for i in range(0, len(reads), MAX_BATCH)]


def runs_of(batch: Sequence[PageRead]) -> list[list[PageRead]]:
    """``batch`` grouped by the pages they name (every layer of a run names the same ones), in order."""
    groups: dict[tuple, list[PageRead]] = {}
    for r in batch:
        groups.setdefault((tuple(r.src_ids), tuple(r.dst_ids), r.num_tokens), []).append(r)
    return list(groups.values())


def copy_batch(importer: PageImporter, view: PoolView, batch: Sequence[PageRead]) -> None:
    """MUTATES the pool: cuda-ipc's copies of ``batch`` out of the prefill's pool ``view``, values checked as
    they are copied (``PageImporter.copy_from_layers``: on a GPU one launch per kind of part for all the layers
    of a run of pages). Blocks (call on a writer thread)."""
    for g in runs_of(batch):
        src = [[view.layers[r.layer].get(name) for name in PARTS] for r in g]
        importer.copy_from_layers(src, [r.layer for r in g], g[0].src_ids, g[0].dst_ids, g[0].num_tokens)
