"""GPU tests of the Triton backend: every kernel against the pure-PyTorch reference (skipped without CUDA).

Quantize-on-write and the workspace dequant must give the reference's bytes exactly; the fused decode
must match fp32 attention over the same dequantized cache within bf16 output rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_kernels import fp8, nvfp4
from nvfp4_kernels.kv_layout import LayerKV

pytestmark = pytest.mark.gpu

PAGE = 16
# bf16 output rounding alone is ~2e-3 relative; fp16 probabilities add ~5e-4
DECODE_TOL = 1e-2


def _dev() -> torch.device:
    return torch.device("cuda")


def _rows(t: int, hk: int, d: int, dtype: torch.dtype, kind: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(t, hk, d, generator=gen, device="cuda")
    if kind == "outliers":
        x = x * torch.exp(torch.randn(t, hk, d, generator=gen, device="cuda") * 3)
        x[:, :, 5] *= 100.0
    x = x.clamp(-6e4, 6e4).to(dtype)
    x[0] = 0
    x[min(1, t - 1), :, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, 7.0,
                                             0.1, -0.1, 0.0, -0.0]).to(dtype)
    return x


def _nvfp4_layer(pages: int, hk: int, d: int, k_scale: float = 0.05, v_scale: float = 0.03) -> LayerKV:
    def z(last, dt):
        return torch.zeros(pages, PAGE, hk, last, dtype=dt, device="cuda")

    return LayerKV("nvfp4", PAGE, hk, d, z(d // 2, torch.uint8), z(d // 2, torch.uint8),
                   z(d // 16, torch.float8_e4m3fn), z(d // 16, torch.float8_e4m3fn), k_scale, v_scale, 0.011, 0.007)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_write_kv_matches_reference_bytes(dtype, d, kind):
    from nvfp4_kernels.backends.reference import ReferenceBackend
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(d)
    hk, t, pages = 3, 517, 40
    ours, ref = _nvfp4_layer(pages, hk, d), _nvfp4_layer(pages, hk, d)
    slots = torch.randperm(pages * PAGE, generator=gen, device="cuda")[:t]
    k, v = _rows(t, hk, d, dtype, kind, gen), _rows(t, hk, d, dtype, kind, gen)
    TritonBackend().write_kv(ours, slots, k, v)
    ReferenceBackend().write_kv(ref, slots, k, v)
    for name in ("k", "v", "k_sf", "v_sf"):
        assert torch.equal(getattr(ours, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_block_select_write_kv_matches_the_block_select_reference_bytes(dtype, d, kind):
    from nvfp4_kernels.backends.block_select import BlockSelectBackend
    from nvfp4_kernels.backends.triton_backend import TritonBackend, TritonBlockSelectBackend

    gen = torch.Generator(device="cuda").manual_seed(d + 1)
    hk, t, pages = 3, 517, 40
    ours, ref, plain = (_nvfp4_layer(pages, hk, d) for _ in range(3))
    slots = torch.randperm(pages * PAGE, generator=gen, device="cuda")[:t]
    k, v = _rows(t, hk, d, dtype, kind, gen), _rows(t, hk, d, dtype, kind, gen)
    TritonBlockSelectBackend().write_kv(ours, slots, k, v)
    BlockSelectBackend().write_kv(ref, slots, k, v)
    TritonBackend().write_kv(plain, slots, k, v)
    for name in ("k", "v", "k_sf", "v_sf"):
        assert torch.equal(getattr(ours, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name
    assert not torch.equal(ours.k_sf.view(torch.uint8), plain.k_sf.view(torch.uint8))  # some blocks took another code


def test_write_kv_takes_strided_rows():
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(100, 3, 4, 128, generator=gen, device="cuda").to(torch.bfloat16)  # a fused qkv output
    k, v = qkv[:, 1], qkv[:, 2]
    layer = _nvfp4_layer(10, 4, 128)
    slots = torch.arange(100, device="cuda") + 30
    TritonBackend().write_kv(layer, slots, k, v)
    data, sf = nvfp4.quantize(k, layer.k_scale)
    assert torch.equal(layer.k.view(-1, 4, 64)[slots], data)
    assert torch.equal(layer.k_sf.view(-1, 4, 8)[slots].view(torch.uint8), sf.view(torch.uint8))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_gather_workspace_matches_reference_bytes(d):
    from nvfp4_kernels.backends.reference import ReferenceBackend
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(7)
    hk, pages = 2, 30
    layer = _nvfp4_layer(pages, hk, d)
    all_slots = torch.arange(pages * PAGE, device="cuda")
    rows = _rows(pages * PAGE, hk, d, torch.float32, "outliers", gen)
    TritonBackend().write_kv(layer, all_slots, rows, rows * 0.5)
    slots = torch.randperm(pages * PAGE, generator=gen, device="cuda")[:333]
    out = [torch.full((400, hk, d), float("nan"), device="cuda").to(torch.float8_e4m3fn) for _ in range(4)]
    TritonBackend().gather_workspace(layer, slots, out[0], out[1])
    ReferenceBackend().gather_workspace(layer, slots, out[2], out[3])
    assert torch.equal(out[0][:333].view(torch.uint8), out[2][:333].view(torch.uint8))
    assert torch.equal(out[1][:333].view(torch.uint8), out[3][:333].view(torch.uint8))
    expect = fp8.quantize(nvfp4.dequantize(layer.k.view(-1, hk, d // 2)[slots],
                                           layer.k_sf.view(-1, hk, d // 16)[slots], layer.k_scale), layer.ws_k_scale)
    assert torch.equal(out[0][:333].view(torch.uint8), expect.view(torch.uint8))


def fp32_decode_reference(layer: LayerKV, page_table, seq_lens, q, sm_scale) -> torch.Tensor:
    """softmax(q . K^T * sm_scale) . V in fp32 over the dequantized pages of each sequence."""
    group = q.shape[1] // layer.num_kv_heads
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        pages = page_table[b, : -(-n // PAGE)].long()
        k = nvfp4.dequantize(layer.k[pages], layer.k_sf[pages], layer.k_scale).flatten(0, 1)[:n]
        v = nvfp4.dequantize(layer.v[pages], layer.v_sf[pages], layer.v_scale).flatten(0, 1)[:n]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


def _filled_layer(pages: int, hk: int, d: int, kind: str, gen: torch.Generator) -> LayerKV:
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    layer = _nvfp4_layer(pages, hk, d)
    slots = torch.arange(pages * PAGE, device="cuda")
    k = _rows(pages * PAGE, hk, d, torch.bfloat16, kind, gen)
    v = _rows(pages * PAGE, hk, d, torch.bfloat16, kind, gen)
    TritonBackend().write_kv(layer, slots, k, v)
    return layer


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_decode_matches_fp32_reference(group, d, kind):
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(group * 1000 + d)
    hk = 2
    lens = [3001, 1, 17, 250]  # odd lengths, partial last pages, one token, several splits (3001 > 2 * 1024)
    max_pages = -(-max(lens) // PAGE) + 2
    pages = len(lens) * max_pages + 3
    layer = _filled_layer(pages, hk, d, kind, gen)
    page_table = torch.randperm(pages, generator=gen, device="cuda")[: len(lens) * max_pages]
    page_table = page_table.reshape(len(lens), max_pages).to(torch.int32)  # pages in random order
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = (torch.randn(len(lens), hk * group, d, generator=gen, device="cuda") * (30.0 if kind == "outliers" else 1.0))
    q = q.to(torch.bfloat16)
    tb = TritonBackend()
    plan = tb.plan_decode(page_table, seq_lens, hk * group, hk, d, PAGE)
    assert plan.backend_state.num_splits > 1
    out = tb.decode(plan, q, layer, 1 / math.sqrt(d))
    ref = fp32_decode_reference(layer, page_table, seq_lens, q, 1 / math.sqrt(d))
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < DECODE_TOL, err


def test_decode_replays_in_a_cuda_graph_with_new_lengths():
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(11)
    hk, group, d, bsz, max_pages = 8, 4, 128, 3, 64
    pages = bsz * max_pages + 1
    layer = _filled_layer(pages, hk, d, "random", gen)
    page_table = torch.zeros(bsz, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(bsz, dtype=torch.int32, device="cuda")
    q = torch.zeros(bsz, hk * group, d, device="cuda", dtype=torch.bfloat16)
    tb = TritonBackend()
    plan = tb.plan_decode(page_table, seq_lens, hk * group, hk, d, PAGE)
    tb.decode(plan, q, layer, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.decode(plan, q, layer, 0.1)
    for lens in ([1000, 5, 1024], [17, 1023, 64 * 16]):
        page_table.copy_(torch.randperm(pages, generator=gen, device="cuda")[: bsz * max_pages].view(bsz, -1))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        graph.replay()
        ref = fp32_decode_reference(layer, page_table, seq_lens, q, 0.1)
        assert ((out.float() - ref).norm() / ref.norm()).item() < DECODE_TOL


def test_flashinfer_reads_pages_written_by_our_quantize_kernel():
    fi = pytest.importorskip("flashinfer")
    from nvfp4_kernels.backends.triton_backend import quantize_rows

    del fi
    from nvfp4_kernels.backends.flashinfer_backend import nvfp4_dequantize_rows

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = _rows(4096, 1, 128, torch.bfloat16, "outliers", gen)
    data = torch.zeros(4096, 1, 64, dtype=torch.uint8, device="cuda")
    sf = torch.zeros(4096, 1, 8, dtype=torch.uint8, device="cuda")
    quantize_rows(x, torch.arange(4096, device="cuda"), data, sf, 0.05)
    theirs = nvfp4_dequantize_rows(data[:, 0], sf[:, 0], 0.05)
    ours = nvfp4.dequantize(data[:, 0], sf[:, 0], 0.05).to(torch.bfloat16).float()
    assert torch.equal(theirs, ours)


def test_prefill_on_fp8_matches_reference():
    from nvfp4_kernels.backends.reference import ReferenceBackend
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(9)
    tb, rb = TritonBackend(), ReferenceBackend()
    qo, kv = [37, 1, 200], [100, 64, 200]
    plan = tb.plan_prefill(qo, kv, 8, 2, 128, torch.device("cuda"))
    q = torch.randn(sum(qo), 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k = fp8.quantize(torch.randn(sum(kv), 2, 128, generator=gen, device="cuda"), 0.02)
    v = fp8.quantize(torch.randn(sum(kv), 2, 128, generator=gen, device="cuda"), 0.01)
    ours = tb.prefill(plan, q, k, v, 0.02, 0.01, 0.088).float()
    ref = rb.prefill(plan, q, k, v, 0.02, 0.01, 0.088).float()
    assert ((ours - ref).norm() / ref.norm()).item() < DECODE_TOL
