"""The one error an engine raises for a start-up the user must change: a bad checkpoint, a context length the
model does not have, too little GPU memory. Entry points print its message as one line (no traceback)."""

from __future__ import annotations


class StartupError(ValueError):
    """The engine cannot start with this configuration on this machine; the message says which flag to change."""
