"""The Triton parts that touch NVFP4 pool bytes outside decode: quantize-on-write and the workspace dequant.

``TritonNvfp4Write``   write_kv through ``nvfp4_quantize_kernel``, K and V of a layer in one launch
                       (bit-identical to nvfp4_kernels.nvfp4.quantize; with ``block_select`` to
                       nvfp4_kernels.nvfp4_block_select)
``TritonNvfp4Gather``  gather_workspace through ``nvfp4_to_fp8_kernel``: pool rows -> FP8 workspace rows

``quantize_kv_rows`` / ``quantize_rows`` / ``dequant_rows_to_fp8`` are the typed launches on flat row views
(benchmarks use them too).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from nvfp4_kernels.kv_layout import LayerKV
from nvfp4_kernels.programmatic_launch import pdl_args
from nvfp4_kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel, nvfp4_to_fp8_kernel

_QUANT_BLOCK_ROWS = 32  # the workspace dequant's rows per program
# quantize: a program's rows hold this many values, 8 a thread at 4 warps (at head_dim 128: one token's 8 KV
# heads). A decode step's launch has a few programs on a GPU of ~132 SMs, so its time is one program's serial
# chain, which grows with the values a thread holds. Block select: its scale search stays in registers at this
# size (sm_90a: 127 registers at head_dim 128, where 32 rows spill).
_QUANT_BLOCK_VALUES = 1024
_SELECT_BLOCK_VALUES = 1024
_ROWS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def quant_block_rows(head_dim: int, block_select: bool) -> int:
    """Rows per program of the quantize kernel at ``head_dim`` (the launched BLOCK_R)."""
    return max(1, (_SELECT_BLOCK_VALUES if block_select else _QUANT_BLOCK_VALUES) // head_dim)


def fp32_scale(x: float) -> float:
    """``x`` rounded to fp32, as the reference's scale tensor holds it (what a kernel's fp32 argument gets)."""
    return float(torch.tensor(x, dtype=torch.float32))


class PoolRows(NamedTuple):
    """One pool tensor as the quantize kernel writes it: flat row views data [P*S, Hk, D/2] uint8 and
    scales [P*S, Hk, D/16] (uint8 or float8_e4m3fn), both contiguous, and the tensor's global scale."""

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: float


