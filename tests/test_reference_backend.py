"""The reference attention backend against a naive per-(token, head) float64 attention, on all three
KV dtypes: pool bytes after write_kv, workspace gathers, ragged causal prefill, paged decode."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_kernels import fp8, nvfp4
from nvfp4_kernels.backends.base import AttentionBackend
from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.backends.registry import get_backend
from nvfp4_kernels.kv_layout import KV_DTYPES, LayerKV

SCALES = {"bf16": (1.0, 1.0), "fp8_e4m3": (0.03, 0.05), "nvfp4": (0.004, 0.5)}  # (k_scale, v_scale)


def make_layer(
    kv_dtype: str,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    gen: torch.Generator,
    device: str = "cpu",
    ws_scales: tuple[float, float] | None = None,
) -> LayerKV:
    """A pool layer filled with garbage (NaN for bf16, random bytes incl. NaN codes for fp8) so that a
    backend reading a slot it did not write shows up in the output."""
    k_scale, v_scale = SCALES[kv_dtype]
    ws_k, ws_v = ws_scales if ws_scales is not None else (k_scale, v_scale)
    shape = (num_pages, page_size, num_kv_heads, head_dim)

    def garbage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bfloat16:
            return torch.full(shape, math.nan, dtype=dtype, device=device)
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
        return raw.view(dtype)

    if kv_dtype == "nvfp4":
        packed = (num_pages, page_size, num_kv_heads, head_dim // 2)
        sf = (num_pages, page_size, num_kv_heads, head_dim // 16)
        k, v = garbage(packed, torch.uint8), garbage(packed, torch.uint8)
        k_sf, v_sf = garbage(sf, torch.float8_e4m3fn), garbage(sf, torch.float8_e4m3fn)
    else:
        dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn
        k, v, k_sf, v_sf = garbage(shape, dtype), garbage(shape, dtype), None, None
    return LayerKV(
        kv_dtype, page_size, num_kv_heads, head_dim, k, v, k_sf, v_sf, k_scale, v_scale, ws_k, ws_v
    )


def stored_values(kv_dtype: str, x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the pool holds for ``x`` once written, as fp32 (via the format modules, not the backend)."""
    if kv_dtype == "bf16":
        return x.to(torch.bfloat16).float()
    if kv_dtype == "fp8_e4m3":
        return fp8.dequantize(fp8.quantize(x, scale), scale)
    return nvfp4.dequantize(*nvfp4.quantize(x, scale), scale)


def kv_values(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind == "outliers":
        spikes = torch.rand(shape, generator=gen) < 0.02
        x = torch.where(spikes, x * 80, x)
        x[..., torch.randperm(shape[-1], generator=gen)[:2]] *= 20  # hot channels
    return x


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
) -> torch.Tensor:
    """float64, one (query, head) at a time; query j of Q sees the first L - Q + j + 1 rows if causal."""
    q, k, v = q.double(), k.double(), v.double()
    num_q, num_qo_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(num_q):
        visible = kv_len - num_q + j + 1 if causal else kv_len
        for h in range(num_qo_heads):
            kh = h // (num_qo_heads // num_kv_heads)
            s = (k[:visible, kh] @ q[j, h]) * sm_scale
            p = torch.exp(s - s.max())
            out[j, h] = (p / p.sum()) @ v[:visible, kh]
    return out


