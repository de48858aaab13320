"""A cache-free reference of the three attention paths' numerics, for engine tests.

It recomputes each forward from the ORIGINAL (unrounded) K/V history of every sequence and applies
the rounding each path implies:

    seen as ...                          bf16 cache       fp8_e4m3 cache      nvfp4 cache
    prefix of an extend (from the pool)  bf16(k)          fp8(k)              fp8(nvfp4(k))
    this chunk's own rows (workspace)    bf16(k)          fp8(k)              fp8(k)
    decode (pool pages)                  bf16(k)          fp8(k)              nvfp4(k)
"""

from __future__ import annotations

import torch

from nvfp4_kernels import fp8, nvfp4


def _rt_pool(x: torch.Tensor, kv_dtype: str, scale: float) -> torch.Tensor:
    if kv_dtype == "bf16":
        return x.to(torch.bfloat16).float()
    if kv_dtype == "fp8_e4m3":
        return fp8.dequantize(fp8.quantize(x, scale), scale)
    d, s = nvfp4.quantize(x, scale)
    return nvfp4.dequantize(d, s, scale)


def _rt_ws(x: torch.Tensor, kv_dtype: str, scale: float) -> torch.Tensor:
    if kv_dtype == "bf16":
        return x.to(torch.bfloat16).float()
    return fp8.dequantize(fp8.quantize(x, scale), scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal_offset: int) -> torch.Tensor:
    hq, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    qi = torch.arange(q.shape[0])[:, None] + causal_offset
    ki = torch.arange(k.shape[0])[None, :]
    s = s.masked_fill(ki > qi, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class PathReference:
    """Runs one sequence through the model chunk by chunk, then token by token, without a pool."""

    def __init__(self, model, kv_dtype: str, k_scale: float = 1.0, v_scale: float = 1.0):
        self.model, self.kv_dtype = model, kv_dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k_hist: dict[int, torch.Tensor] = {}
        self.v_hist: dict[int, torch.Tensor] = {}
        self.sm_scale = model.config.head_dim ** -0.5
        # the FP8 workspace of an fp8 cache holds the pool's own bytes; other caches use scale 1.0
        self.ws_k_scale = k_scale if kv_dtype == "fp8_e4m3" else 1.0
        self.ws_v_scale = v_scale if kv_dtype == "fp8_e4m3" else 1.0

    def _run(self, ids: list[int], start: int, decode: bool) -> torch.Tensor:
        kd = self.kv_dtype

        def attn(layer: int, q, k, v):
            kp = self.k_hist.get(layer, k.new_zeros((0, *k.shape[1:])).float())
            vp = self.v_hist.get(layer, v.new_zeros((0, *v.shape[1:])).float())
            if decode:
                kk = torch.cat([_rt_pool(kp, kd, self.k_scale), _rt_pool(k.float(), kd, self.k_scale)])
                vv = torch.cat([_rt_pool(vp, kd, self.v_scale), _rt_pool(v.float(), kd, self.v_scale)])
            else:
                ks, vs = self.ws_k_scale, self.ws_v_scale
                kk = torch.cat([_rt_ws(_rt_pool(kp, kd, self.k_scale), kd, ks), _rt_ws(k.float(), kd, ks)])
                vv = torch.cat([_rt_ws(_rt_pool(vp, kd, self.v_scale), kd, vs), _rt_ws(v.float(), kd, vs)])
            self.k_hist[layer] = torch.cat([kp, k.float()])
            self.v_hist[layer] = torch.cat([vp, v.float()])
            return _attend(q, kk, vv, self.sm_scale, kp.shape[0]).to(q.dtype)

        ids_t = torch.tensor(ids, dtype=torch.long)
        pos = torch.arange(start, start + len(ids), dtype=torch.long)
        with torch.inference_mode():
            hidden = self.model(ids_t, pos, attn)
            return self.model.compute_logits(hidden[-1:])[0]

    def greedy(self, prompt: list[int], max_tokens: int, chunk_size: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens and the logits that chose each of them."""
        logits = None
        for s in range(0, len(prompt), chunk_size):
            logits = self._run(prompt[s:s + chunk_size], s, decode=False)
        out, all_logits = [], []
        for _ in range(max_tokens):
            all_logits.append(logits)
            out.append(int(logits.argmax()))
            logits = self._run([out[-1]], len(prompt) + len(out) - 1, decode=True)
        return out, all_logits