def _check_rows(x: torch.Tensor, pool: PoolRows) -> None:
    hk, d = x.shape[1:]
    if x.dtype not in _ROWS_DTYPES or x.stride(2) != 1:
        raise ValueError(f"quantize_rows takes bf16/fp16/fp32 rows with a contiguous last dim, got {x.dtype} "
                         f"strides {x.stride()}")
    if tuple(pool.data.shape[1:]) != (hk, d // 2) or tuple(pool.scales.shape[1:]) != (hk, d // 16):
        raise ValueError(f"pool views {tuple(pool.data.shape)} / {tuple(pool.scales.shape)} do not hold rows "
                         f"[{hk}, {d}]")
    g = pool.global_scale
    if not (math.isfinite(g) and g >= 2.0**-126):
        raise ValueError(f"NVFP4 global_scale must be a finite normal fp32 > 0, got {g!r}")


def quantize_kv_rows(slots: torch.Tensor, k: torch.Tensor, k_pool: PoolRows, v: torch.Tensor | None = None,
                     v_pool: PoolRows | None = None, block_select: bool = False) -> None:
    """One launch: k_pool[slots] = nvfp4_kernels.nvfp4.quantize(k, k_pool.global_scale) and, with ``v``, v_pool[slots]
    likewise (``block_select``: nvfp4_kernels.nvfp4_block_select.quantize_block_select), bit-identical.

    k, v [T, Hk, D] bf16/fp16/fp32 of one dtype (last dim contiguous, any token/head strides); slots [T] int,
    each < P*S. K's and V's programs run side by side (grid axis 1), each as a launch of one tensor would.
    """
    if v is not None and (v_pool is None or v.dtype != k.dtype or tuple(v.shape) != tuple(k.shape)):
        raise ValueError(f"quantize_kv_rows needs v shaped as k ({k.dtype} {tuple(k.shape)}) and its pool, got "
                         f"{v.dtype} {tuple(v.shape)}{'' if v_pool is not None else ' and no pool'}")
    writes = [(k, k_pool)] if v is None else [(k, k_pool), (v, v_pool)]
    for x, pool in writes:
        _check_rows(x, pool)
    t, hk, d = k.shape
    if t == 0:
        return
    (kx, kp), (vx, vp) = writes[0], writes[-1]  # K alone: V's arguments repeat K's and no program reads them
    rows, block_r = t * hk, quant_block_rows(d, block_select)
    nvfp4_quantize_kernel[(triton.cdiv(rows, block_r), len(writes))](
        kx, vx, slots, kp.data, u8(kp.scales), vp.data, u8(vp.scales), rows, fp32_scale(kp.global_scale),
        fp32_scale(vp.global_scale), kx.stride(0), kx.stride(1), vx.stride(0), vx.stride(1),
        HK=hk, D=d, BLOCK_R=block_r, BLOCK_SELECT=block_select, **pdl_args(kx),
        enable_fp_fusion=not block_select)  # block select: the error sums' fp32 order is part of the result


def quantize_rows(x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                  global_scale: float, block_select: bool = False) -> None:
    """data[slots], scales[slots] = nvfp4_kernels.nvfp4.quantize(x, global_scale) (``block_select``:
    nvfp4_kernels.nvfp4_block_select.quantize_block_select), bit-identical: ``quantize_kv_rows`` of one tensor.

    x [T, Hk, D] bf16/fp16/fp32 (last dim contiguous); slots [T] int; data [P*S, Hk, D/2] uint8 and
    scales [P*S, Hk, D/16] (uint8 or float8_e4m3fn), contiguous.
    """
    quantize_kv_rows(slots, x, PoolRows(data, scales, global_scale), block_select=block_select)


def dequant_rows_to_fp8(data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                        global_scale: float, ws_scale: float) -> None:
    """out[i] = nvfp4_kernels.fp8.quantize(nvfp4_kernels.nvfp4.dequantize(pool[slots[i]]), ws_scale) as E4M3 bytes."""
    n, (hk, d) = slots.shape[0], out.shape[1:]
    if n == 0:
        return
    rows = n * hk
    nvfp4_to_fp8_kernel[(triton.cdiv(rows, _QUANT_BLOCK_ROWS),)](
        data, u8(scales), slots, u8(out), rows, float(global_scale), float(ws_scale),
        HK=hk, D=d, BLOCK_R=_QUANT_BLOCK_ROWS)


class TritonNvfp4Write:
    """write_kv of an NVFP4 pool: K and V in one quantize launch (two where their dtypes differ)."""

    def __init__(self, block_select: bool = False) -> None:
        self.block_select = block_select  # False: amax/6 scales (nvfp4_kernels.nvfp4.quantize)
        self.name = "triton-nvfp4-quantize-block-select" if block_select else "triton-nvfp4-quantize"

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        check_nvfp4_layer(layer)
        expect = (slots.shape[0], layer.num_kv_heads, layer.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"write_kv needs k, v {list(expect)}, got {tuple(k.shape)}, {tuple(v.shape)}")
        p, s, hk = layer.k.shape[:3]
        k_pool = PoolRows(layer.k.view(p * s, hk, -1), layer.k_sf.view(p * s, hk, -1), layer.k_scale)
        v_pool = PoolRows(layer.v.view(p * s, hk, -1), layer.v_sf.view(p * s, hk, -1), layer.v_scale)
        if k.dtype == v.dtype:
            quantize_kv_rows(slots, k, k_pool, v, v_pool, self.block_select)
            return
        quantize_kv_rows(slots, k, k_pool, block_select=self.block_select)
        quantize_kv_rows(slots, v, v_pool, block_select=self.block_select)


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
