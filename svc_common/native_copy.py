"""Byte copies that keep the GIL: what an export issues many of while another thread of its process (gRPC's)
runs Python.

Every torch operator called from Python, tensor views and slices included, and every ``ctypes.memmove`` gives the
GIL up for its call and must win it back afterwards. While another thread runs Python, each takes up to a switch
interval (5 ms) to return: on a 2-core CPU with one busy Python thread, a tensor slice took ~0.4 ms and a
``ctypes.memmove`` of 32 bytes ~0.26 ms, against ~1.3 us for the same memmove holding the GIL. An export of NVFP4
pages issued about a hundred such calls (four parts a message), an FP8 export about sixty. The calls here hold the
GIL: they are short (queueing a copy, or a host copy the caller sized) and cost what their work costs.

- ``host_copy(dst, src, n)``: memmove between host addresses.
- ``DeviceToHost``: ``cuMemcpyDtoHAsync`` (driver API) of device bytes into pinned host memory, queued on a CUDA
  stream; the caller synchronizes the stream once for all of them.
"""

from __future__ import annotations

import ctypes
import threading

# ctypes' memmove as a Python-API function: its call keeps the GIL (ctypes.memmove's gives it up)
host_copy = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr)
# bytes of n bytes copied from an address, keeping the GIL (ctypes.string_at is such a function)
bytes_at = ctypes.string_at


class DeviceToHost:
    """Queues device-to-host copies through the CUDA driver, keeping the GIL (``ctypes.PyDLL``). The calling
    thread's current context must be the device's primary context (the one torch uses): ``bind`` makes it so."""

    _lock = threading.Lock()
    _lib: ctypes.PyDLL | None = None

    def __init__(self) -> None:
        self.lib = self._driver()

    @classmethod
    def _driver(cls) -> ctypes.PyDLL:
        with cls._lock:
            if cls._lib is None:
                lib = ctypes.PyDLL("libcuda.so.1")  # already loaded by torch's CUDA runtime: the same handle
                lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                                     ctypes.c_void_p]
                lib.cuMemcpyDtoHAsync_v2.restype = ctypes.c_int
                lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                lib.cuCtxGetCurrent.restype = ctypes.c_int
                lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                lib.cuGetErrorName.restype = ctypes.c_int
                cls._lib = lib
            return cls._lib

    def bind(self, device) -> None:
        """Make ``device``'s primary context this thread's current one, where no context is (torch sets it on a
        thread's first CUDA runtime call; a thread that made none has none)."""
        import torch

        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            torch.cuda.set_device(device)  # cudaSetDevice binds the device's primary context to this thread
            self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                raise RuntimeError(f"no CUDA context current on this thread for {device}")

    def copy(self, dst: int, src: int, n: int, stream: int) -> None:
        """Queue a copy of ``n`` bytes from device address ``src`` to pinned host address ``dst`` on ``stream``
        (a ``cudaStream_t``; torch's ``Stream.cuda_stream``)."""
        self._check(self.lib.cuMemcpyDtoHAsync_v2(dst, src, n, stream), "cuMemcpyDtoHAsync")

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else code}")
