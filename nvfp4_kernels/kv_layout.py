"""One layer of the paged KV cache as the kernels see it (storage only, no allocation logic).

Page layout per layer (P pages of S tokens, Hk KV heads, head_dim D):

    kv_dtype   k / v                                   k_sf / v_sf (block scales)
    bf16       [P, S, Hk, D]    bfloat16               None
    fp8_e4m3   [P, S, Hk, D]    float8_e4m3fn          None
    nvfp4      [P, S, Hk, D/2]  uint8 (2 E2M1 codes,   [P, S, Hk, D/16] float8_e4m3fn
                                even element low nibble)

A token's slot is ``page_id * S + offset``; flattening the first two dims of any tensor
above gives a per-slot view ``[P*S, ...]``.

Scales (FP32, one per layer):
    k_scale / v_scale         the pool format's global scale: NVFP4 global scale for nvfp4,
                              the FP8 per-tensor scale for fp8_e4m3, unused (1.0) for bf16.
    ws_k_scale / ws_v_scale   the FP8 scale used for prefill/extend attention (the shared FP8
                              workspace). For fp8_e4m3 pools it equals k_scale/v_scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = ("bf16", "fp8_e4m3", "nvfp4")


@dataclass
class LayerKV:
    kv_dtype: str
    page_size: int
    num_kv_heads: int
    head_dim: int
    k: torch.Tensor
    v: torch.Tensor
    k_sf: torch.Tensor | None
    v_sf: torch.Tensor | None
    k_scale: float = 1.0
    v_scale: float = 1.0
    ws_k_scale: float = 1.0
    ws_v_scale: float = 1.0

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def workspace_dtype(self) -> torch.dtype:
        """dtype of the prefill/extend attention K/V for this cache dtype."""
        return torch.bfloat16 if self.kv_dtype == "bf16" else torch.float8_e4m3fn


def bytes_per_token_per_layer(kv_dtype: str, num_kv_heads: int, head_dim: int) -> int:
    """K and V bytes one token occupies in one layer of the pool."""
    if kv_dtype == "bf16":
        return 2 * num_kv_heads * head_dim * 2
    if kv_dtype == "fp8_e4m3":
        return 2 * num_kv_heads * head_dim
    if kv_dtype == "nvfp4":
        return 2 * num_kv_heads * (head_dim // 2 + head_dim // 16)
    raise ValueError(f"unknown kv dtype {kv_dtype!r}; choose one of {KV_DTYPES}")
