"""The GPU attention backend: Triton kernels for the NVFP4 pool, FlashInfer for prefill and FP8/BF16 decode.

    write_kv          nvfp4: ``nvfp4_quantize_kernel`` (bit-identical to kernels.nvfp4.quantize; in
                      ``TritonBlockSelectBackend`` to kernels.nvfp4_block_select);
                      fp8 / bf16: the reference torch ops (already one fused elementwise pass on GPU)
    gather_workspace  nvfp4 -> FP8 workspace: ``nvfp4_to_fp8_kernel``; other pools: reference
    prefill           FlashInfer ragged FA2 on bf16 / fp8 K,V when flashinfer imports, else the reference
    decode            nvfp4: the fused split-KV kernel, out[b,h] = softmax(q[b,h] . K[b]^T * sm_scale) . V[b]
                      with K, V read from NVFP4 pages; fp8 / bf16: FlashInfer decode when available, else
                      the reference

CUDA graphs. ``plan_decode`` sizes everything from the plan alone (B, page_table.shape[1], heads): the
split size, the number of splits, the partial-output buffers and the grids. ``decode`` launches exactly
those grids, reads the sequence lengths and page ids from device memory and allocates nothing, so an
engine captures one graph per batch-size bucket with a fixed ``max_pages`` (a page table of that width)
and replays it for any lengths <= max_pages * page_size. The FlashInfer fp8/bf16 decode plans on the host:
a ``static`` plan holds a CUDA-graph FlashInfer wrapper whose CSR buffers ``refresh_decode_plan`` rewrites
from host arrays before each replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton

from kernels.backends.base import AttentionBackend, DecodeOptions, DecodePlan, PrefillPlan
from kernels.backends.reference import ReferenceBackend
from kernels.kv_layout import LayerKV
from kernels.triton.nvfp4_decode import merge_kernel, nvfp4_decode_kernel
from kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel, nvfp4_to_fp8_kernel

_LOG2E = math.log2(math.e)
_QUANT_BLOCK_ROWS = 32
_MIN_SPLIT_TOKENS = 256


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the NVFP4 decode kernel: NW warp slices of BW tokens per loop step."""

    num_warps: int = 4
    block_w: int = 32
    num_stages: int = 2
    programs_per_sm: int = 8  # split-KV target: about this many programs per SM when sequences are long

    def __post_init__(self) -> None:
        if self.block_w < 16 or self.block_w & (self.block_w - 1):
            raise ValueError(f"block_w must be a power of two >= 16 (tensor-core N dim), got {self.block_w}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")

    @property
    def block_n(self) -> int:
        return self.num_warps * self.block_w


def default_decode_config(head_dim: int) -> DecodeConfig:
    """Measured on H200 (docs/benchmarks/kernel-notes.md); D=256 halves the slice to stay in registers."""
    return DecodeConfig(4, 16 if head_dim > 128 else 32, 2, 8)


def e2m1_mode(device: torch.device) -> int:
    """Decode implementation for ``device``: 0 = interpreter (CPU), 1 = software (SM < 100), 2 = cvt (SM100+)."""
    if device.type != "cuda":
        return 0
    major, _ = torch.cuda.get_device_capability(device)
    return 2 if major >= 10 else 1


def e2m1_fold(mode: int) -> float:
    """The factor the decoded E2M1 values lack: the software decode yields E2M1 * 2**-14."""
    return 1.0 if mode == 2 else 2.0**14


@dataclass
class _DecodeState:
    """Per-batch buffers and launch geometry of the NVFP4 decode (depends only on the plan)."""

    config: DecodeConfig
    chunk_tokens: int
    num_splits: int
    o_part: torch.Tensor  # [B, Hq, num_splits, D] fp32
    lse_part: torch.Tensor  # [B, Hq, num_splits] fp32
    fallback: object = None  # (FlashInferDecode, (kv_dtype, sm_scale)) for fp8/bf16 pools with flashinfer
    fallback_args: tuple | None = None  # plan arguments after (page_table, seq_lens), for refresh_decode_plan


