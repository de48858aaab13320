"""The decode step launched and not read back yet (the scheduler's overlap scheduling), and what it holds.

With overlap the scheduler launches decode step k before it reads step k-1's sampled ids, so the host's work
between two steps (reading the ids, stop checks, streaming, admission, staging the next inputs) runs while the
device computes instead of leaving it idle. Invariants the scheduler keeps while a step is in flight:

- every request of its batch had its ``kv_len`` advanced at launch (its K/V slot is written by the step), and
  its sampled token is not in its ``output_ids`` until the step is read;
- at most one step is in flight when the next one launches, so a request has at most one token pending there;
- a request that ends (finishes, aborts) while a step it is in is in flight gives its pages back only once
  that step is read (``InFlightDecode.releases``): the device still writes its slot, and no page may be reused,
  cached for others or evicted to the host tier while a queued step writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.batch_sampler import SampledTokens
from engine.carried_tokens import CarriedTokens
from engine.fence import Fence
from engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class InFlightDecode:
    batch: list[Request]  # the step's rows, in order (holding them keeps their ids unique)
    sampled: SampledTokens | None  # None only while a late-sampled step's forward runs (set before it is read)
    launched: Fence  # completes once the step's forward (every slot write) is done
    releases: list[Request] = field(default_factory=list)  # ended meanwhile: pages given back once read

    def __post_init__(self) -> None:
        self._rows = {id(r): i for i, r in enumerate(self.batch)}

    def row_of(self, req: Request) -> int:
        """``req``'s row in this step, or -1."""
        return self._rows.get(id(req), -1)


class DecodeFlights:
    """The scheduler's decode step in flight (``step``, or None) and the pages it keeps from going back.
    ``release`` gives a request's pages back (``RequestPages.release``)."""

    def __init__(self, release: Callable[[Request], None]) -> None:
        self.step: InFlightDecode | None = None
        self._release = release

    def pending(self, req: Request) -> int:
        """Tokens of ``req`` sampled by the step in flight (not in its ``output_ids`` yet): 0 or 1."""
        return int(self.step is not None and self.step.row_of(req) >= 0)

    def carry(self, batch: list[Request]) -> CarriedTokens | None:
        """The next step's input ids that are the step in flight's sampled ids (None: all on the host)."""
        if self.step is None:
            return None
        return CarriedTokens(self.step.sampled.ids, [self.step.row_of(r) for r in batch])

    def launched(self, batch: list[Request], sampled: SampledTokens | None, fence: Fence) -> InFlightDecode | None:
        """A step was launched: it is the one in flight now; returns the one before it (to read next), if any.
        ``sampled`` None: its forward only, sampled once the one before it is read (set ``step.sampled`` then)."""
        prev, self.step = self.step, InFlightDecode(batch, sampled, fence)
        return prev

    def pop(self) -> InFlightDecode | None:
        """The step in flight, which the caller reads now; none is in flight after."""
        step, self.step = self.step, None
        return step

    def give_back(self, req: Request) -> None:
        """``req`` ended: its pages go back now, or once the step in flight that writes its slot is read."""
        if self.step is not None and self.step.row_of(req) >= 0:
            self.step.releases.append(req)
        else:
            self._release(req)

    def read_done(self, step: InFlightDecode) -> None:
        """``step`` was read: the pages of the requests that ended while it was in flight go back."""
        for req in step.releases:
            self._release(req)
        step.releases.clear()

    def settle(self) -> None:
        """When no row of the step in flight still runs (every request of it ended): wait for it and give their
        pages back now; nothing of it is left to read."""
        if self.step is not None and all(r.is_finished for r in self.step.batch):
            self.abandon()

    def abandon(self) -> None:
        """After a failed step: forget the step in flight (waiting for its forward where the device still answers)
        and give back the pages it held for ended requests; its tokens are dropped."""
        step = self.pop()
        if step is None:
            return
        try:
            step.launched.wait()
        except Exception:  # a device fault: the pages go back all the same
            log.exception("the decode step in flight failed")
        self.read_done(step)

    def ending(self) -> list[Request]:
        """Requests that ended while the step in flight writes their slot: they still hold their pages."""
        return list(self.step.releases) if self.step is not None else []
