"""``--host-cache-size``: the host tier's size, in bytes (``8GiB``, ``500MB``, ``1073741824``) or in tokens
(``200000tokens``, ``64Ktokens``); ``0`` turns the tier off (the default).

Bytes are the natural unit when comparing KV dtypes: the same bytes hold 16/9 as many NVFP4 tokens as FP8
tokens (the engine logs and reports the tier in tokens of its dtype). A size in tokens is rounded down to
whole pages, a size in bytes to the whole pages (all layers, K + V + block scales) it holds.
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6}
_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_HELP = "give bytes (e.g. 8GiB, 500MB, 1073741824) or tokens (e.g. 200000tokens, 64Ktokens), or 0 for no host tier"


class HostCacheSize(NamedTuple):
    """A parsed ``--host-cache-size``: at most one of the two is non-zero."""

    num_bytes: int = 0
    num_tokens: int = 0

    @property
    def enabled(self) -> bool:
        return self.num_bytes > 0 or self.num_tokens > 0

    def __str__(self) -> str:  # the flag's value again (the launcher passes it on to each service)
        return f"{self.num_tokens}tokens" if self.num_tokens else str(self.num_bytes)


def parse_host_cache_size(text: str) -> HostCacheSize:
    """``"8GiB"`` -> 8 * 2**30 bytes, ``"64Ktokens"`` -> 64,000 tokens; ValueError saying what to give."""
    m = _RE.fullmatch(str(text))
    if m is None:
        raise ValueError(f"--host-cache-size {text!r} is not a size: {_HELP}")
    number, unit = m.group(1), m.group(2).lower()
    for suffix in ("tokens", "token", "tok"):
        if unit.endswith(suffix):
            scale = _TOKEN_UNITS.get(unit[:-len(suffix)])
            if scale is None:
                break
            return HostCacheSize(num_tokens=_whole(float(number) * scale, text))
    else:
        scale = _UNITS.get(unit)
        if scale is not None:
            return HostCacheSize(num_bytes=_whole(float(number) * scale, text))
    raise ValueError(f"--host-cache-size {text!r}: unknown unit {m.group(2)!r}; {_HELP}")


def host_cache_size_arg(text: str) -> HostCacheSize:
    """argparse ``type=``: a bad value is one usage line (argparse prints the message)."""
    try:
        return parse_host_cache_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _whole(value: float, text: str) -> int:
    if value != int(value):
        raise ValueError(f"--host-cache-size {text!r} is not a whole number of bytes or tokens; {_HELP}")
    return int(value)
