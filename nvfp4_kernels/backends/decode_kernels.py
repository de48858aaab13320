"""The NVFP4 decode kernels a backend may launch, named without importing triton (the registry, the config
flags and start-up checks read these on CPU installs too), and the geometry each one takes."""

from __future__ import annotations

import enum


class DecodeKernel(enum.Enum):
    """Which NVFP4 decode kernel a config launches."""

    TRITON = "triton"  # nvfp4_kernels/triton/nvfp4_decode.py: any target, also the CPU interpreter
    GLUON = "gluon"  # nvfp4_kernels/triton/nvfp4_decode_gluon.py: explicit layouts, one warp, cp.async, CUDA sm_89+
    GLUON_TMA = "gluon-tma"  # nvfp4_kernels/triton/nvfp4_decode_tma.py: the Gluon kernel fed by TMA, CUDA sm_90+


# --nvfp4-decode-kernel: auto (the GPU's default) or a DecodeKernel
NVFP4_DECODE_KERNELS = ("auto", *(k.value for k in DecodeKernel))
GLUON_HEAD_DIMS = (64, 128, 256)  # the head dims the Gluon NVFP4 decodes have tilings for
_MIN_CAPABILITY = {DecodeKernel.GLUON: (8, 9), DecodeKernel.GLUON_TMA: (9, 0)}  # cvt.e4m3x2; TMA (cp.async.bulk)


def tma_fits(num_kv_heads: int, head_dim: int, page_size: int, block_w: int) -> bool:
    """Whether the TMA-fed kernel takes this pool and step: its scale view's rows (HK * D/16 bytes) are a whole
    number of 16-byte TMA box rows, a step is whole pages (one box per page and part), and each page's box lands
    128-byte aligned in shared memory (page j of a step at j * PAGE rows of 16 scale bytes; 4-token pages fault
    with a misaligned address). Pages of 16 and 32 tokens are the ones checked on a GPU: PAGE a multiple of 16."""
    return ((num_kv_heads * (head_dim // 16)) % 16 == 0 and block_w % page_size == 0 and page_size % 16 == 0
            and head_dim in GLUON_HEAD_DIMS)


def shape_unfit(kernel: DecodeKernel, head_dim: int, num_kv_heads: int | None = None,
                page_size: int | None = None, block_w: int = 32) -> str | None:
    """Why ``kernel`` cannot decode this model's pool whatever the GPU, or None: a head_dim it has tilings for and,
    where given, a pool geometry (``num_kv_heads``, ``page_size``) the TMA kernel's boxes fit. Needs no GPU."""
    if kernel is DecodeKernel.TRITON:
        return None
    if head_dim not in GLUON_HEAD_DIMS:
        return f"{kernel.value} has tilings for head_dim {GLUON_HEAD_DIMS}, the model has {head_dim}"
    if (kernel is DecodeKernel.GLUON_TMA and num_kv_heads is not None and page_size is not None
            and not tma_fits(num_kv_heads, head_dim, page_size, block_w)):
        return (f"{kernel.value} needs KV heads x head_dim / 16 a multiple of 16 bytes and {block_w}-token steps of "
                f"whole pages of a multiple of 16 tokens, got {num_kv_heads} KV heads, head_dim {head_dim}, page "
                f"{page_size}")
    return None


def kernel_unfit(kernel: DecodeKernel, head_dim: int, capability: tuple[int, int] | None,
                 num_kv_heads: int | None = None, page_size: int | None = None, block_w: int = 32) -> str | None:
    """Why ``kernel`` cannot decode this model on a GPU of ``capability`` (None: no GPU), or None where it can:
    ``shape_unfit``, then the GPU's compute capability."""
    if kernel is DecodeKernel.TRITON:
        return None
    why = shape_unfit(kernel, head_dim, num_kv_heads, page_size, block_w)
    need = _MIN_CAPABILITY[kernel]
    if why is None and (capability is None or tuple(capability) < need):
        have = "no GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        why = f"{kernel.value} needs a GPU of compute capability {need[0]}.{need[1]} or newer, got {have}"
    return why
