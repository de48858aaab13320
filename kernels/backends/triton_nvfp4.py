"""The Triton parts that touch NVFP4 pool bytes outside decode: quantize-on-write and the workspace dequant.

``TritonNvfp4Write``   write_kv through ``nvfp4_quantize_kernel`` (bit-identical to kernels.nvfp4.quantize;
                       with ``block_select`` to kernels.nvfp4_block_select)
``TritonNvfp4Gather``  gather_workspace through ``nvfp4_to_fp8_kernel``: pool rows -> FP8 workspace rows

``quantize_rows`` / ``dequant_rows_to_fp8`` are the typed launches on flat row views (benchmarks use them too).
"""

from __future__ import annotations

import math

import torch
import triton

from kernels.kv_layout import LayerKV
from kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel, nvfp4_to_fp8_kernel

_QUANT_BLOCK_ROWS = 32
# block select: a program's rows hold this many values (8 a thread at 4 warps), so its scale search stays in
# registers (sm_90a: 127 registers at head_dim 128, where 32 rows spill)
_SELECT_BLOCK_VALUES = 1024


def check_nvfp4_layer(layer: LayerKV) -> None:
    """The Triton NVFP4 kernels' rule on a pool layer: head_dim a power of two >= 64, contiguous pages."""
    d, hk, s = layer.head_dim, layer.num_kv_heads, layer.page_size
    if d % 32 != 0 or d < 64 or d & (d - 1):
        raise ValueError(f"the Triton NVFP4 kernels need head_dim a power of two >= 64 (got {d}); "
                         "use the reference backend for other head sizes")
    for name, t, last in (("k", layer.k, d // 2), ("v", layer.v, d // 2), ("k_sf", layer.k_sf, d // 16),
                          ("v_sf", layer.v_sf, d // 16)):
        if t is None or tuple(t.shape[1:]) != (s, hk, last) or not t.is_contiguous():
            raise ValueError(f"nvfp4 pool tensor {name} must be contiguous [P, {s}, {hk}, {last}], got "
                             f"{None if t is None else (tuple(t.shape), t.stride())}")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def quantize_rows(x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                  global_scale: float, block_select: bool = False) -> None:
    """data[slots], scales[slots] = kernels.nvfp4.quantize(x, global_scale) (``block_select``:
    kernels.nvfp4_block_select.quantize_block_select), bit-identical.

    x [T, Hk, D] bf16/fp16/fp32 (last dim contiguous); slots [T] int; data [P*S, Hk, D/2] uint8 and
    scales [P*S, Hk, D/16] (uint8 or float8_e4m3fn), contiguous.
    """
    t, hk, d = x.shape
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(2) != 1:
        raise ValueError(f"quantize_rows takes bf16/fp16/fp32 rows with a contiguous last dim, got {x.dtype} "
                         f"strides {x.stride()}")
    if tuple(data.shape[1:]) != (hk, d // 2) or tuple(scales.shape[1:]) != (hk, d // 16):
        raise ValueError(f"pool views {tuple(data.shape)} / {tuple(scales.shape)} do not hold rows [{hk}, {d}]")
    if not (math.isfinite(global_scale) and global_scale >= 2.0**-126):
        raise ValueError(f"NVFP4 global_scale must be a finite normal fp32 > 0, got {global_scale!r}")
    if t == 0:
        return
    rows = t * hk
    block_r = max(1, _SELECT_BLOCK_VALUES // d) if block_select else _QUANT_BLOCK_ROWS
    nvfp4_quantize_kernel[(triton.cdiv(rows, block_r),)](
        x, slots, data, u8(scales), rows, float(torch.tensor(global_scale, dtype=torch.float32)),
        x.stride(0), x.stride(1), HK=hk, D=d, BLOCK_R=block_r, BLOCK_SELECT=block_select,
        enable_fp_fusion=not block_select)  # block select: the error sums' fp32 order is part of the result


def dequant_rows_to_fp8(data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                        global_scale: float, ws_scale: float) -> None:
    """out[i] = kernels.fp8.quantize(kernels.nvfp4.dequantize(pool[slots[i]]), ws_scale) as E4M3 bytes."""
    n, (hk, d) = slots.shape[0], out.shape[1:]
    if n == 0:
        return
    rows = n * hk
    nvfp4_to_fp8_kernel[(triton.cdiv(rows, _QUANT_BLOCK_ROWS),)](
        data, u8(scales), slots, u8(out), rows, float(global_scale), float(ws_scale),
        HK=hk, D=d, BLOCK_R=_QUANT_BLOCK_ROWS)


class TritonNvfp4Write:
    """write_kv of an NVFP4 pool: one quantize launch for K, one for V."""

    def __init__(self, block_select: bool = False) -> None:
        self.block_select = block_select  # False: amax/6 scales (kernels.nvfp4.quantize)
        self.name = "triton-nvfp4-quantize-block-select" if block_select else "triton-nvfp4-quantize"

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        check_nvfp4_layer(layer)
        expect = (slots.shape[0], layer.num_kv_heads, layer.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"write_kv needs k, v {list(expect)}, got {tuple(k.shape)}, {tuple(v.shape)}")
        p, s, hk = layer.k.shape[:3]
        for x, data, sf, g in ((k, layer.k, layer.k_sf, layer.k_scale), (v, layer.v, layer.v_sf, layer.v_scale)):
            quantize_rows(x, slots, data.view(p * s, hk, -1), sf.view(p * s, hk, -1), g, self.block_select)


class TritonNvfp4Gather:
    """gather_workspace of an NVFP4 pool: pool rows dequantized straight into the FP8 workspace."""

    name = "triton-nvfp4-to-fp8"

    def gather_workspace(self, layer: LayerKV, slots: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor) -> None:
        check_nvfp4_layer(layer)
        n = slots.shape[0]
        p, s, hk = layer.k.shape[:3]
        for ws, data, sf, g, wsg in ((ws_k, layer.k, layer.k_sf, layer.k_scale, layer.ws_k_scale),
                                     (ws_v, layer.v, layer.v_sf, layer.v_scale, layer.ws_v_scale)):
            if ws.dtype != torch.float8_e4m3fn or ws.shape[0] < n or tuple(ws.shape[1:]) != (hk, layer.head_dim):
                raise ValueError(f"nvfp4 pools gather into a float8_e4m3fn workspace [>= {n}, {hk}, "
                                 f"{layer.head_dim}], got {ws.dtype} {tuple(ws.shape)}")
            dequant_rows_to_fp8(data.view(p * s, hk, -1), sf.view(p * s, hk, -1), slots, ws[:n], g, wsg)
