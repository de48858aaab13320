"""The reference backend with the block-select NVFP4 encoder (``--attention-backend reference-block-select``).

NVFP4 pool writes pick, per 16-value block, the E4M3 scale near amax/6 that reconstructs it best
(``nvfp4_kernels.nvfp4_block_select``); the bytes format and every reader stay the same, so decode, transfer
and the prefill/decode handshake are unchanged. Chosen because the evaluation (docs/benchmarks/accuracy.md)
shows a lower KL vs the bf16 cache than the default encoder on the shipped model. Pure PyTorch: on GPU
it runs the reference paths; ``--attention-backend triton-block-select`` serves the same encoder at speed
(``nvfp4_kernels/backends/triton_backend.py``, bit-identical).
"""

from __future__ import annotations

import torch

from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.kv_layout import LayerKV
from nvfp4_kernels.nvfp4_block_select import quantize_block_select


class BlockSelectBackend(ReferenceBackend):
    name = "reference-block-select"

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer.kv_dtype != "nvfp4":
            return super().write_kv(layer, slots, k, v)
        slots = slots.long()
        for x, data_t, sf_t, scale in (
            (k, layer.k, layer.k_sf, layer.k_scale),
            (v, layer.v, layer.v_sf, layer.v_scale),
        ):
            data, sf = quantize_block_select(x, scale)
            data_t.view(-1, *data_t.shape[2:])[slots] = data
            sf_t.view(torch.uint8).view(-1, *sf_t.shape[2:])[slots] = sf.view(torch.uint8)
        return None