def split_geometry(batch: int, num_kv_heads: int, max_tokens: int, block_n: int, num_sms: int,
                   programs_per_sm: int = 8) -> tuple[int, int]:
    """(chunk_tokens, num_splits): enough programs to fill the GPU, each at least ``_MIN_SPLIT_TOKENS`` long."""
    base = max(1, batch * num_kv_heads)
    want = max(1, math.ceil(programs_per_sm * num_sms / base))
    cap = max(1, math.ceil(max_tokens / _MIN_SPLIT_TOKENS))
    splits = min(want, cap)
    chunk = triton.cdiv(triton.cdiv(max_tokens, splits), block_n) * block_n
    return chunk, triton.cdiv(max_tokens, chunk)


def _check_nvfp4_layer(layer: LayerKV) -> None:
    d, hk, s = layer.head_dim, layer.num_kv_heads, layer.page_size
    if d % 32 != 0 or d < 64 or d & (d - 1):
        raise ValueError(f"the Triton NVFP4 kernels need head_dim a power of two >= 64 (got {d}); "
                         "use the reference backend for other head sizes")
    for name, t, last in (("k", layer.k, d // 2), ("v", layer.v, d // 2), ("k_sf", layer.k_sf, d // 16),
                          ("v_sf", layer.v_sf, d // 16)):
        if t is None or tuple(t.shape[1:]) != (s, hk, last) or not t.is_contiguous():
            raise ValueError(f"nvfp4 pool tensor {name} must be contiguous [P, {s}, {hk}, {last}], got "
                             f"{None if t is None else (tuple(t.shape), t.stride())}")


def _u8(t: torch.Tensor) -> torch.Tensor:
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
    nvfp4_quantize_kernel[(triton.cdiv(rows, _QUANT_BLOCK_ROWS),)](
        x, slots, data, _u8(scales), rows, float(torch.tensor(global_scale, dtype=torch.float32)),
        x.stride(0), x.stride(1), HK=hk, D=d, BLOCK_R=_QUANT_BLOCK_ROWS, BLOCK_SELECT=block_select,
        enable_fp_fusion=not block_select)  # block select: the error sums' fp32 order is part of the result


def dequant_rows_to_fp8(data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                        global_scale: float, ws_scale: float) -> None:
    """out[i] = kernels.fp8.quantize(kernels.nvfp4.dequantize(pool[slots[i]]), ws_scale) as E4M3 bytes."""
    n, (hk, d) = slots.shape[0], out.shape[1:]
    if n == 0:
        return
    rows = n * hk
    nvfp4_to_fp8_kernel[(triton.cdiv(rows, _QUANT_BLOCK_ROWS),)](
        data, _u8(scales), slots, _u8(out), rows, float(global_scale), float(ws_scale),
        HK=hk, D=d, BLOCK_R=_QUANT_BLOCK_ROWS)


class TritonBackend(AttentionBackend):
    """CUDA backend: Triton NVFP4 kernels + FlashInfer prefill (falls back to the reference pieces)."""

    name = "triton"
    block_select = False  # the NVFP4 encoder: amax/6 scales (kernels.nvfp4.quantize)

    def __init__(self, decode_config: DecodeConfig | None = None) -> None:
        self._reference = ReferenceBackend()
        self._decode_config = decode_config
        self._prefill: dict[torch.device, object] = {}

    # -- write / gather ------------------------------------------------------------------------------
    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer.kv_dtype != "nvfp4":
            self._reference.write_kv(layer, slots, k, v)
            return
        _check_nvfp4_layer(layer)
        expect = (slots.shape[0], layer.num_kv_heads, layer.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"write_kv needs k, v {list(expect)}, got {tuple(k.shape)}, {tuple(v.shape)}")
        p, s, hk = layer.k.shape[:3]
        for x, data, sf, g in ((k, layer.k, layer.k_sf, layer.k_scale), (v, layer.v, layer.v_sf, layer.v_scale)):
            quantize_rows(x, slots, data.view(p * s, hk, -1), sf.view(p * s, hk, -1), g, self.block_select)

    def gather_workspace(self, layer: LayerKV, slots: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor) -> None:
        if layer.kv_dtype != "nvfp4":
            self._reference.gather_workspace(layer, slots, ws_k, ws_v)
            return
        _check_nvfp4_layer(layer)
        n = slots.shape[0]
        p, s, hk = layer.k.shape[:3]
        for ws, data, sf, g, wsg in ((ws_k, layer.k, layer.k_sf, layer.k_scale, layer.ws_k_scale),
                                     (ws_v, layer.v, layer.v_sf, layer.v_scale, layer.ws_v_scale)):
            if ws.dtype != torch.float8_e4m3fn or ws.shape[0] < n or tuple(ws.shape[1:]) != (hk, layer.head_dim):
                raise ValueError(f"nvfp4 pools gather into a float8_e4m3fn workspace [>= {n}, {hk}, "
                                 f"{layer.head_dim}], got {ws.dtype} {tuple(ws.shape)}")
            dequant_rows_to_fp8(data.view(p * s, hk, -1), sf.view(p * s, hk, -1), slots, ws[:n], g, wsg)

    # -- prefill -------------------------------------------------------------------------------------
    def prefill(self, plan: PrefillPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: float, v_scale: float, sm_scale: float) -> torch.Tensor:
        from kernels.backends.flashinfer_backend import FlashInferPrefill, flashinfer_available

        usable = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
                  and k.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) and flashinfer_available())
        if not usable:
            return self._reference.prefill(plan, q, k, v, k_scale, v_scale, sm_scale)
        fi = self._prefill.get(q.device)
        if fi is None:
            fi = self._prefill[q.device] = FlashInferPrefill(q.device)
        fi.plan(plan.qo_indptr, plan.kv_indptr, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim,
                q.dtype, k.dtype, sm_scale, host_key=(tuple(plan.qo_lens), tuple(plan.kv_lens)))
        return fi.run(q, k, v, k_scale, v_scale)

    # -- decode --------------------------------------------------------------------------------------
    def plan_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, page_size: int, *,
                    options: DecodeOptions | None = None) -> DecodePlan:
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or seq_lens.dtype != torch.int32:
            raise ValueError("plan_decode needs page_table [B, max_pages] int32 and seq_lens [B] int32, got "
                             f"{page_table.dtype} {tuple(page_table.shape)} / {seq_lens.dtype}")
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        plan = DecodePlan(page_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size)
        batch, max_pages = page_table.shape
        cfg = self._decode_config or default_decode_config(head_dim)
        dev = page_table.device
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        chunk, splits = split_geometry(batch, num_kv_heads, max(1, max_pages * page_size), cfg.block_n, num_sms,
                                       cfg.programs_per_sm)
        st = _DecodeState(
            cfg, chunk, splits,
            torch.empty(batch, num_qo_heads, splits, head_dim, dtype=torch.float32, device=dev),
            torch.empty(batch, num_qo_heads, splits, dtype=torch.float32, device=dev))
        plan.backend_state = st
        if options is not None and options.kv_dtype != "nvfp4" and dev.type == "cuda":
            from kernels.backends.flashinfer_backend import FlashInferDecode, flashinfer_available

            if flashinfer_available():
                # The FP8/BF16 decode is FlashInfer's; a static plan gets a CUDA-graph wrapper whose CSR
                # buffers hold every page the table can name (plus one per row for padded rows).
                # Rows may share pages (a cached prefix), so the CSR can name up to batch * max_pages
                # entries whatever the pool size: size the index buffer by the table, not the pool.
                fi = FlashInferDecode(dev, use_tensor_cores=True,
                                      graph_batch=batch if options.static else None,
                                      max_pages=batch * max_pages)
                st.fallback = (fi, (options.kv_dtype, options.sm_scale))
                st.fallback_args = (num_qo_heads, num_kv_heads, head_dim, page_size, options.kv_dtype,
                                    options.q_dtype, options.sm_scale)
                if not options.static:
                    fi.plan(page_table, seq_lens, *st.fallback_args)
        return plan

    def warm_decode(self, layer: LayerKV, shapes: list[tuple[int, int]], num_qo_heads: int,
                    q_dtype: torch.dtype, sm_scale: float, fill_page: int) -> int:
        """Triton specializes the NVFP4 decode and merge kernels on values that follow the plan's shape (the
        split count, via SPLITS_P2 and the partial buffers' strides; the table's row stride): a new shape
        compiles a variant (about a second), which stalled every running request the first time a serving
        batch grew into it. Running each shape once here moves those compiles to start-up."""
        if layer.kv_dtype != "nvfp4" or layer.k.device.type != "cuda" or not shapes:
            return 0
        dev = layer.k.device
        most = max(b * w for b, w in shapes)
        table_flat = torch.full((most,), fill_page, dtype=torch.int32, device=dev)
        lens = torch.ones(max(b for b, _ in shapes), dtype=torch.int32, device=dev)
        q = torch.zeros(lens.numel(), num_qo_heads, layer.head_dim, dtype=q_dtype, device=dev)
        for b, w in shapes:
            table = table_flat[: b * w].view(b, w)  # contiguous: the row stride a captured table has
            plan = self.plan_decode(table, lens[:b], num_qo_heads, layer.num_kv_heads, layer.head_dim,
                                    layer.page_size)
            self.decode(plan, q[:b], layer, sm_scale)
        torch.cuda.synchronize(dev)
        return len(shapes)

    def refresh_decode_plan(self, plan: DecodePlan, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        st = plan.backend_state
        if isinstance(st, _DecodeState) and st.fallback is not None and st.fallback_args is not None:
            st.fallback[0].plan_host(page_table, seq_lens, *st.fallback_args)

    def _fallback_decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        from kernels.backends.flashinfer_backend import FlashInferDecode, flashinfer_available

        st = plan.backend_state
        if q.is_cuda and flashinfer_available():
            if not isinstance(st, _DecodeState) or st.fallback is None or st.fallback[1] != (layer.kv_dtype, sm_scale):
                fi = FlashInferDecode(q.device, use_tensor_cores=True)
                fi.plan(plan.page_table, plan.seq_lens, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim,
                        plan.page_size, layer.kv_dtype, q.dtype, sm_scale)
                if isinstance(st, _DecodeState):
                    st.fallback = (fi, (layer.kv_dtype, sm_scale))
            else:
                fi = st.fallback[0]
            return fi.run(q, layer)
        return self._reference.decode(plan, q, layer, sm_scale)

    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        if layer.kv_dtype != "nvfp4":
            return self._fallback_decode(plan, q, layer, sm_scale)
        st = plan.backend_state
        if not isinstance(st, _DecodeState):
            raise TypeError("decode needs a plan from TritonBackend.plan_decode")
        _check_nvfp4_layer(layer)
        batch, hq, d = q.shape
        hk = layer.num_kv_heads
        if (hq, hk, d, layer.page_size) != (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size):
            raise ValueError(f"q {tuple(q.shape)} / layer (Hk={hk}, S={layer.page_size}) do not match the plan "
                             f"(Hq={plan.num_qo_heads}, Hk={plan.num_kv_heads}, D={plan.head_dim}, "
                             f"S={plan.page_size})")
        if q.dtype not in (torch.bfloat16, torch.float16) or q.stride(2) != 1 or batch != plan.page_table.shape[0]:
            raise ValueError(f"q must be bf16/fp16 [B={plan.page_table.shape[0]}, Hq, D] with a contiguous last dim,"
                             f" got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
        group = hq // hk
        mode = e2m1_mode(q.device)
        fold = e2m1_fold(mode)
        cfg = st.config
        qk_scale = float(sm_scale) * float(layer.k_scale) * fold * _LOG2E
        out_scale = float(layer.v_scale) * fold
        pt, op, lse = plan.page_table, st.o_part, st.lse_part
        nvfp4_decode_kernel[(hk, st.num_splits, batch)](
            q, layer.k.view(torch.int16), _u8(layer.k_sf), layer.v.view(torch.int16), _u8(layer.v_sf),
            pt, plan.seq_lens, op, lse,
            qk_scale, out_scale, q.stride(0), q.stride(1), pt.stride(0),
            op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1), st.chunk_tokens,
            HK=hk, G=group, GP=max(16, triton.next_power_of_2(group)), D=d, PAGE=layer.page_size,
            NW=cfg.num_warps, BW=cfg.block_w, MODE=mode, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        out = torch.empty_like(q)
        merge_kernel[(batch, hq)](
            op, lse, out, st.num_splits, op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), D=d, SPLITS_P2=triton.next_power_of_2(st.num_splits))
        return out


class TritonBlockSelectBackend(TritonBackend):
    """``--attention-backend triton-block-select``: the Triton backend whose NVFP4 pool writes pick, per
    16-value block, the scale amax/6 or amax/4 that reconstructs better (bit-identical to
    kernels.nvfp4_block_select). Same bytes format and readers: decode, transfer and the handshake are
    unchanged; only the quantize-on-write kernel does more work."""

    name = "triton-block-select"
    block_select = True
