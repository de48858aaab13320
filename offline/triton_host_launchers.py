"""Triton's host-side launcher stubs built without a GPU, into TRITON_CACHE_DIR.

A Triton kernel's first load on a GPU builds, beside the kernel, a small C extension that launches it
(``__triton_launcher``, one per compiled variant; ``cuda_utils`` once per install): gcc against the host's
libcuda, about a second each. Their cache key is their C source and the platform (``triton.runtime.build``),
nothing of the GPU, so Triton's own classes (``CudaLauncher``, ``CudaUtils``) build the same entries here, given
gcc (or $CC), Python's headers and a ``libcuda.so.1`` to link against. The CUDA toolkit's stub library serves
(the GPU image's build points TRITON_LIBCUDA_PATH at a link to it); the stubs carry no path to it, so on the GPU
host they load its driver.

Nothing built here is called: the modules are loaded with lazy symbol binding, so a libcuda.so.1 without the
driver's functions (the toolkit's stub, or none of its symbols at all) serves as well.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def why_not() -> str | None:
    """None when the stubs can be built on this machine, else why not, in one line."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return "no C compiler (gcc, clang or $CC)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "no Python.h (install the Python development headers, e.g. python3-dev)"
    from triton.backends.nvidia.driver import libcuda_dirs

    try:
        dirs = libcuda_dirs()
    except (AssertionError, OSError, subprocess.CalledProcessError):
        dirs = []
    if not any((Path(d) / "libcuda.so.1").exists() for d in dirs):  # TRITON_LIBCUDA_PATH is taken unchecked
        return ("no libcuda.so.1 to link against (set TRITON_LIBCUDA_PATH to a directory holding one, e.g. a link "
                "to the CUDA toolkit's lib64/stubs/libcuda.so)")
    return None


@contextlib.contextmanager
def _lazy_binding() -> Iterator[None]:
    """Extension modules loaded in the block bind their symbols at first call, not at load."""
    before = sys.getdlopenflags()
    sys.setdlopenflags((before & ~os.RTLD_NOW) | os.RTLD_LAZY)
    try:
        yield
    finally:
        sys.setdlopenflags(before)


def build_utils() -> None:
    """Triton's ``cuda_utils`` module (the driver's helpers), into the cache."""
    from triton.backends.nvidia.driver import CudaUtils

    with _lazy_binding():
        CudaUtils()


def build_launcher(src: object, metadata: object) -> None:
    """The launcher stub of one compiled kernel variant (``src``, ``metadata`` as Triton passes them to its
    driver's ``launcher_cls``), into the cache."""
    from triton.backends.nvidia.driver import CudaLauncher

    with _lazy_binding():
        CudaLauncher(src, metadata)
