"""A benchmark's document written as its JSON and its markdown (printed too)."""

from __future__ import annotations

import json
from collections.abc import Callable


def write_doc(doc: dict, json_path: str, md_path: str, render: Callable[[dict], str]) -> None:
    """``doc`` to ``json_path``, ``render(doc)`` to ``md_path`` and to stdout."""
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    md = render(doc)
    with open(md_path, "w") as f:
        f.write(md)
    print(md)
