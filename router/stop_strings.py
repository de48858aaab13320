"""Stop strings over a stream of text deltas, matched across token (delta) boundaries.

The matcher emits text as soon as it cannot be the start of a stop string and holds back only the
longest tail that is a proper prefix of some stop string:

    emitted ........ | held back  ("Hello wor" with stop "world": "wor" is held)

Semantics: after each delta, the text so far is cut before the earliest occurrence of any stop string (the
delta that completes one ends generation: later text never comes).
Invariant: every occurrence of a stop string in the text so far starts inside the held-back tail or in
the new delta, so the text before the earliest occurrence is exactly what was emitted plus the cut, and
no character of a stop string is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    text: str  # safe to send now
    stopped: bool  # a stop string matched: ``text`` ends right before it; stop generating


class StopStringMatcher:
    """Feed deltas with ``push``; call ``flush`` when generation ends without a match."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that matched (the earliest; the longest at one place)

    @property
    def held_back(self) -> str:
        return self._held

    def push(self, delta: str) -> StopResult:
        """Add ``delta``; returns the text that became safe to send and whether a stop string matched."""
        if self._stopped:
            raise RuntimeError("StopStringMatcher.push after a stop string matched")
        if not self._stops:
            return StopResult(delta, False)
        text = self._held + delta
        hits = [(i, -len(s), s) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            cut, _, self.matched = min(hits)
            self._held = ""
            self._stopped = True
            return StopResult(text[:cut], True)
        keep = self._partial_tail_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return StopResult(text[:len(text) - keep], False)

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        out, self._held = self._held, ""
        return out

    def _partial_tail_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
