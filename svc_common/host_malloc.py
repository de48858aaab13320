"""Large host buffers without page faults: the transfer path allocates a fresh ~1 MiB ``bytes`` per page
message (gRPC hands each received message over as one, and each sent one is built as one). glibc serves
blocks that large with ``mmap`` and unmaps them on free, so every message pays a page fault per 4 KiB
touched: measured on the H200 host, a 1 MiB ``bytes`` copy runs at 2.7-3.3 GB/s, and at 7.5-9.1 GB/s with
the setting below (``python -m benchmarks.transfer.profile_copy``, docs/benchmarks/transfer_profile.json).

``keep_freed_blocks`` tells glibc to serve blocks up to ``max_block`` bytes from its heaps and to keep freed
heap memory mapped, so a message buffer reuses the pages of the one freed before it. Process-wide, so
only service processes call it; a no-op (returning False) off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MAX_BLOCK = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
KEEP_FREED = 1 << 30  # free heap memory above this much is returned to the OS


def keep_freed_blocks(max_block: int = MAX_BLOCK, keep: int = KEEP_FREED) -> bool:
    """Serve blocks up to ``max_block`` bytes from the heap and keep up to ``keep`` bytes of freed heap
    memory mapped. True when glibc accepted both settings."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, max_block) == 1 and mallopt(_M_TRIM_THRESHOLD, keep) == 1
    if not ok:
        log.debug("mallopt refused the heap settings; large buffers stay mmap-backed")
    return ok
