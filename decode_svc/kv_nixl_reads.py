"""One nixl transfer's reads into this decode's pool: per batch of KVPageRefs messages (a run of pages of a
chunk, every layer: the prefill sends them back to back), the runs of consecutive pages of every part of each
message's layer as NIXL READs of ``DESCS_PER_READ`` descriptors, all posted at once and waited for on the
writer thread, then the written rows checked as ``PageImporter.copy_from`` checks its copies (NaN/inf scales
and values; ``finish`` raises). A READ's set-up and completion cost about 0.6 ms whatever its size, so a
batch of a chunk's 8-36 layers costs a few of them, not one per layer; and one READ of 100+ descriptors ran
at a third of the speed of the same bytes in READs of 4 (docs/benchmarks/nixl_probe.json has the split's
measurements).

Invariant: ``read`` returns (or raises) only once NIXL no longer writes the destination pages (its handle is
released), so once every posted read returned the pull may free or hand over the pages. ``stop`` makes reads
still waiting give up (their handles are cancelled and released) when the transfer failed or was cancelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from decode_svc.page_refs import MAX_BATCH, PageRead
from svc_common.kv_copy import PageImporter
from svc_common.kv_transfer_nixl import NixlAgent, NixlTransferError, NixlView, read_descs, run_array

DESCS_PER_READ = 32  # descriptors (part x run of pages x layer) per NIXL READ of a batch


class NixlReads:
    def __init__(self, agent: NixlAgent, view: NixlView, importer: PageImporter, timeout_s: float):
        self.agent = agent
        self.num_reads = 0  # READs issued, and their descriptors (one per part and run of consecutive pages)
        self.num_descriptors = 0
        self.read_s = self.check_s = 0.0  # time in READs (posted to DONE) and in the checks of their rows
        self.num_rounds = 0  # rounds of state checks the READs took (each progresses UCX)
        self._count = threading.Lock()  # batches of one transfer may read on two writer threads at once
        self.view = view
        self.importer = importer
        self.timeout_s = timeout_s  # a READ not DONE by then fails the transfer (the between-pages timeout)
        self._stop = threading.Event()

    def read(self, batch: Sequence[PageRead]) -> None:
        """MUTATES the pool: every read of ``batch`` (at most ``MAX_BATCH``) in READs of ``DESCS_PER_READ``
        descriptors posted together, then each one's rows checked. Blocks (call on a writer thread); ValueError when the read fails (the caller fails the
        transfer)."""
        if not 0 < len(batch) <= MAX_BATCH:
            raise ValueError(f"a NIXL read batch holds 1..{MAX_BATCH} page reads, got {len(batch)}")
        runs: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}  # every layer names the same pages
        descs = []
        for r in batch:
            key = (tuple(r.src_ids), tuple(r.dst_ids))
            if key not in runs:
                runs[key] = run_array(r.src_ids, r.dst_ids)
            descs.append(read_descs(self.importer.pool, self.view, r.layer, r.src_ids, r.dst_ids,
                                    self.agent.device_id, runs[key]))
        local, remote = (np.concatenate([d[i] for d in descs]) for i in (0, 1))
        with self._count:
            self.num_reads += -(-len(local) // DESCS_PER_READ)
            self.num_descriptors += len(local)
        t0 = time.perf_counter()
        try:
            rounds = self.agent.read(self.view.remote, local, remote, self.view.mem_type, self.timeout_s,
                                     self._stop, descs_per_read=DESCS_PER_READ)
        except NixlTransferError as e:
            raise ValueError(str(e)) from None
        t1 = time.perf_counter()
        for r in batch:
            self.importer.check_written(r.layer, r.dst_ids, r.num_tokens)
        with self._count:
            self.read_s += t1 - t0
            self.check_s += time.perf_counter() - t1
            self.num_rounds += rounds

    def summary(self) -> str:
        """For the transfer's log line: READs, descriptors, their time and the checks'."""
        return (f" in {self.num_reads} READs of {self.num_descriptors} descriptors ({self.read_s * 1e3:.1f} ms "
                f"reading in {self.num_rounds} rounds of checks, {self.check_s * 1e3:.1f} ms checking rows)")

    def stop(self) -> None:
        """Reads still waiting give up: their handles are released (NIXL cancels them) before they return."""
        self._stop.set()
