"""Token ids of a trace's shared prefix and of every turn's new segment.

A count becomes random ids drawn from the model's regular tokens (``benchmarks.serving.dataset``): the shared
prefix from the stream ``[seed, 0]``, the segment of (session, turn) from ``[seed, 2, crc32(session id),
turn]``, so a session's ids do not depend on which other sessions the trace holds. A text becomes the
tokenizer's ids of it (no special tokens added). Prompts are only ever extended, never re-tokenized: the
replayer sends ``previous prompt + previous output ids + new ids``, which a prefix cache matches exactly.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.agentic.trace import Trace, Turn


class PromptBuilder:
    """``shared`` (the ids every session starts with) and ``new_ids(turn)``."""

    def __init__(self, trace: Trace, candidates: np.ndarray, tokenizer_dir: str = "") -> None:
        if candidates.size == 0:
            raise ValueError("no candidate token ids to draw prompts from")
        self._candidates = candidates.astype(np.int64)
        self._seed = trace.seed
        self._tokenizer_dir = tokenizer_dir
        self._tokenizer: Any = None
        if trace.shared_prefix_text is not None:
            self.shared = self._encode(trace.shared_prefix_text)
        else:
            self.shared = self._draw([trace.seed, 0], trace.shared_prefix_tokens)

    def new_ids(self, turn: Turn) -> list[int]:
        """The ids ``turn`` appends after the previous answer."""
        if turn.text is not None:
            ids = self._encode(turn.text)
            if not ids:
                raise ValueError(f"session {turn.session_id!r} turn {turn.turn}: its text has no tokens")
            return ids
        assert turn.new_tokens is not None
        key = zlib.crc32(turn.session_id.encode())
        return self._draw([self._seed, 2, key, turn.turn], turn.new_tokens)

    def _draw(self, stream: list[int], n: int) -> list[int]:
        picks = np.random.default_rng(stream).integers(0, self._candidates.size, size=n)
        return self._candidates[picks].tolist()

    def _encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            path = Path(self._tokenizer_dir) / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"the trace gives text, which needs the model's tokenizer: no "
                                        f"tokenizer.json in {self._tokenizer_dir!r} (pass --tokenizer DIR)")
            self._tokenizer = Tokenizer.from_file(str(path))
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
