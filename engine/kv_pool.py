"""The paged KV pool: per-layer storage (``nvfp4_kernels.kv_layout.LayerKV``), capacity and page transfer.

Storage per layer (P pages of S tokens, Hk KV heads, head_dim D; see ``nvfp4_kernels/kv_layout.py``):

    bf16       k, v  [P, S, Hk, D]    bfloat16
    fp8_e4m3   k, v  [P, S, Hk, D]    float8_e4m3fn
    nvfp4      k, v  [P, S, Hk, D/2]  uint8 (packed E2M1)   k_sf, v_sf [P, S, Hk, D/16] float8_e4m3fn

A token at position ``pos`` of a sequence with page table ``pt`` lives in slot
``pt[pos // S] * S + pos % S``. The pool owns bytes only; which pages are in use is the
business of ``engine.page_allocator`` (page ids here are the allocator's ids).

Transfer payloads carry the raw bytes of whole pages in page-table order, each tensor as
``[n, S, Hk, X]`` contiguous: bytes per page and layer = S * (K + V incl. block scales).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from nvfp4_kernels.kv_layout import KV_DTYPES, LayerKV, bytes_per_token_per_layer

_STORAGE_DTYPE = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "nvfp4": torch.uint8}


class PoolCapacity(NamedTuple):
    """What the pool holds: reported at startup and by /server_info."""

    kv_dtype: str
    num_pages: int
    page_size: int
    max_tokens: int
    total_bytes: int
    bytes_per_token: int  # all layers, K + V + block scales


class PagePayload(NamedTuple):
    """Raw bytes of some pages of one layer, pages in page-table order; scales empty unless nvfp4."""

    k: bytes
    k_sf: bytes
    v: bytes
    v_sf: bytes

    @property
    def num_bytes(self) -> int:
        return len(self.k) + len(self.k_sf) + len(self.v) + len(self.v_sf)


def validate_geometry(kv_dtype: str, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise ValueError (saying which flag or model property to change) for an impossible pool shape."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1 (got {page_size}); set --page-size to a positive number")
    if num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(
            f"KV pool needs num_layers, num_kv_heads, head_dim >= 1 (got {num_layers}, {num_kv_heads}, "
            f"{head_dim}); check the model config"
        )
    if kv_dtype == "nvfp4" and head_dim % 16 != 0:
        raise ValueError(
            f"--kv-cache-dtype nvfp4 needs head_dim divisible by 16 (model has {head_dim}); "
            "use --kv-cache-dtype fp8_e4m3 or bf16 for this model"
        )


def slots_for(
    page_ids: Sequence[int] | torch.Tensor, start: int, end: int, page_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Pool slots of token positions ``[start, end)`` of a sequence with page table ``page_ids``.

    ``slot = page_ids[pos // page_size] * page_size + pos % page_size``; returns int64 ``[end - start]``
    on ``device`` (default: that of ``page_ids`` if a tensor, else CPU).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1 (got {page_size})")
    pt = page_ids if isinstance(page_ids, torch.Tensor) else torch.tensor(list(page_ids), dtype=torch.int64)
    if not 0 <= start <= end <= pt.numel() * page_size:
        raise ValueError(
            f"positions [{start}, {end}) are not covered by a page table of {pt.numel()} pages "
            f"of {page_size} tokens"
        )
    pos = torch.arange(start, end, dtype=torch.int64, device=pt.device)
    slots = pt.to(torch.int64)[pos // page_size] * page_size + pos % page_size
    return slots if device is None else slots.to(device)


class KVPool:
    """Paged K/V storage of every layer in one KV dtype; page ids come from ``PageAllocator``.

    Tensors are allocated with ``torch.empty``: a page's content is undefined until written
    (``poison`` fills the pool with NaN-like bytes to catch reads of unwritten slots in tests).
    """

    def __init__(
        self,
        kv_dtype: str,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
        ws_k_scales: Sequence[float] | None = None,
        ws_v_scales: Sequence[float] | None = None,
        scratch_pages: int = 0,
    ) -> None:
        validate_geometry(kv_dtype, num_layers, page_size, num_kv_heads, head_dim)
        if num_pages < 1:
            raise ValueError(
                f"KV pool needs at least 1 page (got {num_pages}); raise --mem-fraction-static or "
                "--max-total-tokens, or lower --page-size"
            )
        k_scales = _layer_scales("k_scales", k_scales, num_layers)
        v_scales = _layer_scales("v_scales", v_scales, num_layers)
        default_ws = kv_dtype == "fp8_e4m3"
        ws_k = _layer_scales("ws_k_scales", ws_k_scales, num_layers, k_scales if default_ws else None)
        ws_v = _layer_scales("ws_v_scales", ws_v_scales, num_layers, v_scales if default_ws else None)
        if kv_dtype == "fp8_e4m3" and (ws_k != k_scales or ws_v != v_scales):
            raise ValueError(
                "an fp8_e4m3 pool is its own FP8 workspace: ws_k_scales/ws_v_scales must equal "
                "k_scales/v_scales (leave them unset)"
            )

        self.kv_dtype = kv_dtype
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        if scratch_pages < 0:
            raise ValueError(f"scratch_pages must be >= 0, got {scratch_pages}")
        # Pages [num_pages, num_pages + scratch_pages) exist in the tensors but never in the allocator:
        # padded rows of a captured decode batch write and read them, so no real page is touched.
        self.scratch_pages = scratch_pages

        dtype = _STORAGE_DTYPE[kv_dtype]
        d = head_dim // 2 if kv_dtype == "nvfp4" else head_dim
        total = num_pages + scratch_pages
        shape = (total, page_size, num_kv_heads, d)
        sf_shape = (total, page_size, num_kv_heads, head_dim // 16)
        self.layers: list[LayerKV] = []
        for i in range(num_layers):
            sf = kv_dtype == "nvfp4"
            self.layers.append(LayerKV(
                kv_dtype=kv_dtype, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                k=torch.empty(shape, dtype=dtype, device=self.device),
                v=torch.empty(shape, dtype=dtype, device=self.device),
                k_sf=torch.empty(sf_shape, dtype=torch.float8_e4m3fn, device=self.device) if sf else None,
                v_sf=torch.empty(sf_shape, dtype=torch.float8_e4m3fn, device=self.device) if sf else None,
                k_scale=k_scales[i], v_scale=v_scales[i], ws_k_scale=ws_k[i], ws_v_scale=ws_v[i],
            ))

    @property
    def scratch_page(self) -> int:
        """The first scratch page id (never allocated); only valid when ``scratch_pages > 0``."""
        if not self.scratch_pages:
            raise ValueError("this pool was built without scratch pages")
        return self.num_pages

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """K + V (+ block scales) bytes of one token over all layers."""
        return self.num_layers * bytes_per_token_per_layer(self.kv_dtype, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page of one layer: K + V, block scales included."""
        return self.page_size * bytes_per_token_per_layer(self.kv_dtype, self.num_kv_heads, self.head_dim)

    def capacity(self) -> PoolCapacity:
        return PoolCapacity(
            kv_dtype=self.kv_dtype, num_pages=self.num_pages, page_size=self.page_size,
            max_tokens=self.num_pages * self.page_size,
            total_bytes=self.num_pages * self.page_size * self.bytes_per_token,
            bytes_per_token=self.bytes_per_token,
        )

    @staticmethod
    def num_pages_for_budget(
        budget_bytes: int, kv_dtype: str, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
    ) -> int:
        """Most whole pages (all layers, K + V + scales) that fit in ``budget_bytes``; may be 0."""
        validate_geometry(kv_dtype, num_layers, page_size, num_kv_heads, head_dim)
        page_bytes = num_layers * page_size * bytes_per_token_per_layer(kv_dtype, num_kv_heads, head_dim)
        return max(0, int(budget_bytes) // page_bytes)

    # -- slots -----------------------------------------------------------------------------------
    def slots_for(
        self, page_ids: Sequence[int] | torch.Tensor, start: int, end: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """``slots_for`` with this pool's page size (CPU for list page tables: batch, then move once)."""
        return slots_for(page_ids, start, end, self.page_size, device=device)

    # -- transfer --------------------------------------------------------------------------------
    def export_pages(self, layer: int, page_ids: Sequence[int]) -> PagePayload:
        """Raw bytes of pages ``page_ids`` (in that order) of layer ``layer``. Reads only."""
        lkv = self._layer(layer)
        idx = self._page_index(page_ids)
        parts = [_page_bytes(t, idx) if t is not None else b"" for t in (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf)]
        return PagePayload(*parts)

    def import_pages(self, layer: int, page_ids: Sequence[int], payload: PagePayload) -> None:
        """MUTATES: write ``payload`` (as from ``export_pages``) into pages ``page_ids`` of ``layer``.

        Validates every part's size (ValueError: expected vs got) before writing anything.
        """
        lkv = self._layer(layer)
        idx = self._page_index(page_ids)
        if len(set(idx.tolist())) != idx.numel():
            raise ValueError(f"import_pages got repeated page ids {list(page_ids)}; each page is written once")
        tensors = (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf)
        names = ("k", "k_sf", "v", "v_sf")
        for name, t, data in zip(names, tensors, payload, strict=True):
            expected = 0 if t is None else idx.numel() * _bytes_per_page(t)
            if len(data) != expected:
                raise ValueError(
                    f"layer {layer} payload part {name!r} for {idx.numel()} {self.kv_dtype} pages: "
                    f"expected {expected} bytes, got {len(data)}"
                )
        for t, data in zip(tensors, payload, strict=True):
            if t is None or idx.numel() == 0:
                continue
            raw = t.view(torch.uint8)
            src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(idx.numel(), *raw.shape[1:])
            raw.index_copy_(0, idx, src.to(raw.device))

    # -- test helper -------------------------------------------------------------------------------
    def poison(self, byte: int = 0xFF) -> None:
        """MUTATES: fill every byte of every layer with ``byte`` (0xFF reads as NaN in bf16/fp8 scales)."""
        for lkv in self.layers:
            for t in (lkv.k, lkv.v, lkv.k_sf, lkv.v_sf):
                if t is not None:
                    t.view(torch.uint8).fill_(byte)

    # -- helpers ---------------------------------------------------------------------------------
    def _layer(self, layer: int) -> LayerKV:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the pool has layers 0..{self.num_layers - 1}")
        return self.layers[layer]

    def _page_index(self, page_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(p) for p in page_ids]
        bad = [p for p in ids if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:16]} outside the pool (0..{self.num_pages - 1})")
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def __repr__(self) -> str:
        c = self.capacity()
        return (f"KVPool({c.kv_dtype}, {self.num_layers} layers, {c.num_pages} pages x {c.page_size} tokens, "
                f"{c.total_bytes / 2**30:.2f} GiB)")


def _bytes_per_page(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _page_bytes(t: torch.Tensor, idx: torch.Tensor) -> bytes:
    """Bytes of pages ``idx`` of a ``[P, ...]`` tensor, pages concatenated in ``idx`` order."""
    if idx.numel() == 0:
        return b""
    return t.view(torch.uint8).index_select(0, idx).cpu().numpy().tobytes()


def _layer_scales(
    name: str, scales: Sequence[float] | None, num_layers: int, default: list[float] | None = None,
) -> list[float]:
    if scales is None:
        return list(default) if default is not None else [1.0] * num_layers
    out = [float(s) for s in scales]
    if len(out) != num_layers:
        raise ValueError(f"{name} has {len(out)} entries but the model has {num_layers} layers; give one per layer")
    bad = [(i, s) for i, s in enumerate(out) if not (math.isfinite(s) and s > 0)]
    if bad:
        raise ValueError(f"{name} must be finite and > 0; layer {bad[0][0]} has {bad[0][1]}; fix the scales file")
    return out