def page_table_for(seq_lens: list[int], page_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct pages in random order; entries past a sequence point far outside the pool."""
    need = [(n + page_size - 1) // page_size for n in seq_lens]
    ids = torch.randperm(num_pages, generator=gen)[: sum(need)].tolist()
    table = torch.full((len(seq_lens), max(need) + 2), 10**6, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table


def slots_of(table: torch.Tensor, b: int, seq_len: int, page_size: int) -> torch.Tensor:
    return torch.tensor([int(table[b, i // page_size]) * page_size + i % page_size for i in range(seq_len)])


GEOMETRIES = [(1, 16), (4, 64), (8, 128), (4, 16)]  # (GQA ratio, head_dim)


# ---------------------------------------------------------------------------------------------
def test_registry_returns_the_reference_backend():
    backend = get_backend("reference")
    assert isinstance(backend, ReferenceBackend) and isinstance(backend, AttentionBackend)
    assert backend.name == "reference" and get_backend("auto", "cpu").name == "reference"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_stores_the_format_bytes_at_the_slots_and_nothing_else(kv_dtype):
    gen = torch.Generator().manual_seed(0)
    layer = make_layer(kv_dtype, num_pages=5, page_size=4, num_kv_heads=2, head_dim=32, gen=gen)
    before = [t.clone() for t in (layer.k, layer.v, layer.k_sf, layer.v_sf) if t is not None]
    slots = torch.randperm(20, generator=gen)[:7]
    k, v = kv_values((7, 2, 32), "outliers", gen), kv_values((7, 2, 32), "gaussian", gen)
    ReferenceBackend().write_kv(layer, slots, k.to(torch.bfloat16), v.to(torch.bfloat16))
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)  # bytes: NaN == NaN
        return t.reshape(20, *t.shape[2:])

    if kv_dtype == "bf16":
        expected = {0: k.view(torch.int16), 1: v.view(torch.int16)}
    elif kv_dtype == "fp8_e4m3":
        expected = {
            0: fp8.quantize(k, layer.k_scale).view(torch.uint8),
            1: fp8.quantize(v, layer.v_scale).view(torch.uint8),
        }
    else:
        (kd, ks), (vd, vs) = nvfp4.quantize(k, layer.k_scale), nvfp4.quantize(v, layer.v_scale)
        expected = {0: kd, 1: vd, 2: ks.view(torch.uint8), 3: vs.view(torch.uint8)}
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    for i, t in enumerate(t for t in (layer.k, layer.v, layer.k_sf, layer.v_sf) if t is not None):
        assert torch.equal(rows(t)[slots], expected[i])
        assert torch.equal(rows(t)[untouched], rows(before[i])[untouched])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("same_ws_scale", [True, False])
def test_gather_workspace_dequantizes_then_converts_to_the_workspace_dtype(kv_dtype, same_ws_scale):
    gen = torch.Generator().manual_seed(1)
    ws_scales = None if same_ws_scale else (0.07, 0.011)
    layer = make_layer(kv_dtype, 6, 4, 2, 32, gen, ws_scales=ws_scales)
    backend = ReferenceBackend()
    written = torch.randperm(24, generator=gen)[:10]
    k, v = kv_values((10, 2, 32), "outliers", gen), kv_values((10, 2, 32), "gaussian", gen)
    backend.write_kv(layer, written, k, v)
    take = written[torch.randperm(10, generator=gen)[:6]]
    ws_k = torch.zeros(9, 2, 32, dtype=layer.workspace_dtype)
    ws_v = torch.zeros(9, 2, 32, dtype=layer.workspace_dtype)
    backend.gather_workspace(layer, take, ws_k, ws_v)

    pos = [written.tolist().index(s) for s in take.tolist()]
    for ws, x, scale, ws_scale in (
        (ws_k, k, layer.k_scale, layer.ws_k_scale),
        (ws_v, v, layer.v_scale, layer.ws_v_scale),
    ):
        deq = stored_values(kv_dtype, x[pos], scale)
        if kv_dtype == "bf16":
            assert torch.equal(ws[:6], deq.to(torch.bfloat16))
        else:
            assert torch.equal(ws[:6].view(torch.uint8), fp8.quantize(deq, ws_scale).view(torch.uint8))
        assert not ws[6:].float().any()  # rows past len(slots) untouched
    if kv_dtype == "fp8_e4m3" and same_ws_scale:  # a plain copy of the stored bytes
        pool = layer.k.view(torch.uint8).reshape(24, 2, 32)
        assert torch.equal(ws_k[:6].view(torch.uint8), pool[take])


@pytest.mark.parametrize("attn_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("ratio,head_dim", GEOMETRIES)
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
def test_prefill_matches_naive_causal_attention(attn_dtype, ratio, head_dim, kind):
    gen = torch.Generator().manual_seed(ratio * 1000 + head_dim)
    hk = 2
    hq = hk * ratio
    qo_lens, kv_lens = [1, 5, 3, 4], [1, 9, 3, 11]  # fresh prompts and chunks after a cached prefix
    backend = ReferenceBackend()
    plan = backend.plan_prefill(qo_lens, kv_lens, hq, hk, head_dim, torch.device("cpu"))
    q = torch.randn(sum(qo_lens), hq, head_dim, generator=gen).to(torch.bfloat16)
    k = kv_values((sum(kv_lens), hk, head_dim), kind, gen)
    v = kv_values((sum(kv_lens), hk, head_dim), kind, gen)
    k_scale, v_scale = (1.0, 1.0) if attn_dtype == "bf16" else (float(k.abs().max()) / 448, 0.01)
    if attn_dtype == "bf16":
        k_in, v_in = k.to(torch.bfloat16), v.to(torch.bfloat16)
        k_real, v_real = k_in.float(), v_in.float()
    else:
        k_in, v_in = fp8.quantize(k, k_scale), fp8.quantize(v, v_scale)
        k_real, v_real = k_in.float() * k_scale, v_in.float() * v_scale
    sm_scale = head_dim**-0.5
    out = backend.prefill(plan, q, k_in, v_in, k_scale, v_scale, sm_scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape

    qo, kv = 0, 0
    for qo_len, kv_len in zip(qo_lens, kv_lens, strict=True):
        ref = naive_attention(
            q[qo : qo + qo_len], k_real[kv : kv + kv_len], v_real[kv : kv + kv_len], sm_scale, True
        )
        torch.testing.assert_close(
            out[qo : qo + qo_len].double(), ref, rtol=1e-2, atol=1e-2 * float(v_real.abs().max())
        )
        qo, kv = qo + qo_len, kv + kv_len


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("ratio,head_dim", GEOMETRIES)
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
def test_decode_reads_paged_pool_and_matches_naive_attention(kv_dtype, ratio, head_dim, kind):
    gen = torch.Generator().manual_seed(7 * ratio + head_dim)
    hk, page_size, num_pages = 2, 4, 16
    hq = hk * ratio
    seq_lens = [1, 7, 8, 13]  # single token, partial last pages, exactly full pages
    layer = make_layer(kv_dtype, num_pages, page_size, hk, head_dim, gen)
    table = page_table_for(seq_lens, page_size, num_pages, gen)
    backend = ReferenceBackend()
    ks, vs = [], []
    for b, n in enumerate(seq_lens):
        k, v = kv_values((n, hk, head_dim), kind, gen), kv_values((n, hk, head_dim), kind, gen)
        backend.write_kv(layer, slots_of(table, b, n, page_size), k, v)
        ks.append(stored_values(kv_dtype, k, layer.k_scale))
        vs.append(stored_values(kv_dtype, v, layer.v_scale))
    q = torch.randn(len(seq_lens), hq, head_dim, generator=gen).to(torch.bfloat16)
    plan = backend.plan_decode(table, torch.tensor(seq_lens, dtype=torch.int32), hq, hk, head_dim, page_size)
    sm_scale = head_dim**-0.5
    out = backend.decode(plan, q, layer, sm_scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for b in range(len(seq_lens)):
        ref = naive_attention(q[b : b + 1], ks[b], vs[b], sm_scale, causal=False)[0]
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-2, atol=1e-2 * float(vs[b].abs().max()))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_of_the_last_token_equals_the_last_row_of_prefill(kv_dtype):
    gen = torch.Generator().manual_seed(11)
    hk, hq, d, page_size, seq_len = 2, 8, 64, 4, 10
    layer = make_layer(kv_dtype, 8, page_size, hk, d, gen)
    if kv_dtype == "nvfp4":  # a power-of-two global scale makes the dequantized values exact in bf16
        layer.k_scale = layer.v_scale = 0.5
    table = page_table_for([seq_len], page_size, 8, gen)
    slots = slots_of(table, 0, seq_len, page_size)
    backend = ReferenceBackend()
    backend.write_kv(
        layer,
        slots,
        kv_values((seq_len, hk, d), "outliers", gen),
        kv_values((seq_len, hk, d), "gaussian", gen),
    )

    def pool_rows(which: str) -> torch.Tensor:  # the attention input prefill would get for these rows
        t = getattr(layer, which).view(-1, hk, layer.k.shape[-1])[slots]
        if kv_dtype != "nvfp4":
            return t
        sf = getattr(layer, f"{which}_sf").view(-1, hk, d // 16)[slots]
        scale = layer.k_scale if which == "k" else layer.v_scale
        exact = nvfp4.dequantize(t, sf, scale)
        assert torch.equal(nvfp4.dequantize(t, sf, scale, torch.bfloat16).float(), exact)
        return exact.to(torch.bfloat16)

    q = torch.randn(seq_len, hq, d, generator=gen)  # fp32 queries: compare without bf16 output rounding
    sm_scale = d**-0.5
    k_scale, v_scale = (layer.k_scale, layer.v_scale) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    prefill_plan = backend.plan_prefill([seq_len], [seq_len], hq, hk, d, torch.device("cpu"))
    full = backend.prefill(prefill_plan, q, pool_rows("k"), pool_rows("v"), k_scale, v_scale, sm_scale)
    decode_plan = backend.plan_decode(table, torch.tensor([seq_len], dtype=torch.int32), hq, hk, d, page_size)
    last = backend.decode(decode_plan, q[-1:], layer, sm_scale)
    torch.testing.assert_close(last[0], full[-1], rtol=1e-5, atol=1e-6)


def test_shape_and_head_mismatches_raise_value_errors():
    gen = torch.Generator().manual_seed(2)
    layer = make_layer("nvfp4", 2, 4, 2, 32, gen)
    backend = ReferenceBackend()
    with pytest.raises(ValueError, match="write_kv needs"):
        backend.write_kv(layer, torch.arange(3), torch.randn(3, 2, 16), torch.randn(3, 2, 16))
    plan = backend.plan_prefill([2], [2], 3, 2, 32, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        backend.prefill(
            plan, torch.randn(2, 3, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32), 1.0, 1.0, 1.0
        )
    ws = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="workspace"):
        backend.gather_workspace(layer, torch.arange(2), ws, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cuda_pool_bytes_equal_cpu_and_outputs_agree(kv_dtype):
    gen = torch.Generator().manual_seed(4)
    hk, hq, d, page_size, num_pages = 4, 16, 128, 16, 12
    seq_lens = [5, 37, 80]
    table = page_table_for(seq_lens, page_size, num_pages, gen)
    layers = {
        dev: make_layer(kv_dtype, num_pages, page_size, hk, d, torch.Generator().manual_seed(9), dev)
        for dev in ("cpu", "cuda")
    }
    backend = ReferenceBackend()
    for b, n in enumerate(seq_lens):
        k, v = kv_values((n, hk, d), "outliers", gen), kv_values((n, hk, d), "gaussian", gen)
        slots = slots_of(table, b, n, page_size)
        for dev, layer in layers.items():
            backend.write_kv(layer, slots.to(dev), k.to(dev, torch.bfloat16), v.to(dev, torch.bfloat16))
    for name in ("k", "v", "k_sf", "v_sf"):
        cpu, gpu = getattr(layers["cpu"], name), getattr(layers["cuda"], name)
        if cpu is not None:
            assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)), name
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    outs = {
        dev: backend.decode(
            backend.plan_decode(table.to(dev), lens.to(dev), hq, hk, d, page_size), q.to(dev), layer, d**-0.5
        ).cpu()
        for dev, layer in layers.items()
    }
    torch.testing.assert_close(outs["cuda"], outs["cpu"], rtol=1e-4, atol=1e-4)
