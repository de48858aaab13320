"""The Triton write_kv part of FP8 E4M3 and BF16 pools: K and V of a layer in one launch.

``TritonDenseWrite``  write_kv through ``kv_write_kernel`` (nvfp4_kernels/triton/kv_write.py), bit-identical to
                      ``ReferenceBackend.write_kv`` (nvfp4_kernels.fp8.quantize; a cast to bf16). A decode step writes
                      one token per sequence per layer: the reference's division, clamp, cast and two index
                      writes per tensor were ~10 small kernels a layer, this is one.
Pools it cannot serve (head_dim not a power of two, pages not contiguous) go to the reference, as do CPU tensors
(``write_rows`` itself also runs under Triton's interpreter and the warm-cache target driver).
"""

from __future__ import annotations

import torch
import triton

from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.backends.triton_nvfp4 import fp32_scale
from nvfp4_kernels.kv_layout import LayerKV
from nvfp4_kernels.programmatic_launch import pdl_args
from nvfp4_kernels.triton.kv_write import kv_write_kernel

# a program's rows hold this many values, 8 a thread at 4 warps: a decode step's launch has a few programs on a
# GPU of ~132 SMs, so its time is one program's serial chain, which grows with the values a thread holds
_BLOCK_VALUES = 1024
_ROWS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def block_rows(head_dim: int) -> int:
    """Rows per program of ``kv_write_kernel`` at ``head_dim`` (the launched BLOCK_R)."""
    return max(1, _BLOCK_VALUES // head_dim)


class TritonDenseWrite:
    """write_kv of an fp8_e4m3 or bf16 pool: one launch for K and V."""

    name = "triton-kv-write"

    def __init__(self) -> None:
        self._reference = ReferenceBackend()

    @staticmethod
    def serves(layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the kernel takes this layer and these rows (else the reference writes them)."""
        d, s, hk = layer.head_dim, layer.page_size, layer.num_kv_heads
        want = torch.float8_e4m3fn if layer.kv_dtype == "fp8_e4m3" else torch.bfloat16
        return (layer.kv_dtype in ("fp8_e4m3", "bf16") and k.is_cuda and d >= 16 and not d & (d - 1)
                and all(t.dtype == want and tuple(t.shape[1:]) == (s, hk, d) and t.is_contiguous()
                        and t.device == k.device for t in (layer.k, layer.v))
                and k.dtype == v.dtype
                and all(x.dtype in _ROWS_DTYPES and x.stride(2) == 1 and x.device == k.device for x in (k, v)))

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        expect = (slots.shape[0], layer.num_kv_heads, layer.head_dim)
        if slots.dim() != 1 or tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"write_kv needs slots [T] and k, v {list(expect)}, got slots {tuple(slots.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        if not self.serves(layer, k, v):
            self._reference.write_kv(layer, slots, k, v)
            return
        write_rows(layer, slots, k, v)


def write_rows(layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The launch: pool rows ``slots`` of ``layer``'s k and v = k, v encoded to the pool's dtype (checked by
    ``TritonDenseWrite.serves``; slots int32/int64 on the device, each < P*S: the caller's pages)."""
    t, hk, d = k.shape
    if t == 0:
        return
    fp8 = layer.kv_dtype == "fp8_e4m3"
    pool_k, pool_v = (p.view(torch.uint8) if fp8 else p for p in (layer.k, layer.v))
    rows, block_r = t * hk, block_rows(d)
    kv_write_kernel[(triton.cdiv(rows, block_r), 2)](
        k, v, slots, pool_k, pool_v, rows, fp32_scale(layer.k_scale), fp32_scale(layer.v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HK=hk, D=d, BLOCK_R=block_r, FP8=fp8, X_IS_BF16=k.dtype == torch.bfloat16, **pdl_args(k))
