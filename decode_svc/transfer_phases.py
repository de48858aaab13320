"""Where a completed transfer's time went, on the decode's clock: its span (transfer header -> every page in the
pool and checked, ``nvfp4_decode_kv_transfer_seconds``) cut at four instants into five phases that add up to it.

    header --first_page--> first page message --stream--> last page message --done--> PrefillDone
           --drain--> every pool write complete --finish--> the transfer's values checked

``first_page``: the prefill's first export (and, while it computes, its first chunk); ``stream``: the page messages
arriving while their writes run behind them; ``done``: the prefill's end of the stream; ``drain``: the writes still
running after it; ``finish``: the one check of every written page (``PageImporter.finish``). A bound on the
transport shows in ``stream``; a cost per transfer in the others. Page messages of every lane count (lanes run on
this service's one event loop, so the instants need no lock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TransferPhases:
    """Seconds of each phase of ``PHASES``; they add up to the transfer's span."""

    first_page: float
    stream: float
    done: float
    drain: float
    finish: float

    def items(self) -> list[tuple[str, float]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.items())

    def summary(self) -> str:
        """For the transfer's log line."""
        return ", ".join(f"{name.replace('_', ' ')} {v * 1e3:.1f} ms" for name, v in self.items())


PHASES = tuple(f.name for f in fields(TransferPhases))


@dataclass
class TransferClock:
    """The instants of one transfer (``time.perf_counter``), stamped as they happen."""

    header: float
    first_page: float | None = None  # None until a page message arrives
    last_page: float | None = None
    done: float | None = None
    drained: float | None = None

    def page(self) -> None:
        """A page message (bytes, or page references) arrived, on any lane."""
        now = time.perf_counter()
        if self.first_page is None:
            self.first_page = now
        self.last_page = now

    def got_done(self) -> None:
        """PrefillDone arrived."""
        self.done = time.perf_counter()

    def writes_drained(self) -> None:
        """Every pool write of the transfer is complete."""
        self.drained = time.perf_counter()

    def phases(self, end: float | None = None) -> TransferPhases:
        """The phases up to ``end`` (default now: the values checked). A transfer with no page message (a prompt
        wholly cached here) has its whole wait before PrefillDone in ``first_page``."""
        end = time.perf_counter() if end is None else end
        done = self.done if self.done is not None else end
        drained = self.drained if self.drained is not None else done
        first = self.first_page if self.first_page is not None else done
        last = self.last_page if self.last_page is not None else first
        return TransferPhases(first - self.header, last - first, done - last, drained - done, end - drained)
