"""One nixl transfer's reads into this decode's pool: per KVPageRefs message, one NIXL READ of the runs of
consecutive pages of every part of that layer, waited for on the writer thread, then the written rows checked
as ``PageImporter.copy_from`` checks its copies (NaN/inf scales and values; ``finish`` raises).

Invariant: ``read`` returns (or raises) only once NIXL no longer writes the destination pages (its handle is
released), so once every posted read returned the pull may free or hand over the pages. ``stop`` makes reads
still waiting give up (their handles are cancelled and released) when the transfer failed or was cancelled.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from svc_common.kv_copy import PageImporter
from svc_common.kv_transfer_nixl import NixlAgent, NixlTransferError, NixlView, read_descs


class NixlReads:
    def __init__(self, agent: NixlAgent, view: NixlView, importer: PageImporter, timeout_s: float):
        self.agent = agent
        self.view = view
        self.importer = importer
        self.timeout_s = timeout_s  # a READ not DONE by then fails the transfer (the between-pages timeout)
        self._stop = threading.Event()

    def read(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int], num_tokens: int) -> None:
        """MUTATES the pool: source pages ``src_ids`` of ``layer`` (checked against the view by the caller) into
        pages ``dst_ids``, of which the first ``num_tokens`` token slots hold the prompt. Blocks (call on a writer
        thread); ValueError when the read fails (the caller fails the transfer)."""
        local, remote = read_descs(self.importer.pool, self.view, layer, src_ids, dst_ids, self.agent.device_id)
        try:
            self.agent.read(self.view.remote, local, remote, self.view.mem_type, self.timeout_s, self._stop)
        except NixlTransferError as e:
            raise ValueError(str(e)) from None
        self.importer.check_written(layer, dst_ids, num_tokens)

    def stop(self) -> None:
        """Reads still waiting give up: their handles are released (NIXL cancels them) before they return."""
        self._stop.set()
