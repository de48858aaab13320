"""Which decoder ops a device runs: the fused Triton kernels (nvfp4_kernels/fused_ops.py) for CUDA tensors unless
``fused`` is off, else the PyTorch reference (nvfp4_kernels/model_ops.py). Above both, so neither imports the other's
chooser; triton is imported only where it runs."""

from __future__ import annotations

import torch

from nvfp4_kernels.model_ops import REFERENCE_OPS, ModelOps


def model_ops(device: torch.device | str, fused: bool = True) -> ModelOps:
    """The fused Triton ops for tensors on CUDA when ``fused``, else the PyTorch reference."""
    if fused and torch.device(device).type == "cuda":
        from nvfp4_kernels.fused_ops import TRITON_OPS

        return TRITON_OPS
    return REFERENCE_OPS
