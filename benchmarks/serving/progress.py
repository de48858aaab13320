"""A progress bar on stderr: tqdm when installed, else a plain one; or none."""

from __future__ import annotations

import sys
import time
from typing import Protocol


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _PlainBar:
    """``desc [#####.....] 5/10 12.3s``, redrawn in place at most every 0.2 s and at the end."""

    WIDTH = 30

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self.start = self.last_draw = time.monotonic()
        self._draw()

    def _draw(self) -> None:
        filled = self.WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = time.monotonic() - self.start
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.done}/{self.total} {elapsed:.1f}s")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last_draw >= 0.2 or self.done >= self.total:
            self.last_draw = now
            self._draw()

    def close(self) -> None:
        self._draw()
        sys.stderr.write("\n")
        sys.stderr.flush()


def make_progress(total: int, desc: str, enabled: bool = True) -> Progress:
    """A bar counting ``total`` requests; tqdm if importable, a plain stderr bar otherwise."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainBar(total, desc)
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)
