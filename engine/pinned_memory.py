"""Page-locked host buffers of exactly the size asked for.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every allocation
up to a power of two before it pins it: a 40 GB host tier would pin 64 GB of the machine's memory. A buffer that
lives as long as its owner needs no caching, so ``page_locked`` allocates plain host memory and page-locks
exactly that with ``cudaHostRegister``; the owner calls ``release`` before it drops the tensor (freeing
registered memory would leave its pages locked). Where registering fails it falls back to the caching allocator
and logs why.

``Tensor.is_pinned()`` reads False for registered memory (PyTorch asks its own host allocator), yet copies from
and to it are asynchronous DMA like those of the allocator's blocks: the CUDA return code is what says it is
locked (a second registration of the range fails as already registered; the GPU test checks that).
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)
_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped: kernels may read and write it
_PAGE = 4096


def _code(err: object) -> int:
    return int(getattr(err, "value", err))


def page_locked(shape: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
    """(a uint8 host tensor of ``shape`` page-locked for asynchronous GPU copies, whether it is registered and
    so needs ``release``). The tensor starts on a page boundary and its registered range is whole pages inside
    its allocation (a view of a slightly larger buffer, which it keeps alive)."""
    nbytes = math.prod(shape)
    if nbytes == 0:
        return torch.empty(shape, dtype=torch.uint8), False
    locked = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(locked + _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE
    buf = raw[start:start + nbytes].view(shape)
    cudart = torch.cuda.cudart()
    code = _code(cudart.cudaHostRegister(buf.data_ptr(), locked, _REGISTER_FLAGS))
    if code == 0:
        return buf, True
    log.warning("cudaHostRegister of %d bytes failed (error %d); pinning through PyTorch's caching allocator, "
                "which rounds the size up to a power of two", nbytes, code)
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True), False


def release(buf: torch.Tensor) -> None:
    """Unregister a buffer ``page_locked`` registered (call once, before the last reference goes)."""
    code = _code(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
    if code != 0:
        log.warning("cudaHostUnregister failed (error %d)", code)
