"""The attention-backend interface: plan once per batch, run once per layer.

Every backend implements the same four operations on one pool layer (``LayerKV``):

  write_kv          quantize-on-write: fresh K/V rows -> pool slots (pool dtype)
  gather_workspace  pool pages -> rows of the shared workspace (FP8 for fp8/nvfp4, BF16 for bf16)
  prefill           ragged causal attention of BF16 queries over workspace-dtype K/V
  decode            one query token per sequence over its pages, read straight from the pool

Token regions of one sequence in ``prefill`` (bottom-right aligned causal mask):

    kv rows   [ cached prefix ........ | this chunk ]    kv_len = prefix_len + q_len
    q rows                             [ this chunk ]    query j sees kv rows <= prefix_len + j
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from nvfp4_kernels.kv_layout import LayerKV


@dataclass
class PrefillPlan:
    """Ragged batch of sequences for ``prefill``; indptr tensors are int32 on the device."""

    qo_indptr: torch.Tensor  # [B+1] query rows of sequence i: qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [B+1] kv rows of sequence i: kv_indptr[i]:kv_indptr[i+1]
    qo_lens: list[int]
    kv_lens: list[int]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    backend_state: object = None


@dataclass
class DecodePlan:
    """One query token per sequence; the token's own K/V is already written to the pool."""

    page_table: torch.Tensor  # [B, max_pages] int32 page ids (entries past the sequence unused)
    seq_lens: torch.Tensor  # [B] int32 tokens in the cache, current token included
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    backend_state: object = None


@dataclass(frozen=True)
class DecodeOptions:
    """What a decode plan may prepare ahead: the pool dtype, the query dtype and sm_scale of every layer,
    and ``static``: the plan's buffers stay fixed and ``decode`` launches a fixed geometry, so the forward
    can be captured in a CUDA graph and replayed after ``refresh_decode_plan``."""

    kv_dtype: str
    q_dtype: torch.dtype
    sm_scale: float
    static: bool = False


class AttentionBackend(ABC):
    name: str = "abstract"

    # -- planning (once per batch) ------------------------------------------------------
    def plan_prefill(
        self, qo_lens: list[int], kv_lens: list[int], num_qo_heads: int, num_kv_heads: int,
        head_dim: int, device: torch.device,
    ) -> PrefillPlan:
        if len(qo_lens) != len(kv_lens) or any(q > k for q, k in zip(qo_lens, kv_lens)):
            raise ValueError(f"bad prefill plan: qo_lens={qo_lens} kv_lens={kv_lens}")
        qo = torch.tensor([0, *qo_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        kv = torch.tensor([0, *kv_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        return PrefillPlan(qo.to(device), kv.to(device), list(qo_lens), list(kv_lens),
                           num_qo_heads, num_kv_heads, head_dim)

    def plan_decode(
        self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, *, options: DecodeOptions | None = None,
    ) -> DecodePlan:
        return DecodePlan(page_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size)

    def refresh_decode_plan(self, plan: DecodePlan, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Before replaying a decode captured from a ``static`` plan: host-side work for this step's pages and
        lengths (the same values already copied into ``plan.page_table`` / ``plan.seq_lens``). Default: none,
        the decode reads everything from device memory."""

    def decode_kernel(self, kv_dtype: str, head_dim: int, group: int, device: torch.device, *, num_kv_heads: int,
                      page_size: int) -> str:
        """The decode kernel a pool of ``kv_dtype`` (``num_kv_heads`` heads, ``page_size`` pages) runs on ``device``
        for ``group`` query heads per KV head (reported in /server_info). Default: the backend's name."""
        return self.name

    def warm_decode(self, layer: LayerKV, shapes: list[tuple[int, int]], num_qo_heads: int,
                    q_dtype: torch.dtype, sm_scale: float, fill_page: int) -> int:
        """Compile, ahead of serving, whatever ``decode`` would compile on first use for plans of these
        (batch, page-table width) shapes: tables full of ``fill_page`` (a page no request owns), one-token rows,
        so only that page is read. Returns the number of shapes run; default 0 (nothing is compiled per shape)."""
        return 0

    # -- per layer ---------------------------------------------------------------------------
    @abstractmethod
    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """pool[slots] = quantize(k), quantize(v); k, v [T, Hk, D] (bf16/fp16/fp32), slots [T] int64."""

    @abstractmethod
    def gather_workspace(
        self, layer: LayerKV, slots: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor
    ) -> None:
        """ws_k[i] = to_workspace(dequant(pool.k[slots[i]])) for i < len(slots), same for V.

        Workspace dtype is ``layer.workspace_dtype``; FP8 rows are value / ws_scale with a
        saturating cast (nvfp4_kernels.fp8.quantize). For an fp8 pool with ws scale == k_scale this
        is a plain copy of the stored bytes.
        """

    @abstractmethod
    def prefill(
        self, plan: PrefillPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_scale: float, v_scale: float, sm_scale: float,
    ) -> torch.Tensor:
        """out[t,h] = softmax(q[t,h] · K^T * sm_scale, causal) · V over the rows of t's sequence.

        q [Tq, Hq, D] bf16; k, v [Tkv, Hk, D] in bf16 (scales ignored) or float8_e4m3fn
        (real value = stored * scale). Returns [Tq, Hq, D] in q.dtype.
        """

    @abstractmethod
    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        """out[b,h] = softmax(q[b,h] · K[b]^T * sm_scale) · V[b], K/V read from the pool pages.

        q [B, Hq, D]; returns [B, Hq, D] in q.dtype. Never materialises a dequantized cache.
        """
