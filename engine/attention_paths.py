"""The three attention paths over one paged pool, exposed to the model as an ``AttnFn``.

1. initial prefill and 2. chunked prefill / extend share one code path: every layer assembles its
   attention K/V in ONE pair of workspace buffers (FP8 for fp8/nvfp4 caches, BF16 for bf16)
   shared by all layers, then runs ragged causal attention over it:

       workspace rows of sequence i (kv_start = sum of earlier sequences' kv_len)
       [ prefix: gathered from the pool (dequantized) | chunk: this forward's K/V cast to FP8 ]
       kv_start                              kv_start + prefix_len          kv_start + kv_len

   With no cached prefix (path 1) the prefix region is empty, so attention reads nothing back from
   the pool. The chunk's K/V are quantized to the pool dtype from the UNROUNDED model K/V (one
   rounding, not FP8 then NVFP4).
3. decode: the chunk is one token per sequence; its K/V are written to the pool first, then the
   backend's decode kernel reads the pages directly.

With a KV rotation (``--kv-rotation``, engine/kv_rotation.py) the model hands every path rotated q, k and v and
takes the output rotated, so the workspace, the pool and every kernel only ever see rotated vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_pool import KVPool
from engine.model import AttnFn
from nvfp4_kernels import fp8
from nvfp4_kernels.backends.base import AttentionBackend, DecodeOptions, DecodePlan


@dataclass(frozen=True)
class ExtendSeq:
    """One sequence of an extend batch: K/V of tokens [prefix_len, prefix_len + extend_len) are new."""

    page_ids: Sequence[int]
    prefix_len: int
    extend_len: int

    @property
    def kv_len(self) -> int:
        return self.prefix_len + self.extend_len


class WorkspaceTooSmall(ValueError):
    pass


class AttentionPaths:
    def __init__(self, pool: KVPool, backend: AttentionBackend, workspace_tokens: int,
                 num_qo_heads: int, sm_scale: float, device: torch.device):
        first = pool.layers[0]
        self.pool = pool
        self.backend = backend
        self.workspace_tokens = workspace_tokens
        self.num_qo_heads = num_qo_heads
        self.sm_scale = sm_scale
        self.device = device
        shape = (workspace_tokens, first.num_kv_heads, first.head_dim)
        self.ws_k = torch.empty(shape, dtype=first.workspace_dtype, device=device)
        self.ws_v = torch.empty(shape, dtype=first.workspace_dtype, device=device)

    @property
    def workspace_bytes(self) -> int:
        return 2 * self.ws_k.numel() * self.ws_k.element_size()

    # -- paths 1 and 2 ------------------------------------------------------------------------
    def extend(self, seqs: Sequence[ExtendSeq]) -> AttnFn:
        """Plan an extend batch; the returned AttnFn runs it layer by layer."""
        total_kv = sum(s.kv_len for s in seqs)
        if total_kv > self.workspace_tokens:
            raise WorkspaceTooSmall(
                f"extend batch needs {total_kv} workspace rows, the workspace holds {self.workspace_tokens} "
                "(raise --workspace-tokens)")
        layer0 = self.pool.layers[0]
        plan = self.backend.plan_prefill([s.extend_len for s in seqs], [s.kv_len for s in seqs],
                                         self.num_qo_heads, layer0.num_kv_heads, layer0.head_dim, self.device)
        out_slots, prefix_slots, prefix_rows, chunk_rows = [], [], [], []
        kv_start = 0
        for s in seqs:
            out_slots.append(self.pool.slots_for(s.page_ids, s.prefix_len, s.kv_len))
            if s.prefix_len:
                prefix_slots.append(self.pool.slots_for(s.page_ids, 0, s.prefix_len))
                prefix_rows.append(torch.arange(kv_start, kv_start + s.prefix_len))
            chunk_rows.append(torch.arange(kv_start + s.prefix_len, kv_start + s.kv_len))
            kv_start += s.kv_len
        dev = self.device
        out_slots_t = torch.cat(out_slots).to(dev)
        chunk_rows_t = torch.cat(chunk_rows).to(dev)
        has_prefix = bool(prefix_slots)
        if has_prefix:
            prefix_slots_t = torch.cat(prefix_slots).to(dev)
            prefix_rows_t = torch.cat(prefix_rows).to(dev)
            contiguous_prefix = len(seqs) == 1
        ws_k, ws_v = self.ws_k[:total_kv], self.ws_v[:total_kv]

        def attn(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer = self.pool.layers[layer_id]
            self.backend.write_kv(layer, out_slots_t, k, v)
            if has_prefix:
                if contiguous_prefix:
                    n = prefix_slots_t.numel()
                    self.backend.gather_workspace(layer, prefix_slots_t, ws_k[:n], ws_v[:n])
                else:
                    gk = torch.empty((prefix_slots_t.numel(), *ws_k.shape[1:]), dtype=ws_k.dtype, device=dev)
                    gv = torch.empty_like(gk)
                    self.backend.gather_workspace(layer, prefix_slots_t, gk, gv)
                    ws_k[prefix_rows_t] = gk
                    ws_v[prefix_rows_t] = gv
            ws_k[chunk_rows_t] = self._to_workspace(k, layer.ws_k_scale)
            ws_v[chunk_rows_t] = self._to_workspace(v, layer.ws_v_scale)
            out = self.backend.prefill(plan, q, ws_k, ws_v, layer.ws_k_scale, layer.ws_v_scale, self.sm_scale)
            return out

        return attn

    def _to_workspace(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.ws_k.dtype == torch.bfloat16:
            return x.to(torch.bfloat16)
        return fp8.quantize(x, scale)

    # -- path 3 --------------------------------------------------------------------------------
    def plan_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, q_dtype: torch.dtype,
                    static: bool = False) -> DecodePlan:
        """Plan a decode batch: page_table [B, max_pages] int32, seq_lens [B] int32 (current token included).
        ``static``: fixed buffers for a captured forward (see ``AttentionBackend.refresh_decode_plan``)."""
        layer0 = self.pool.layers[0]
        opts = DecodeOptions(self.pool.kv_dtype, q_dtype, self.sm_scale, static)
        return self.backend.plan_decode(page_table, seq_lens, self.num_qo_heads, layer0.num_kv_heads,
                                        layer0.head_dim, layer0.page_size, options=opts)

    def decode_attn(self, plan: DecodePlan, out_slots: torch.Tensor) -> AttnFn:
        """The AttnFn of a planned decode batch; out_slots [B] int64 (where the current token's K/V go)."""
        def attn(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer = self.pool.layers[layer_id]
            self.backend.write_kv(layer, out_slots, k, v)
            return self.backend.decode(plan, q, layer, self.sm_scale)

        return attn

    def decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, out_slots: torch.Tensor,
               q_dtype: torch.dtype = torch.bfloat16) -> AttnFn:
        """``plan_decode`` + ``decode_attn`` for one eager decode forward."""
        return self.decode_attn(self.plan_decode(page_table, seq_lens, q_dtype), out_slots)
