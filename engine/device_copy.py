"""Host -> device copies that never make the host wait for the device.

A copy from pageable host memory (``tensor.to("cuda")``, ``torch.tensor(..., device="cuda")``, indexing a CUDA
tensor with a Python list) can synchronize with the stream: the host then waits for the work queued before it.
Under overlap scheduling that work is the decode step just launched, so such a copy in a step's launch path
would make the host wait for that step and leave the GPU idle during the host's work after it. ``to_device``
goes through pinned memory (PyTorch's caching host allocator, which keeps a block until its copy has run) with a
non-blocking copy; on the CPU it is the tensor itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a host tensor, or numbers made into one of ``dtype``) on ``device``, the host not waiting."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
