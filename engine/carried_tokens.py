"""``CarriedTokens``: a decode step's input ids that are still on the device.

With overlap scheduling a decode step is launched before the previous step's sampled ids reach the host. Its
input id for a request the previous step sampled is then that step's id, read on the device: row i of the new
step takes ``source[rows[i]]`` where ``rows[i] >= 0`` (``source``: the previous step's ids, one per row of
that step) and keeps the id staged from the host where ``rows[i] == -1``. Stream order makes the read see the
sampled id: the previous step's sampling was queued before this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.device_copy import to_device


@dataclass(frozen=True)
class CarriedTokens:
    source: torch.Tensor  # [B_prev] int64 on the device: the previous decode step's sampled ids
    rows: Sequence[int]  # per row of this step: its row in ``source``, or -1 (the host's id stands)

    def __post_init__(self) -> None:
        n = self.source.shape[0]
        if any(not -1 <= r < n for r in self.rows):
            raise ValueError(f"carried rows must be -1 or name one of the {n} rows of the previous step, "
                             f"got {list(self.rows)}")

    def pending(self) -> torch.Tensor:
        """int64 [B] on the device: row i's carried id, or -1 where the host's id stands."""
        rows = to_device(list(self.rows), self.source.device, torch.int64)
        return torch.where(rows >= 0, self.source.index_select(0, rows.clamp(min=0)), -1)

    def fill(self, ids: torch.Tensor, rows_on_device: torch.Tensor) -> None:
        """``ids[i] = source[rows[i]]`` where ``rows[i] >= 0``, on the device (``rows_on_device``: ``rows`` as an
        int64 tensor on it, the caller's staging); nothing waits on the host."""
        picked = self.source.index_select(0, rows_on_device.clamp(min=0))
        ids.copy_(torch.where(rows_on_device >= 0, picked, ids))
