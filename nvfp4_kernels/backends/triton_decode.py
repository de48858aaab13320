"""The Triton NVFP4 decode part: split-KV geometry, per-plan buffers, the fused decode and LSE merge launches.

``TritonNvfp4Decode`` plans every decode of the Triton backend (``plan``: the checks and ``DecodeState``, for
any pool dtype) and decodes NVFP4 pools: out[b,h] = softmax(q[b,h] . K[b]^T * sm_scale) . V[b] with K, V read
from NVFP4 pages by ``nvfp4_decode_kernel``, then ``merge_kernel`` over the splits.

CUDA graphs. ``plan`` sizes everything from the plan alone (B, page_table.shape[1], heads): the split size,
the number of splits, the partial-output buffers and the grids. ``decode`` launches exactly those grids,
reads the sequence lengths and page ids from device memory and allocates nothing, so an engine captures one
graph per batch-size bucket with a fixed ``max_pages`` (a page table of that width) and replays it for any
lengths <= max_pages * page_size; there is no host-side refresh.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
import triton

from nvfp4_kernels.backends.base import DecodeOptions, DecodePlan
from nvfp4_kernels.backends.decode_choice import (
    DecodeConfig,
    default_decode_config,
    eager_config,
    prefers_lean_step,
)
from nvfp4_kernels.backends.decode_kernels import DecodeKernel, kernel_unfit
from nvfp4_kernels.backends.triton_nvfp4 import check_nvfp4_layer, u8
from nvfp4_kernels.kv_layout import LayerKV
from nvfp4_kernels.triton.nvfp4_decode import merge_kernel, merge_tile, merge_warps, nvfp4_decode_kernel

_LOG2E = math.log2(math.e)
_MIN_SPLIT_TOKENS = 256
_MAX_WAVES = 4  # split counts tried fill up to this many whole waves (split_geometry)


def e2m1_mode(device: torch.device) -> int:
    """Decode implementation for ``device``: 0 = interpreter (CPU), 1 = software (SM < 100), 2 = cvt (SM100+)."""
    if device.type != "cuda":
        return 0
    return DeviceTarget.mode_for(torch.cuda.get_device_capability(device))


@dataclass(frozen=True)
class DeviceTarget:
    """The GPU a decode is planned and compiled for: its SM count sets the split-KV geometry, its compute
    capability the E2M1 decode mode. A part built without one reads both from the tensors' device (the CPU
    stands for 4 SMs and the interpreter); ``nvfp4-serve warm-cache`` names a GPU the machine lacks."""

    num_sms: int
    capability: tuple[int, int]
    lean_step: bool = False  # the TMA decode's lean step (decode_choice.prefers_lean_step of the GPU's name)

    def __post_init__(self) -> None:
        if self.num_sms < 1 or self.capability[0] < 1:
            raise ValueError(f"a target GPU needs num_sms >= 1 and a compute capability, got {self}")

    @staticmethod
    def mode_for(capability: tuple[int, int]) -> int:
        return 2 if capability[0] >= 10 else 1

    @property
    def e2m1_mode(self) -> int:
        return self.mode_for(self.capability)


def e2m1_fold(mode: int) -> float:
    """The factor the decoded E2M1 values lack: the software decode yields E2M1 * 2**-14."""
    return 1.0 if mode == 2 else 2.0**14


@dataclass
class DecodeState:
    """Per-batch buffers and launch geometry of the NVFP4 decode (depends only on the plan)."""

    config: DecodeConfig
    chunk_tokens: int
    num_splits: int
    o_part: torch.Tensor  # [B, Hq, num_splits, D] fp32
    lse_part: torch.Tensor  # [B, Hq, num_splits] fp32
    fallback: object = None  # (FlashInferDecode, (kv_dtype, sm_scale)) for fp8/bf16 pools with flashinfer
    fallback_args: tuple | None = None  # plan arguments after (page_table, seq_lens), for refresh_decode_plan


@functools.lru_cache(maxsize=4096)
def split_geometry(batch: int, num_kv_heads: int, max_tokens: int, block_n: int, num_sms: int,
                   programs_per_sm: int = 8) -> tuple[int, int]:
    """(chunk_tokens, num_splits) of a grid of batch x num_kv_heads x num_splits programs.

    A wave is ``programs_per_sm * num_sms`` programs (``decode_choice.wave_programs``: the programs that fit on
    an SM, or a multiple). A grid a little past whole waves runs its last programs at a fraction of what the SMs
    hold (1.5 waves: the last third at half), so the split count is the one whose grid takes the fewest
    program-lengths of tokens, waves x (chunk + one step of fixed cost), among the most splits that fill 1, 2, 3
    or 4 whole waves (and 1), each split at least ``_MIN_SPLIT_TOKENS`` long; a tie goes to fewer programs."""
    base = max(1, batch * num_kv_heads)
    wave = max(1, programs_per_sm * num_sms)
    cap = max(1, math.ceil(max_tokens / _MIN_SPLIT_TOKENS))
    grids = []  # (tokens per SM in program-lengths, programs, chunk, splits)
    for want in {1, *(min(cap, w * wave // base) for w in range(1, _MAX_WAVES + 1))} - {0}:
        chunk = triton.cdiv(triton.cdiv(max_tokens, want), block_n) * block_n
        splits = triton.cdiv(max_tokens, chunk)
        grids.append((triton.cdiv(base * splits, wave) * (chunk + block_n), base * splits, chunk, splits))
    _, _, chunk, splits = min(grids)
    return chunk, splits


class TritonNvfp4Decode:
    """Plans every decode of the backend; decodes NVFP4 pools with the fused split-KV kernel."""

    name = "triton-nvfp4-decode"

    def __init__(self, decode_config: DecodeConfig | None = None, target: DeviceTarget | None = None,
                 kernel: DecodeKernel | None = None) -> None:
        if decode_config is not None and kernel is not None:
            raise ValueError("give a decode_config or a kernel to pick, not both")
        self.decode_config = decode_config  # None: default_decode_config(head_dim, ..., kernel) per plan
        self.target = target  # None: the GPU the tensors are on
        self.kernel = kernel  # None: the GPU's default (default_decode_config)
        self._partials: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}  # _partial_buffers
        self._partials_lock = threading.Lock()

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int) -> DecodePlan:
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or seq_lens.dtype != torch.int32:
            raise ValueError("plan_decode needs page_table [B, max_pages] int32 and seq_lens [B] int32, got "
                             f"{page_table.dtype} {tuple(page_table.shape)} / {seq_lens.dtype}")
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        plan = DecodePlan(page_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size)
        batch, max_pages = page_table.shape
        dev = page_table.device
        cfg = self.decode_config or default_decode_config(head_dim, self._capability(dev), num_qo_heads // num_kv_heads,
                                                          self.kernel, num_kv_heads=num_kv_heads, page_size=page_size,
                                                          lean_step=self._lean_step(dev))
        if self.target is not None:
            num_sms = self.target.num_sms
        else:
            num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        chunk, splits = split_geometry(batch, num_kv_heads, max(1, max_pages * page_size), cfg.block_n, num_sms,
                                       cfg.programs_per_sm)
        st = DecodeState(cfg, chunk, splits, *self._partial_buffers(dev, batch, num_qo_heads, splits, head_dim))
        plan.backend_state = st
        return plan

    def _partial_buffers(self, dev: torch.device, batch: int, num_qo_heads: int, splits: int, head_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """A plan's split outputs [B, Hq, splits, D] and LSEs [B, Hq, splits] (fp32): views of one buffer pair per
        device and head_dim that every plan of this part shares, grown by doubling. A decode writes them and its
        merge reads them within the one call, and an engine's decodes run one after another on one stream (as the
        layers of one plan always shared them), so no two plans need them at once. One pair, not one per plan: an engine
        keeps a plan per (batch, width) bucket it captured, hundreds in a long run, and whole split-KV waves
        reach up to 4 x 32 programs per SM (35 MB each at D 128, group 4). A plan made before a growth keeps the
        smaller pair it viewed alive."""
        n = batch * num_qo_heads * splits
        with self._partials_lock:
            o, lse = self._partials.get((dev, head_dim), (None, None))
            if lse is None or lse.numel() < n:
                size = max(n, 0 if lse is None else 2 * lse.numel())
                o = torch.empty(size * head_dim, dtype=torch.float32, device=dev)
                lse = torch.empty(size, dtype=torch.float32, device=dev)
                self._partials[dev, head_dim] = (o, lse)
        return o[:n * head_dim].view(batch, num_qo_heads, splits, head_dim), lse[:n].view(batch, num_qo_heads, splits)

    def prepare(self, plan: DecodePlan, options: DecodeOptions) -> None:
        """The kernel reads lengths and pages from device memory: nothing to prepare for them. An eager plan
        (``options.static`` False) of the GPU's default TMA kernel decodes with the cp.async kernel instead
        (``eager_config``)."""
        st = plan.backend_state
        if not options.static and self.decode_config is None and self.kernel is None:
            st.config = eager_config(st.config)

    def refresh(self, plan: DecodePlan, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Nothing on the host before a replay (see the module docstring)."""

    def _warm_eager(self, layer: LayerKV, table: torch.Tensor, lens: torch.Tensor, q: torch.Tensor,
                    sm_scale: float) -> None:
        """Where eager plans launch another kernel than captured ones (``eager_config``): that one too, once."""
        if self.decode_config is not None or self.kernel is not None:
            return  # a config or kernel given: every plan launches it
        plan = self.plan(table, lens, q.shape[1], layer.num_kv_heads, layer.head_dim, layer.page_size)
        eager = eager_config(plan.backend_state.config)
        if eager != plan.backend_state.config:
            plan.backend_state.config = eager
            self.decode(plan, q, layer, sm_scale)

    def warm(self, layer: LayerKV, shapes: list[tuple[int, int]], num_qo_heads: int,
             q_dtype: torch.dtype, sm_scale: float, fill_page: int) -> int:
        """Run every shape once, so that no serving step waits for a first-use compile (with a ``target`` on CPU
        tensors too: ``nvfp4-serve warm-cache`` compiles for that GPU, launching nothing). The decode kernel does
        not specialize on what follows a plan's shape (``nvfp4_decode.PLAN_INTS``), so all shapes share one
        compile of it: the first shape compiles it (about a second), the rest only launch; the merge compiles
        once per split tile its plans take (``merge_tile``: four at D 128). Running them all keeps that true where
        a shape would specialize after all (a variant compiled here rather than mid-serving, where it stalled
        every running request)."""
        if (layer.k.device.type != "cuda" and self.target is None) or not shapes:
            return 0
        dev = layer.k.device
        most = max(b * w for b, w in shapes)
        table_flat = torch.full((most,), fill_page, dtype=torch.int32, device=dev)
        lens = torch.ones(max(b for b, _ in shapes), dtype=torch.int32, device=dev)
        q = torch.zeros(lens.numel(), num_qo_heads, layer.head_dim, dtype=q_dtype, device=dev)
        for b, w in shapes:
            table = table_flat[: b * w].view(b, w)  # contiguous: the row stride a captured table has
            plan = self.plan(table, lens[:b], num_qo_heads, layer.num_kv_heads, layer.head_dim, layer.page_size)
            self.decode(plan, q[:b], layer, sm_scale)
        b, w = shapes[0]
        self._warm_eager(layer, table_flat[: b * w].view(b, w), lens[:b], q[:b], sm_scale)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return len(shapes)

    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        st = plan.backend_state
        if not isinstance(st, DecodeState):
            raise TypeError("decode needs a plan from TritonBackend.plan_decode")
        check_nvfp4_layer(layer)
        batch, hq, d = q.shape
        hk = layer.num_kv_heads
        if (hq, hk, d, layer.page_size) != (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size):
            raise ValueError(f"q {tuple(q.shape)} / layer (Hk={hk}, S={layer.page_size}) do not match the plan "
                             f"(Hq={plan.num_qo_heads}, Hk={plan.num_kv_heads}, D={plan.head_dim}, "
                             f"S={plan.page_size})")
        if q.dtype not in (torch.bfloat16, torch.float16) or q.stride(2) != 1 or batch != plan.page_table.shape[0]:
            raise ValueError(f"q must be bf16/fp16 [B={plan.page_table.shape[0]}, Hq, D] with a contiguous last dim,"
                             f" got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
        if st.config.kernel is DecodeKernel.GLUON_TMA:
            self._launch_gluon_tma(plan, q, layer, sm_scale)
        elif st.config.kernel is DecodeKernel.GLUON:
            self._launch_gluon(plan, q, layer, sm_scale)
        else:
            self._launch_triton(plan, q, layer, sm_scale)
        op, lse = st.o_part, st.lse_part
        out = torch.empty_like(q)
        tile = merge_tile(st.num_splits, d)
        merge_kernel[(batch, hq)](op, lse, out, st.num_splits, out.stride(0), out.stride(1), D=d, SPLIT_TILE=tile,
                                  num_warps=merge_warps(tile, d))
        return out

    @staticmethod
    def _kernel_args(plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float, fold: float) -> tuple:
        """The runtime arguments both decode kernels take, in their order (same contract, different tilings)."""
        st, pt = plan.backend_state, plan.page_table
        op, lse = st.o_part, st.lse_part
        return (q, layer.k.view(torch.int16), u8(layer.k_sf), layer.v.view(torch.int16), u8(layer.v_sf),
                pt, plan.seq_lens, op, lse,
                float(sm_scale) * float(layer.k_scale) * fold * _LOG2E, float(layer.v_scale) * fold,
                q.stride(0), q.stride(1), pt.stride(0),
                op.stride(0), op.stride(1), op.stride(2), lse.stride(0), lse.stride(1), st.chunk_tokens)

    def _launch_triton(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> None:
        st, (batch, hq, d), hk = plan.backend_state, q.shape, layer.num_kv_heads
        mode = self.target.e2m1_mode if self.target is not None else e2m1_mode(q.device)
        cfg = st.config
        group = hq // hk
        nvfp4_decode_kernel[(hk, st.num_splits, batch)](
            *self._kernel_args(plan, q, layer, sm_scale, e2m1_fold(mode)),
            HK=hk, G=group, GP=max(16, triton.next_power_of_2(group)), D=d, PAGE=layer.page_size,
            NW=cfg.num_warps, BW=cfg.block_w, MODE=mode, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **cfg.launch_options)

    def kernel_for(self, head_dim: int, group: int, device: torch.device, *, num_kv_heads: int, page_size: int) -> str:
        """``<part>:<config label>`` of the decodes this part plans for ``head_dim``, ``group`` and a pool of
        ``num_kv_heads`` heads in ``page_size`` pages on ``device``."""
        cfg = self.decode_config or default_decode_config(head_dim, self._capability(device), group, self.kernel,
                                                          num_kv_heads=num_kv_heads, page_size=page_size,
                                                          lean_step=self._lean_step(device))
        return f"{self.name}:{cfg.label}"

    def _lean_step(self, dev: torch.device) -> bool:
        """Whether the TMA decode runs its lean step: the target's setting, else by the GPU's name."""
        if self.target is not None:
            return self.target.lean_step
        return dev.type == "cuda" and prefers_lean_step(torch.cuda.get_device_name(dev))

    def _capability(self, dev: torch.device) -> tuple[int, int] | None:
        """The target's compute capability, else that of ``dev``'s GPU; None for CPU tensors without a target."""
        if self.target is not None:
            return self.target.capability
        return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None

    def _gluon_checked(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV) -> None:
        """ValueError unless the plan's Gluon kernel can decode ``layer`` on ``q``'s device."""
        kernel, cfg = plan.backend_state.config.kernel, plan.backend_state.config
        why = kernel_unfit(kernel, q.shape[2], self._capability(q.device), layer.num_kv_heads, layer.page_size,
                           cfg.block_w)
        if why is None and cfg.head_group != 1 and (q.shape[2] != 128 or layer.num_kv_heads % cfg.head_group):
            why = (f"the grouped TMA decode (head_group {cfg.head_group}) needs head_dim 128 and KV heads a multiple "
                   f"of {cfg.head_group}, got head_dim {q.shape[2]} and {layer.num_kv_heads} KV heads")
        if why is not None:
            raise ValueError(f"the Gluon NVFP4 decode cannot run here: {why} (use DecodeKernel.TRITON)")

    def _launch_gluon(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> None:
        """The Gluon kernel's software E2M1 decode runs on sm_89+ (its scales use cvt.rn.f16x2.e4m3x2)."""
        from nvfp4_kernels.triton.nvfp4_decode_gluon import nvfp4_decode_gluon_kernel

        self._gluon_checked(plan, q, layer)
        st, (batch, hq, d), hk = plan.backend_state, q.shape, layer.num_kv_heads
        nvfp4_decode_gluon_kernel[(hk, st.num_splits, batch)](
            *self._kernel_args(plan, q, layer, sm_scale, e2m1_fold(1)),
            HK=hk, G=hq // hk, GN=max(8, triton.next_power_of_2(hq // hk)), D=d, PAGE=layer.page_size,
            BT=st.config.block_w, STAGES=st.config.num_stages, num_warps=1, **st.config.launch_options)

    def _launch_gluon_tma(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> None:
        """The TMA-fed Gluon kernel: the pool's four parts as tensor maps (``tma_views``), the rest as the
        cp.async kernel takes it, and ``oob_row`` (a row past the pool: TMA reads zeros there)."""
        from nvfp4_kernels.triton.nvfp4_decode_tma import nvfp4_decode_tma_kernel

        self._gluon_checked(plan, q, layer)
        st, (batch, hq, d), hk = plan.backend_state, q.shape, layer.num_kv_heads
        page, cfg = layer.page_size, st.config
        args = list(self._kernel_args(plan, q, layer, sm_scale, e2m1_fold(1)))
        gn = max(8, triton.next_power_of_2(hq // hk))
        if cfg.head_group != 1:  # one CTA per 4 KV heads: a copy partition (4 warps) and a warp per head
            from nvfp4_kernels.triton.nvfp4_decode_tma_grouped import nvfp4_decode_tma_grouped_kernel

            args[1:5] = tma_views(layer, cfg.head_group)
            nvfp4_decode_tma_grouped_kernel[(hk // cfg.head_group, st.num_splits, batch)](
                *args, layer.k.shape[0] * page, HK=hk, G=hq // hk, GN=gn, D=d, PAGE=page, NPG=cfg.block_w // page,
                STAGES=cfg.num_stages, LEAN=cfg.lean, num_warps=4, **cfg.launch_options)
            return
        args[1:5] = tma_views(layer)
        nvfp4_decode_tma_kernel[(hk, st.num_splits, batch)](
            *args, layer.k.shape[0] * page, HK=hk, G=hq // hk, GN=gn, D=d,
            PAGE=page, NPG=cfg.block_w // page, STAGES=cfg.num_stages, SW=max(16, d // 16), LEAN=cfg.lean, num_warps=1,
            **cfg.launch_options)


def tma_views(layer: LayerKV, head_group: int = 1) -> tuple:
    """K codes, K scales, V codes, V scales of an NVFP4 pool as Gluon tensor descriptors, in the TMA kernel's
    argument order. Codes: [P*PAGE, HK*D/4] int16, box [PAGE, D/4], the shared layout ldmatrix reads without bank
    conflicts (swizzled by the row's width). Scales: [P*PAGE, HK*D/16] uint8, box [PAGE, max(16, D/16)] (a TMA
    box row is 16 bytes at least; the kernel reads its head's bytes inside it), or [PAGE, head_group*D/16] for the
    grouped kernel (its heads' scales together), unswizzled."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    page, hk, d = layer.page_size, layer.num_kv_heads, layer.head_dim
    rows, dw, ns = layer.k.shape[0] * page, d // 4, d // 16
    for t in (layer.k, layer.v, layer.k_sf, layer.v_sf):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("the TMA decode needs contiguous, 16-byte aligned pool tensors")
    codes_layout = gl.NVMMASharedLayout.get_default_for([page, dw], gl.int16)
    scales_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)

    def codes(t: torch.Tensor):
        return TensorDescriptor(t.view(torch.int16).view(rows, hk * dw), [rows, hk * dw], [hk * dw, 1], [page, dw],
                                codes_layout)

    def scales(t: torch.Tensor):
        return TensorDescriptor(u8(t).view(rows, hk * ns), [rows, hk * ns], [hk * ns, 1],
                                [page, max(16, ns * head_group)], scales_layout)

    return codes(layer.k), scales(layer.k_sf), codes(layer.v), scales(layer.v_sf)
