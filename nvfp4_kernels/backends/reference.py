"""The reference attention backend: plain PyTorch (CPU or CUDA), fp32 math, clear rather than fast.

It is the spec the triton and flashinfer backends are tested against, and the CPU serving path.
Formats come from nvfp4_kernels.nvfp4 / nvfp4_kernels.fp8, so pool bytes written here are the contract bytes.

Slots address pool rows: ``slot = page_id * page_size + offset`` into the per-slot view
``pool.view(P * S, Hk, ...)``; a decode sequence of length L occupies, in order, the slots

    page_table[b, 0] * S + 0 .. S-1 | page_table[b, 1] * S + 0 .. S-1 | ... | last page: L - (n-1)*S rows
"""

from __future__ import annotations

import torch

from nvfp4_kernels import fp8, nvfp4
from nvfp4_kernels.backends.base import AttentionBackend, DecodePlan, PrefillPlan
from nvfp4_kernels.kv_layout import LayerKV


def _slot_view(t: torch.Tensor) -> torch.Tensor:
    """``[P, S, ...]`` pool tensor -> ``[P*S, ...]`` per-slot view (fp8 tensors as their uint8 bytes)."""
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_rows(layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    expect = (slots.shape[0], layer.num_kv_heads, layer.head_dim)
    if slots.dim() != 1 or tuple(k.shape) != expect or tuple(v.shape) != expect:
        raise ValueError(
            f"write_kv needs slots [T] and k, v [T, Hk={layer.num_kv_heads}, D={layer.head_dim}]; "
            f"got slots {tuple(slots.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def _dequant_rows(layer: LayerKV, slots: torch.Tensor, which: str) -> torch.Tensor:
    """Pool rows at ``slots`` of K (``which="k"``) or V, dequantized to fp32 ``[N, Hk, D]``."""
    data = _slot_view(getattr(layer, which))[slots]
    scale = layer.k_scale if which == "k" else layer.v_scale
    if layer.kv_dtype == "bf16":
        return data.float()
    if layer.kv_dtype == "fp8_e4m3":
        return fp8.dequantize(data, scale)
    if layer.kv_dtype == "nvfp4":
        sf = _slot_view(getattr(layer, f"{which}_sf"))[slots]
        return nvfp4.dequantize(data, sf, scale)
    raise ValueError(f"unknown kv dtype {layer.kv_dtype!r}")


def _to_fp32(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention input K/V -> fp32: fp8 carries ``real = stored * scale``; other dtypes are real values."""
    return fp8.dequantize(x, scale) if x.dtype == torch.float8_e4m3fn else x.float()


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
) -> torch.Tensor:
    """fp32 softmax attention of q [Q, Hq, D] over k, v [L, Hk, D]; GQA: q head h reads kv head h // (Hq/Hk).

    Causal is bottom-right aligned: query j sees kv rows <= L - Q + j.
    """
    num_q, num_qo_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_qo_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if causal:
        rows = torch.arange(num_q, device=q.device)[:, None] + (kv_len - num_q)
        cols = torch.arange(kv_len, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def _check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int, q: torch.Tensor) -> None:
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads != 0:
        raise ValueError(
            f"GQA needs num_qo_heads ({num_qo_heads}) to be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if q.dim() != 3 or tuple(q.shape[1:]) != (num_qo_heads, head_dim):
        raise ValueError(f"q must be [T, Hq={num_qo_heads}, D={head_dim}], got {tuple(q.shape)}")


class ReferenceBackend(AttentionBackend):
    """Plain-PyTorch attention over bf16 / fp8_e4m3 / nvfp4 pools; works on CPU and CUDA tensors."""

    name = "reference"

    def write_kv(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _check_rows(layer, slots, k, v)
        slots = slots.long()
        for which, x in (("k", k), ("v", v)):
            scale = layer.k_scale if which == "k" else layer.v_scale
            pool = _slot_view(getattr(layer, which))
            if layer.kv_dtype == "bf16":
                pool[slots] = x.to(torch.bfloat16)
            elif layer.kv_dtype == "fp8_e4m3":
                pool[slots] = _as_bytes(fp8.quantize(x, scale))
            elif layer.kv_dtype == "nvfp4":
                data, sf = nvfp4.quantize(x, scale)
                pool[slots] = data
                _slot_view(getattr(layer, f"{which}_sf"))[slots] = _as_bytes(sf)
            else:
                raise ValueError(f"unknown kv dtype {layer.kv_dtype!r}")

    def gather_workspace(
        self, layer: LayerKV, slots: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor
    ) -> None:
        n = slots.shape[0]
        slots = slots.long()
        for which, ws in (("k", ws_k), ("v", ws_v)):
            if ws.dtype != layer.workspace_dtype:
                raise ValueError(
                    f"{layer.kv_dtype} pools gather into a {layer.workspace_dtype} workspace, got {ws.dtype}"
                )
            if ws.shape[0] < n or tuple(ws.shape[1:]) != (layer.num_kv_heads, layer.head_dim):
                raise ValueError(
                    f"workspace {tuple(ws.shape)} cannot hold {n} rows of "
                    f"[Hk={layer.num_kv_heads}, D={layer.head_dim}]"
                )
            pool_scale = layer.k_scale if which == "k" else layer.v_scale
            ws_scale = layer.ws_k_scale if which == "k" else layer.ws_v_scale
            if layer.kv_dtype == "fp8_e4m3" and ws_scale == pool_scale:
                ws.view(torch.uint8)[:n] = _slot_view(getattr(layer, which))[slots]  # the stored bytes
                continue
            rows = _dequant_rows(layer, slots, which)
            if ws.dtype == torch.bfloat16:
                ws[:n] = rows.to(torch.bfloat16)
            else:
                ws.view(torch.uint8)[:n] = fp8.quantize(rows, ws_scale).view(torch.uint8)

    def prefill(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float,
        v_scale: float,
        sm_scale: float,
    ) -> torch.Tensor:
        _check_heads(plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, q)
        kv_shape = (sum(plan.kv_lens), plan.num_kv_heads, plan.head_dim)
        if q.shape[0] != sum(plan.qo_lens) or tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
            raise ValueError(
                f"prefill plan wants q [{sum(plan.qo_lens)}, ...] and k, v {list(kv_shape)}; got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        out = torch.empty_like(q)
        qo_start = kv_start = 0
        for qo_len, kv_len in zip(plan.qo_lens, plan.kv_lens, strict=True):
            if qo_len > 0:
                qs = q[qo_start : qo_start + qo_len].float()
                ks = _to_fp32(k[kv_start : kv_start + kv_len], k_scale)
                vs = _to_fp32(v[kv_start : kv_start + kv_len], v_scale)
                out[qo_start : qo_start + qo_len] = _attention(qs, ks, vs, sm_scale, causal=True).to(q.dtype)
            qo_start += qo_len
            kv_start += kv_len
        return out

    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        _check_heads(plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, q)
        if plan.page_size != layer.page_size or plan.num_kv_heads != layer.num_kv_heads:
            raise ValueError(
                f"decode plan (page_size={plan.page_size}, Hk={plan.num_kv_heads}) does not match "
                f"the pool layer (page_size={layer.page_size}, Hk={layer.num_kv_heads})"
            )
        size = layer.page_size
        seq_lens = plan.seq_lens.tolist()
        if q.shape[0] != len(seq_lens):
            raise ValueError(f"decode got {q.shape[0]} query rows for {len(seq_lens)} sequences")
        out = torch.empty_like(q)
        for b, seq_len in enumerate(seq_lens):
            if seq_len <= 0:
                raise ValueError(
                    f"decode sequence {b} has seq_len {seq_len}; it must include the current token"
                )
            pages = plan.page_table[b, : (seq_len + size - 1) // size].long()
            offsets = torch.arange(size, device=pages.device)
            slots = (pages[:, None] * size + offsets[None, :]).flatten()[:seq_len]
            # Reference only: dequantizes this sequence's rows; fused kernels keep them in registers.
            ks = _dequant_rows(layer, slots, "k")
            vs = _dequant_rows(layer, slots, "v")
            out[b] = _attention(q[b : b + 1].float(), ks, vs, sm_scale, causal=False)[0].to(q.dtype)
        return out
