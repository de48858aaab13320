"""A backend whose decode attention is replaced by one small kernel, for timing the rest of a decode step directly.

``graph step - attention alone`` is the difference of two large, separately timed figures: at 44 x 32K the
attention is ~90% of the step, so a 1% change in it moves that difference by ~0.15x of the floor. The step run
through this stand-in keeps every other kernel of the step as it is (projections, norms, RoPE, the K/V write
into the pool, logits) and puts one kernel where the attention ran, writing the output's shape: the same number
of kernel boundaries per layer, none of the attention's reads. The attention's own planning goes with it (its
host work and its small copies of the page lists), and nothing of it is compiled: FlashInfer is never loaded."""

from __future__ import annotations

import torch


class AttentionStandIn:
    """``backend`` (every method and attribute its own: the K/V write, the prefill) except the decode: its plans
    carry no attention state (``plan_decode`` without options, nothing to refresh or warm) and ``decode`` returns
    zeros shaped as its output [B, Hq, D] in q's dtype: one fill kernel, no read of the pool."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def plan_decode(self, page_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size, *, options=None):
        return self._backend.plan_decode(page_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size)

    def refresh_decode_plan(self, plan, page_table, seq_lens) -> None:
        return None

    def warm_decode(self, *args, **kwargs) -> int:
        return 0

    def decode(self, plan, q: torch.Tensor, layer, sm_scale: float) -> torch.Tensor:
        return torch.zeros_like(q)
