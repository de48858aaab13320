"""A port for a service that starts later (a launcher's child) to listen on.

Invariant: the port is drawn below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), where
bind(("", 0)) and outgoing connections take theirs. Between this call and the child's bind the port is free, and
nothing on the machine that asks the kernel for a port (another service binding port 0, a client connecting) can
be handed it in that window; only another caller of this function could draw it, one chance in thousands."""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 16384  # ports drawn from [ephemeral low - _SPAN, ephemeral low), never below 1024
_TRIES = 64


def ephemeral_low(path: str = _RANGE_FILE) -> int | None:
    """The first port of the kernel's ephemeral range, or None where the machine does not say (not Linux)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1", low: int | None = None) -> int:
    """A port nothing listens on now (checked by binding it), drawn below the ephemeral range ``low`` (default:
    the kernel's); where no such port is free, or the range is unknown, the kernel's own pick (bind to 0)."""
    low = ephemeral_low() if low is None else low
    if low is not None and low > 1024:
        draw = random.SystemRandom()
        for _ in range(_TRIES):
            port = draw.randrange(max(1024, low - _SPAN), low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
