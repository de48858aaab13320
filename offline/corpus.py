"""The Python standard library's sources as a text corpus, with a fixed train / held-out split.

The corpus is present on every machine with a Python install, so the default model can be
retrained anywhere and evaluated on text it never saw:

    held_out    about 1 in 32 files (bucket 0 of a hash of the relative path, ``json/decoder.py``):
                never trained on, never used for model selection; the evaluation reads these
    validation  another 1 in 32 (bucket 1): the training script's validation loss and model selection
    train       everything else

A file's split depends only on its relative path, never on the Python version or on which other
files exist: a file held out on 3.11 is held out on 3.12 too. Calibration text comes from the
train split (the distribution the model serves). Selection skips third-party packages, codec tables
and data dumps that are not Python source, and files that are not UTF-8.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation", "held_out")
_BUCKET = {"held_out": 0, "validation": 1}
HELD_OUT_SALT = "nvfp4-serve/held-out/v1"
HELD_OUT_ONE_IN = 32
# Top-level directories that are not Python written by people (tables, generated data, vendored code).
_SKIP_TOP = frozenset(
    {
        "site-packages",
        "dist-packages",
        "encodings",
        "pydoc_data",
        "__pycache__",
        "config-3.11-x86_64-linux-gnu",
        "lib-dynload",
    }
)
_MAX_FILE_BYTES = 400_000  # a few generated giants (e.g. test data tables) would dominate the corpus
DOC_SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # posix path relative to the stdlib root
    path: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """The split of ``rel_path`` (posix, relative to the stdlib root)."""
    digest = hashlib.sha256(f"{HELD_OUT_SALT}:{rel_path}".encode()).digest()
    bucket = int.from_bytes(digest[:4], "little") % HELD_OUT_ONE_IN
    return (
        "held_out"
        if bucket == _BUCKET["held_out"]
        else "validation"
        if bucket == _BUCKET["validation"]
        else "train"
    )


def stdlib_files(split: str, root: Path | None = None) -> list[SourceFile]:
    """The sorted source files of one split (one of ``SPLITS``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no Python standard library at {root}")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        top = rel.split("/", 1)[0]
        if top in _SKIP_TOP or top.startswith("config-") or "/__pycache__/" in rel:
            continue
        if not path.is_file() or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        if split_of(rel) == split:
            out.append(SourceFile(rel, path))
    return out


def read_texts(files: list[SourceFile]) -> Iterator[tuple[str, str]]:
    """(rel_path, text) of each file that decodes as UTF-8, NUL-free; others are skipped."""
    for f in files:
        try:
            text = f.path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "\x00" in text or DOC_SEPARATOR in text or not text.strip():
            continue
        yield f.rel_path, text


def split_text(split: str, max_chars: int | None = None, root: Path | None = None) -> str:
    """The files of ``split`` joined by ``<|endoftext|>``, cut after ``max_chars`` characters if given."""
    parts: list[str] = []
    size = 0
    for _, text in read_texts(stdlib_files(split, root)):
        parts.append(text)
        size += len(text) + len(DOC_SEPARATOR)
        if max_chars is not None and size >= max_chars:
            break
    joined = DOC_SEPARATOR.join(parts)
    return joined if max_chars is None else joined[:max_chars]
