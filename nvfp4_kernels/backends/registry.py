"""Attention backends by name, imported lazily so that CPU installs never import triton/flashinfer."""

from __future__ import annotations

import importlib

import torch

from nvfp4_kernels.backends.base import AttentionBackend
from nvfp4_kernels.backends.decode_kernels import NVFP4_DECODE_KERNELS, DecodeKernel

_BACKENDS: dict[str, str] = {
    "reference": "nvfp4_kernels.backends.reference:ReferenceBackend",
    "reference-block-select": "nvfp4_kernels.backends.block_select:BlockSelectBackend",
    "triton": "nvfp4_kernels.backends.triton_backend:TritonBackend",
    "triton-block-select": "nvfp4_kernels.backends.triton_backend:TritonBlockSelectBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)



def get_backend(name: str = "auto", device: torch.device | str | None = None,
                nvfp4_decode_kernel: str = "auto") -> AttentionBackend:
    """Instantiate a backend; ``auto`` picks the GPU backend on CUDA and the reference on CPU.
    ``nvfp4_decode_kernel`` (``--nvfp4-decode-kernel``): the triton backends' NVFP4 decode kernel, auto = the
    GPU's default; another backend refuses anything but auto."""
    if nvfp4_decode_kernel not in NVFP4_DECODE_KERNELS:
        raise ValueError(f"--nvfp4-decode-kernel must be one of {NVFP4_DECODE_KERNELS}, got {nvfp4_decode_kernel!r}")
    if name == "auto":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        name = "triton" if dev.type == "cuda" and "triton" in _BACKENDS else "reference"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RuntimeError(f"attention backend {name!r} cannot be imported: {e}") from e
    cls = getattr(module, cls_name)
    if nvfp4_decode_kernel == "auto":
        return cls()
    if not name.startswith("triton"):
        raise ValueError(f"--nvfp4-decode-kernel {nvfp4_decode_kernel} picks a kernel of the triton backends; the "
                         f"{name!r} backend has one NVFP4 decode (use auto)")
    return cls(decode_kernel=DecodeKernel(nvfp4_decode_kernel))
