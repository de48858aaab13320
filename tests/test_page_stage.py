"""nvfp4_kernels/page_stage.py: a batch of pages of every layer and part to and from page-major rows (the host tier's
copies), in order or into given rows. The Triton kernel (one launch for every part) against the per-part reference
under Triton's interpreter and on the GPU (also with pinned host rows, as the host tier runs it), its sm_90a
build, and the wrapper's checks."""

from __future__ import annotations

import pytest
import torch

from engine.kv_pool import KVPool
from nvfp4_kernels.page_stage import StagePlan, gather, gather_reference, scatter, scatter_reference
from tests.triton_interpreter import interpreted_cases

# (kv dtype, page size, kv heads, head_dim): nvfp4 scale pages of 4 bytes and of 1 byte (the uint8 element path)
GEOMETRIES = [("nvfp4", 16, 8, 128), ("fp8_e4m3", 4, 2, 64), ("bf16", 2, 1, 16), ("nvfp4", 1, 1, 16)]


def _parts(kv_dtype: str, page: int, heads: int, dim: int, device: str, seed: int) -> list[torch.Tensor]:
    pool = KVPool(kv_dtype, num_layers=3, num_pages=9, page_size=page, num_kv_heads=heads, head_dim=dim,
                  device=device)
    g = torch.Generator().manual_seed(seed)
    parts = [t for lkv in pool.layers for t in (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf) if t is not None]
    for t in parts:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(device))
    return parts


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes (random E4M3 bytes include NaNs, which compare unequal as floats)."""
    return t.view(torch.uint8)


def check_cases(launch, device: str, stage_device: str | None = None) -> int:
    """Every geometry: ``launch(plan, ids, stage, gather[, rows])`` (the kernel's entry) against the references,
    rows in order and scattered (``stage_device``: where the rows live; pinned host memory with a CUDA plan)."""
    cases = 0
    pin = stage_device == "cpu" and device == "cuda"
    for seed, (kv_dtype, page, heads, dim) in enumerate(GEOMETRIES):
        parts = _parts(kv_dtype, page, heads, dim, device, seed)
        plan = StagePlan.of(parts)
        ids = torch.tensor([7, 0, 8, 3], dtype=torch.int64, device=device)
        got = torch.zeros((4, plan.page_bytes), dtype=torch.uint8, device=device)
        want = torch.zeros_like(got)
        launch(plan, ids, got, True)
        gather_reference(plan, ids, want)
        assert torch.equal(got, want), kv_dtype
        assert plan.word_bytes == (1 if (kv_dtype, page * heads * dim) == ("nvfp4", 16) else 4)  # 1-byte scale pages
        back = [t.clone() for t in parts]
        ref = [t.clone() for t in parts]
        dst = torch.tensor([1, 2, 5, 6], dtype=torch.int64, device=device)
        launch(StagePlan.of(back), dst, got, False)
        scatter_reference(StagePlan.of(ref), dst, want)
        assert all(torch.equal(_raw(a), _raw(b)) for a, b in zip(back, ref, strict=True)), kv_dtype
        rows = torch.tensor([4, 1, 0, 6], dtype=torch.int64, device=device)  # into rows of a larger buffer
        got = torch.zeros((7, plan.page_bytes), dtype=torch.uint8, device=stage_device or device, pin_memory=pin)
        want = torch.zeros((7, plan.page_bytes), dtype=torch.uint8, device=device)
        launch(plan, ids, got, True, rows)
        gather_reference(plan, ids, want, rows)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(got.to(device), want) and not want[[2, 3, 5]].any(), kv_dtype
        back, ref = [t.clone() for t in parts], [t.clone() for t in parts]
        launch(StagePlan.of(back), dst, got, False, rows)
        scatter_reference(StagePlan.of(ref), dst, want, rows)
        if device == "cuda":
            torch.cuda.synchronize()
        assert all(torch.equal(_raw(a), _raw(b)) for a, b in zip(back, ref, strict=True)), kv_dtype
        assert all(torch.equal(_raw(a)[i], _raw(t)[j]) for a, t in zip(back, parts, strict=True)
                   for i, j in zip(dst.tolist(), ids.tolist(), strict=True)), kv_dtype
        cases += 1
    return cases


def test_the_reference_stages_every_part_of_each_page_in_order():
    parts = _parts("nvfp4", 4, 2, 32, "cpu", 0)
    plan = StagePlan.of(parts)
    assert plan.page_bytes == sum(t[0].numel() * t.element_size() for t in parts)
    ids = torch.tensor([2, 5], dtype=torch.int64)
    stage = torch.empty((2, plan.page_bytes), dtype=torch.uint8)
    gather(plan, ids, stage)
    assert torch.equal(stage[1], torch.cat([t.view(torch.uint8)[5].reshape(-1) for t in parts]))
    copy = [torch.zeros_like(t) for t in parts]
    scatter(StagePlan.of(copy), ids, stage)
    assert all(torch.equal(_raw(c)[i], _raw(t)[i]) for c, t in zip(copy, parts, strict=True) for i in (2, 5))
    assert all(not _raw(c)[0].any() for c in copy)


def test_kernel_in_the_triton_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    cases, output = interpreted_cases("nvfp4_kernels.page_stage:_launch", "tests.test_page_stage")
    assert cases == len(GEOMETRIES), output


def test_the_wrapper_refuses_mismatched_stages_and_ids():
    plan = StagePlan.of(_parts("fp8_e4m3", 4, 2, 64, "cpu", 0))
    ids = torch.tensor([1], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"stage must be contiguous uint8 \[1, "):
        gather(plan, ids, torch.empty((1, plan.page_bytes + 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="page ids must be int64"):
        gather(plan, ids.int(), torch.empty((1, plan.page_bytes), dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"rows must be int64 \[1\]"):
        gather(plan, ids, torch.empty((3, plan.page_bytes), dtype=torch.uint8), ids.int())
    with pytest.raises(ValueError, match=r"stage must be contiguous uint8 \[R, "):
        gather(plan, ids, torch.empty((3, plan.page_bytes - 1), dtype=torch.uint8), ids)
    with pytest.raises(ValueError, match="one page count"):
        StagePlan.of([torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(5, 8, dtype=torch.uint8)])


def test_kernel_compiles_for_sm90a_without_spills(tmp_path):
    from nvfp4_kernels.triton.page_stage import page_stage_kernel
    from tests.test_fused_ops import _sm90a

    sig = {"TABLE": "*i64", "IDS": "*i64", "ROWS": "*i64", "STAGE": "*i32", "STAGE_PAGE_WORDS": "i64"}
    for gather_, rows in ((True, True), (False, True), (True, False)):
        out = tmp_path / f"{gather_}{rows}"
        out.mkdir()
        regs, sass = _sm90a(page_stage_kernel, sig, {"BLOCK": 1024, "GATHER": gather_, "HAS_ROWS": rows}, 4, out)
        assert "STL" not in sass and "LDL" not in sass and regs <= 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_the_gpu_matches_the_reference_byte_for_byte():
    from nvfp4_kernels.page_stage import _launch

    assert check_cases(_launch, "cuda") == len(GEOMETRIES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_reads_and_writes_pinned_host_rows_directly():
    """The host tier's direct path: the kernel's loads and stores cross the bus into pinned host memory."""
    from nvfp4_kernels.page_stage import _launch

    assert check_cases(_launch, "cuda", stage_device="cpu") == len(GEOMETRIES)


def test_the_host_tier_copy_benchmark_tables_rates_against_the_raw_copy():
    from benchmarks.engine.bench_host_tier import render

    row = {"kv_dtype": "nvfp4", "path": "direct", "host_pages": "scattered", "batch_pages": 8, "bytes": 8 * 663552,
           "store_gbps": 40.0, "load_gbps": 30.0, "raw_d2h_gbps": 50.0, "raw_h2d_gbps": 60.0}
    md = render({"gpu": "GPU", "layers": 36, "rows": [row], "command": "c"})
    assert "| nvfp4 | direct | scattered | 8 | 5.3 | 40.0 | 50.0 | 0.80 | 30.0 | 60.0 | 0.50 |" in md


@pytest.mark.parametrize("argv, words", [(["--spread-gib", "-1"], "--spread-gib must be >= 0"),
                                         (["--iters", "0"], "must be >= 1")])
def test_the_host_tier_copy_benchmark_refuses_bad_arguments_before_it_needs_a_gpu(argv, words, capsys):
    from benchmarks.engine.bench_host_tier import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
