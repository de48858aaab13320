"""One nixl transfer's reads into this decode's pool: per batch of page reads (a run of pages of a chunk, every
layer: one KVPageRefs message names them all, or one per layer back to back), one NIXL READ of the runs of
consecutive pages of every part of each layer, waited for on the writer thread. The written rows are checked as
``PageImporter.copy_from`` checks its copies (NaN/inf scales and values), all of a transfer's at once by
``finish``, which raises (``PageImporter.check_at_finish``): a check launch per batch cost the writer thread
0.8-1.4 ms of host time per ready 32K prompt on the H200, beside 1.2-1.9 ms of READs.

One READ per batch, not one per layer nor several smaller ones: every NIXL call releases the GIL and must win
it back, which costs up to the switch interval while the service's other threads run Python. The probe
(docs/benchmarks/nixl_probe.json, a fragmented pool's 128 descriptors with a busy Python thread beside) moved
125 GB/s as one READ and 56 GB/s as READs of 32; idle, both ran at 320-330 GB/s. The descriptors of a batch are
built in numpy over its layers at once, for the same reason.

Invariant: ``read`` returns (or raises) only once NIXL no longer writes the destination pages (its handle is
released), so once every posted read returned the pull may free or hand over the pages. ``stop`` makes reads
still waiting give up (their handles are cancelled and released) when the transfer failed or was cancelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from decode_svc.page_refs import MAX_BATCH, PageRead, runs_of
from svc_common.kv_transfer_nixl import NixlAgent, NixlTransferError, NixlView, read_descs
from svc_common.page_import import PageImporter


class NixlReads:
    def __init__(self, agent: NixlAgent, view: NixlView, importer: PageImporter, timeout_s: float):
        self.agent = agent
        self.num_reads = 0  # READs issued, and their descriptors (one per part and run of consecutive pages)
        self.num_descriptors = 0
        self.read_s = 0.0  # time in READs (posted to DONE)
        self.num_rounds = 0  # rounds of state checks the READs took (each progresses UCX)
        self._count = threading.Lock()  # batches of one transfer may read on two writer threads at once
        self.view = view
        self.importer = importer
        self.timeout_s = timeout_s  # a READ not DONE by then fails the transfer (the between-pages timeout)
        self._stop = threading.Event()

    def read(self, batch: Sequence[PageRead]) -> None:
        """MUTATES the pool: every read of ``batch`` (at most ``MAX_BATCH``) in one NIXL READ, its rows left to
        the importer's ``finish`` to check. Blocks (call on a writer thread); ValueError when the read fails (the caller fails the
        transfer)."""
        if not 0 < len(batch) <= MAX_BATCH:
            raise ValueError(f"a NIXL read batch holds 1..{MAX_BATCH} page reads, got {len(batch)}")
        groups = runs_of(batch)  # every layer of a run names the same pages and prompt slots
        descs = [read_descs(self.importer.pool, self.view, [r.layer for r in g], g[0].src_ids, g[0].dst_ids,
                            self.agent.device_id) for g in groups]
        local, remote = (np.concatenate([d[i] for d in descs]) for i in (0, 1))
        with self._count:
            self.num_reads += 1
            self.num_descriptors += len(local)
        t0 = time.perf_counter()
        try:
            rounds = self.agent.read(self.view.remote, local, remote, self.view.mem_type, self.timeout_s,
                                     self._stop)
        except NixlTransferError as e:
            raise ValueError(str(e)) from None
        t1 = time.perf_counter()
        for g in groups:
            self.importer.check_at_finish([r.layer for r in g], g[0].dst_ids, g[0].num_tokens)
        with self._count:
            self.read_s += t1 - t0
            self.num_rounds += rounds

    def summary(self) -> str:
        """For the transfer's log line: READs, descriptors and their time (the rows are checked by ``finish``)."""
        return (f" in {self.num_reads} READs of {self.num_descriptors} descriptors ({self.read_s * 1e3:.1f} ms "
                f"reading in {self.num_rounds} rounds of checks)")

    def stop(self) -> None:
        """Reads still waiting give up: their handles are released (NIXL cancels them) before they return."""
        self._stop.set()
