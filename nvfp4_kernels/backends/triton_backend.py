"""The GPU attention backend: Triton kernels for the NVFP4 pool, FlashInfer for prefill and FP8/BF16 decode.

``TritonBackend`` is a ``ComposedBackend`` (nvfp4_kernels/backends/composition.py); ``triton_composition`` builds
its parts once, and ``TritonBackend().parts.table()`` lists them:

    phase             nvfp4 pool                          fp8_e4m3 / bf16 pool (and any other dtype)
    write_kv          TritonNvfp4Write (quantize kernel)  TritonDenseWrite (K and V in one launch)
    gather_workspace  TritonNvfp4Gather (-> FP8 rows)     ReferenceBackend
    prefill           FlashInferRaggedPrefill: FlashInfer ragged FA2 on bf16 / fp8 workspace K,V when the
                      tensors are on CUDA and flashinfer imports, else ReferenceBackend
    plan_decode       TritonNvfp4Decode.plan: split-KV geometry and buffers, for every pool dtype
    decode            TritonNvfp4Decode (fused split-KV   FlashInferPagedDecode: FlashInfer on CUDA when
                      kernel + LSE merge)                 flashinfer imports, else ReferenceBackend

``TritonBlockSelectBackend`` differs only in its NVFP4 write part (the block-select encoder). The parts live
in ``triton_nvfp4.py`` (write, gather), ``triton_decode.py`` (the NVFP4 decode and its CUDA-graph rules) and
``flashinfer_parts.py`` (prefill, fp8/bf16 decode; the only place that imports FlashInfer, lazily).
This module imports triton: without it the registry reports the backend as not importable.
"""

from __future__ import annotations

from types import MappingProxyType

from nvfp4_kernels.backends.composition import ComposedBackend, Composition, PoolParts
from nvfp4_kernels.backends.decode_choice import DecodeConfig, default_decode_config  # noqa: F401 - public names
from nvfp4_kernels.backends.flashinfer_parts import FlashInferPagedDecode, FlashInferRaggedPrefill
from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.backends.triton_decode import (  # noqa: F401 - the backend's public names
    DecodeKernel,
    DecodeState,
    DeviceTarget,
    TritonNvfp4Decode,
    e2m1_fold,
    e2m1_mode,
    split_geometry,
)
from nvfp4_kernels.backends.triton_kv_write import TritonDenseWrite
from nvfp4_kernels.backends.triton_nvfp4 import (  # noqa: F401 - the backend's public names
    TritonNvfp4Gather,
    TritonNvfp4Write,
    check_nvfp4_layer,
    dequant_rows_to_fp8,
    quantize_rows,
)


def triton_composition(decode_config: DecodeConfig | None = None, block_select: bool = False,
                       target: DeviceTarget | None = None, decode_kernel: DecodeKernel | None = None) -> Composition:
    """The Triton backend's parts; ``block_select``: NVFP4 writes with the per-block scale search;
    ``target``: the GPU the NVFP4 decode is planned for (default: the tensors' device); ``decode_kernel``: the
    NVFP4 decode kernel to run (default: the GPU's, ``default_decode_config``)."""
    reference = ReferenceBackend()
    nvfp4_decode = TritonNvfp4Decode(decode_config, target, decode_kernel)
    nvfp4 = PoolParts(write_kv=TritonNvfp4Write(block_select), gather_workspace=TritonNvfp4Gather(),
                      decode=nvfp4_decode)
    fp8_bf16 = PoolParts(write_kv=TritonDenseWrite(), gather_workspace=reference,
                            decode=FlashInferPagedDecode(fallback=reference))
    return Composition(prefill=FlashInferRaggedPrefill(fallback=reference), planner=nvfp4_decode,
                       pools=MappingProxyType({"nvfp4": nvfp4, "fp8_e4m3": fp8_bf16, "bf16": fp8_bf16}),
                       other=fp8_bf16)


class TritonBackend(ComposedBackend):
    """CUDA backend: Triton NVFP4 kernels + FlashInfer prefill (falls back to the reference pieces)."""

    name = "triton"
    block_select = False  # the NVFP4 encoder: amax/6 scales (nvfp4_kernels.nvfp4.quantize)

    def __init__(self, decode_config: DecodeConfig | None = None, target: DeviceTarget | None = None,
                 decode_kernel: DecodeKernel | None = None) -> None:
        super().__init__(triton_composition(decode_config, self.block_select, target, decode_kernel))


class TritonBlockSelectBackend(TritonBackend):
    """``--attention-backend triton-block-select``: the Triton backend whose NVFP4 pool writes pick, per
    16-value block, the E4M3 scale near amax/6 that reconstructs it best (bit-identical to
    nvfp4_kernels.nvfp4_block_select). Same bytes format and readers: decode, transfer and the handshake are
    unchanged; only the quantize-on-write kernel does more work."""

    name = "triton-block-select"
    block_select = True
