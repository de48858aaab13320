"""The NVFP4 decode kernels a backend may launch, named without importing triton (the registry, the config
flags and start-up checks read these on CPU installs too)."""

from __future__ import annotations

import enum


class DecodeKernel(enum.Enum):
    """Which NVFP4 decode kernel a config launches."""

    TRITON = "triton"  # nvfp4_kernels/triton/nvfp4_decode.py: any target, also the CPU interpreter
    GLUON = "gluon"  # nvfp4_kernels/triton/nvfp4_decode_gluon.py: explicit layouts, one warp, CUDA sm_89+ only


NVFP4_DECODE_KERNELS = ("auto", "gluon", "triton")  # --nvfp4-decode-kernel: auto (the GPU's default) or a DecodeKernel
GLUON_HEAD_DIMS = (64, 128, 256)  # the head dims the Gluon NVFP4 decode has tilings for
