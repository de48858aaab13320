"""Triton's runtime pointed at a GPU this machine does not have: kernels compile for it, nothing launches.

``compile_for(target)`` makes ``TargetDriver`` Triton's active driver for a block of code. Every
``kernel[grid](*args)`` launch in that block goes through Triton's own ``JITFunction.run``: the binder
specializes on the arguments as on the GPU (dtypes; 16-byte alignment of the data pointers, which CPU tensors
from torch's allocator have like CUDA ones; integers equal to 1 or divisible by 16), the cache key is
computed from the source, the target (``GPUTarget("cuda", capability, 32)``), the options and the compiler
installation, and the compiled kernel is written to TRITON_CACHE_DIR. Then the launch goes to this driver,
which loads nothing and runs nothing. None of the key depends on the device beyond the target: the same key,
hence the same cache entry, is what a process with that GPU computes.

    with compile_for(TritonTarget(capability=(9, 0))):
        nvfp4_quantize_kernel[(n,)](x_cpu, ...)   # compiles sm_90a into the cache, launches nothing
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from triton.backends.compiler import GPUTarget
from triton.runtime import driver

# Opt-in shared memory per block, bytes, by compute capability major (the kernels' limit on those GPUs).
_MAX_SHARED = {8: 166912, 9: 232448, 10: 232448, 12: 101376}


@dataclass(frozen=True)
class TritonTarget:
    """The GPU Triton compiles for: compute capability (major, minor), e.g. (9, 0) for sm_90a."""

    capability: tuple[int, int]

    @property
    def gpu_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability[0] * 10 + self.capability[1], 32)


def _no_launch(launches: Counter[str], stubs: list[str] | None) -> type:
    class NoLaunch:
        """A compiled kernel's launcher: counts the launch under the kernel's name, runs nothing. With
        ``stubs``, Triton's real host launcher of the variant is built into the cache first (and named there)."""

        def __init__(self, src: object, metadata: object) -> None:
            self.name = getattr(metadata, "name", "?")
            if stubs is not None:
                from offline.triton_host_launchers import build_launcher

                build_launcher(src, metadata)
                stubs.append(self.name)

        def __call__(self, *args: object) -> None:
            launches[self.name] += 1

    return NoLaunch


class _Utils:
    def __init__(self, target: TritonTarget) -> None:
        self._target = target

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": _MAX_SHARED.get(self._target.capability[0], 101376), "warpSize": 32,
                "max_num_regs": 65536}

    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[int, int, int, int, int]:
        return 0, 0, 0, 0, 1024  # module, function, registers, spills, max threads per block


class TargetDriver:
    """The parts of Triton's driver interface that compiling and launching use, for a GPU not present."""

    def __init__(self, target: TritonTarget, host_launchers: bool = False) -> None:
        self.target = target
        self.utils = _Utils(target)
        self.launches: Counter[str] = Counter()  # kernel name -> launches while active
        # kernel name per host launcher stub built (offline/triton_host_launchers.py); None: none are built
        self.stubs: list[str] | None = [] if host_launchers else None
        self.launcher_cls = _no_launch(self.launches, self.stubs)

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return self.target.gpu_target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def compile_for(target: TritonTarget, host_launchers: bool = False) -> Iterator[TargetDriver]:
    """Triton launches in the block compile for ``target`` and run nothing; the previous driver after it.
    ``host_launchers``: each compiled variant's host launcher stub (and Triton's driver helpers) are built into
    the cache as well (``offline.triton_host_launchers.why_not()`` must be None). Use it in a process that has
    launched no Triton kernel: each kernel keeps the binder (and target) of its first launch per device index."""
    previous = driver._active  # None until a driver was first needed: keep it unset then
    if host_launchers:
        from offline.triton_host_launchers import build_utils

        build_utils()
    stub = TargetDriver(target, host_launchers)
    driver.set_active(stub)
    try:
        yield stub
    finally:
        driver._active = previous
