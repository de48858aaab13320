"""bench_decode_step's reading of its measurements (CPU; the measuring itself needs a GPU): kernel names
sorted into the profile's categories, the per-category sums and launch gaps, and the markdown's columns:
``rest`` is the graph step minus the graph-captured attention, never minus the eager loop."""

from __future__ import annotations

import pytest

from benchmarks.engine.bench_decode_step import CATEGORY_NAMES, category_ms, kernel_category, main
from benchmarks.engine.decode_step_report import write_md

# names as the torch profiler reports them on an H200 (docs/benchmarks/engine_decode.md), by category
PROFILED = {
    "gemm": ["nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT", "nvjet_sm90_tst_64x24_64x16_1x2_h_bz_TNT",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false>",
             "skinny_linear_kernel"],
    "attention": ["nvfp4_decode_kernel", "nvfp4_decode_gluon_kernel", "nvfp4_decode_tma_kernel", "merge_kernel",
                  ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits<(flashinfer::"
                   "MaskMode)0, 16u, 1u, 4u, 8u, 8u, 1u, 1u, (flashinfer::PosEncodingMode)0, __nv_fp8_e4m3>>"),
                  "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16, int>"],
    "kv_write": ["kv_write_kernel", "nvfp4_quantize_kernel"],
    "norm_rope_act": ["rmsnorm_kernel", "qk_norm_rope_kernel", "silu_mul_kernel"],
    "other": ["void at::native::vectorized_elementwise_kernel<8, at::native::AUnaryFunctor<c10::BFloat16>>",
              "Memcpy HtoD (Pinned -> Device)", "void at::native::index_select_large_index<c10::BFloat16>"],
}


def test_profiled_kernel_names_fall_into_their_categories():
    assert set(PROFILED) == set(CATEGORY_NAMES)
    for category, names in PROFILED.items():
        for name in names:
            assert kernel_category(name) == category, name


def test_category_sums_add_up_to_the_kernel_total():
    rows = [{"kernel": n, "us": 100.0 * (i + 1), "launches": 36}
            for i, n in enumerate(n for names in PROFILED.values() for n in names)]
    cats = category_ms(rows)
    assert set(cats) == {*CATEGORY_NAMES, "total"}
    assert abs(cats["total"] - sum(r["us"] for r in rows) / 1e3) < 1e-9
    for category, names in PROFILED.items():
        want = sum(r["us"] for r in rows if r["kernel"] in names) / 1e3
        assert abs(cats[category] - want) < 1e-9, category


def _row(**extra) -> dict:
    row = {"kv_dtype": "nvfp4", "batch": 1, "seq_len": 32768, "graph_ms": 7.84, "eager_ms": 35.68,
           "kv_read_gb": 0.6, "tok_s": 127.6, "non_attention_floor_ms": 3.55}
    return {**row, **extra}


def _render(rows: list[dict], tmp_path) -> str:
    doc = {"gpu": "GPU", "copy_tb_s": 4.27, "layers": 36, "model": "m", "command": "c", "rows": rows}
    path = tmp_path / "out.md"
    write_md(doc, str(path))
    return path.read_text()


def test_rest_is_the_graph_step_minus_the_graph_attention(tmp_path):
    cats = {"gemm": 4.1, "attention": 2.0, "kv_write": 0.12, "norm_rope_act": 0.29, "other": 0.05}
    cats["total"] = sum(cats.values())
    row = _row(attention_graph_ms=2.25, attention_eager_ms=4.90, kernel_ms=cats, kernels_from="graph",
               launch_gaps_ms=7.84 - cats["total"], kernels=[{"kernel": "nvfp4_decode_kernel", "us": 2000.0,
                                                              "launches": 36}])
    md = _render([row], tmp_path)
    assert "| 1 x 32768 | nvfp4 | 7.84 | 35.68 | 2.25 | 4.90 | 0.27 | 5.59 | 3.55 | 1.57x | 128 | - |" in md
    assert "| 1 x 32768 | nvfp4 | 7.84 | 4.10 | 2.00 | 0.12 | 0.29 | 0.05 | 6.56 | 1.28 |" in md
    assert "(torch profiler, CUDA graph replay)" in md


def test_back_to_back_steps_get_their_own_rest_beside_the_step_alone(tmp_path):
    md = _render([_row(attention_graph_ms=2.25, back_to_back_ms=6.80)], tmp_path)
    assert "| 1 x 32768 | nvfp4 | 7.84 | 6.80 | 4.55 | 1.28x | - | - | 147 |" in md
    assert "back to back" not in _render([_row(attention_graph_ms=2.25)], tmp_path)


def test_the_step_without_attention_is_its_own_column_against_the_floor(tmp_path):
    md = _render([_row(attention_graph_ms=2.25, back_to_back_ms=6.80, no_attention_back_to_back_ms=4.26)], tmp_path)
    assert "| 1 x 32768 | nvfp4 | 7.84 | 6.80 | 4.55 | 1.28x | 4.26 | 1.20x | 147 |" in md


def test_rows_measured_only_without_attention_say_so_and_show_that_step_against_the_floor(tmp_path, capsys):
    from benchmarks.engine.decode_step_report import print_table

    row = {"kv_dtype": "fp8_e4m3", "batch": 44, "seq_len": 32768, "weight_gb": 15.1, "non_attention_floor_ms": 3.55,
           "no_attention_ms": 4.90, "no_attention_back_to_back_ms": 4.62}
    md = _render([row], tmp_path)
    assert "| 44 x 32768 | fp8_e4m3 | only the step without attention measured" in md
    assert "| 44 x 32768 | fp8_e4m3 | - | - | - | - | 4.62 | 1.30x | - |" in md
    print_table([row], 36)
    assert "without attention, back to back: 4.62 ms, 1.30x the floor" in capsys.readouterr().out


def test_a_profiled_step_without_attention_is_set_against_its_own_time(tmp_path):
    cats = {"gemm": 5.7, "attention": 0.0, "kv_write": 0.07, "norm_rope_act": 0.31, "other": 0.07}
    cats["total"] = sum(cats.values())
    row = {"kv_dtype": "nvfp4", "batch": 44, "seq_len": 32768, "weight_gb": 15.1, "non_attention_floor_ms": 5.0,
           "no_attention_ms": 6.9, "no_attention_back_to_back_ms": 6.6, "no_attention_eager_ms": 30.1,
           "kernel_ms": cats, "kernels_from": "graph", "launch_gaps_ms": 6.9 - cats["total"],
           "kernels": [{"kernel": "rmsnorm_kernel", "us": 166.0, "launches": 73}], "profiled": "step without attention"}
    md = _render([row], tmp_path)
    assert "| 44 x 32768 | nvfp4 | 6.90 (without attention) | 5.70 | 0.00 | 0.07 | 0.31 | 0.07 | 6.15 | 0.75 |" in md
    assert "### Kernels of one step without attention: 44 x 32768, nvfp4 (torch profiler, CUDA graph replay)" in md
    row["kernels_from"] = "eager"
    assert "| 30.10 (eager, without attention) |" in _render([row], tmp_path)


def test_the_compact_pool_of_the_step_without_attention_owns_the_pages_the_step_writes():
    from benchmarks.engine.bench_decode_step import row_pages

    for seq_len in (1, 15, 16, 17, 32768, 32769):
        full_first, full = row_pages(seq_len, 16, compact=False)
        assert full_first == 0 and full * 16 >= seq_len + 1
        first, own = row_pages(seq_len, 16, compact=True)
        assert first + own == full  # the table keeps its width
        assert first * 16 <= seq_len - 1 < (first + own) * 16  # the written token's page is owned
        assert own <= 2


def test_the_stand_in_runs_every_kernel_of_the_step_but_the_decode_attention(tiny_model_dir):
    """The step through AttentionStandIn writes each layer's K/V as the real step does, never calls the
    backend's decode, and (its attention output being zeros) gives other logits than the real step."""
    import torch

    from benchmarks.engine.attention_stand_in import AttentionStandIn
    from engine.attention_paths import AttentionPaths
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.sampling import SamplingParams

    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                              cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=256)))
    paths, calls = eng.runner.paths, []
    for layer in paths.pool.layers:  # valid NVFP4 bytes under the 9 cached tokens (codes 0.5, small scales)
        for t in (layer.k, layer.v, layer.k_sf, layer.v_sf):
            t.view(torch.uint8).fill_(0x11)

    class Recording:
        def __getattr__(self, name):
            attr = getattr(paths.backend, name)
            if name in ("decode", "write_kv"):
                return lambda *a, **kw: (calls.append(name), attr(*a, **kw))[1]
            return attr

    stand_in = AttentionPaths(paths.pool, AttentionStandIn(Recording()), paths.workspace_tokens,
                              paths.num_qo_heads, paths.sm_scale, paths.device)
    req = Request("r", list(range(3, 13)), SamplingParams(max_tokens=1), page_ids=[0, 1, 2])
    req.kv_len = 9  # the step writes token 9 and attends over 10
    got = ModelRunner(eng.runner.model, stand_in, paths.device).decode_logits([req], use_graphs=False)
    layers = len(paths.pool.layers)
    assert calls == ["write_kv"] * layers
    real = eng.runner.decode_logits([req], use_graphs=False)
    assert got.shape == real.shape and torch.isfinite(got).all() and not torch.allclose(got, real)


def test_an_older_json_with_only_the_eager_attention_shows_no_rest(tmp_path):
    md = _render([_row(attention_ms=4.90, attention_tb_s=0.12)], tmp_path)
    assert "| 1 x 32768 | nvfp4 | 7.84 | 35.68 | - | 4.90 | - | - | 3.55 | - | 128 | - |" in md
    assert "kernel ms per step" not in md


@pytest.mark.parametrize("setting,base,other,label,other_ms,other_attention_ms,ratio,section", [
    ("kv_rotation", "none", "hadamard", "nvfp4 + hadamard", 7.92, 2.26, "1.010", "rotation's cost"),
    ("nvfp4_decode_kernel", "auto", "gluon", "nvfp4, gluon decode", 8.29, 2.70, "1.057", "The NVFP4 decode kernel")])
def test_rows_of_another_setting_are_labelled_and_set_against_the_same_step_with_the_base_one(
        tmp_path, setting, base, other, label, other_ms, other_attention_ms, ratio, section):
    """A rotated row against the unrotated step, a forced decode kernel's row against the GPU's default: both of
    the same run, each labelled; the pairs' section only where there is a pair."""
    plain = _row(attention_graph_ms=2.25, **{setting: base})
    row = _row(attention_graph_ms=other_attention_ms, graph_ms=other_ms, tok_s=1e3 / other_ms, **{setting: other})
    md = _render([plain, row], tmp_path)
    assert f"| 1 x 32768 | {label} | {other_ms:.2f} |" in md
    assert f"| 1 x 32768 | {label} | 7.840 | {other_ms:.3f} | {ratio} | 2.250 | {other_attention_ms:.3f} |" in md
    assert section not in _render([plain], tmp_path)


def test_rows_without_pdl_are_labelled_and_set_against_the_same_step_with_it(tmp_path):
    on = _row(attention_graph_ms=2.25, pdl=True, back_to_back_ms=7.10)
    off = _row(attention_graph_ms=2.40, pdl=False, graph_ms=8.10, tok_s=123.5, back_to_back_ms=7.50)
    md = _render([on, off], tmp_path)
    assert "| 1 x 32768 | nvfp4, no PDL | 8.10 |" in md
    assert "| 1 x 32768 | nvfp4, no PDL | 7.840 | 8.100 | 1.033 | 2.250 | 2.400 | 7.10 | 7.50 |" in md
    assert "Programmatic dependent launch on / off" not in _render([on], tmp_path)
    assert "rotation's cost" not in md


def test_same_run_pairs_differ_in_one_setting_and_vs_fp8_keeps_the_pdl_mode(tmp_path):
    rows = [_row(kv_dtype=kv, kv_rotation=rot, pdl=pdl, graph_ms=ms, tok_s=1e3 / ms, attention_graph_ms=1.0)
            for kv, rot, pdl, ms in (("fp8_e4m3", "none", True, 6.0), ("fp8_e4m3", "none", False, 8.0),
                                     ("nvfp4", "none", True, 5.0), ("nvfp4", "none", False, 5.5),
                                     ("nvfp4", "hadamard", True, 5.2), ("nvfp4", "hadamard", False, 7.0))]
    md = _render(rows, tmp_path)
    # PDL pairs: same rotation; rotation pairs: same PDL mode
    assert "| 1 x 32768 | nvfp4, no PDL | 5.000 | 5.500 | 1.100 |" in md
    assert "| 1 x 32768 | nvfp4 + hadamard, no PDL | 5.200 | 7.000 | 1.346 |" in md
    assert "| 1 x 32768 | nvfp4 + hadamard | 5.000 | 5.200 | 1.040 |" in md
    assert "| 1 x 32768 | nvfp4 + hadamard, no PDL | 5.500 | 7.000 | 1.273 |" in md
    # vs fp8 within the row's PDL mode: 8.0 / 5.5 without, 6.0 / 5.0 with
    assert "| 1 x 32768 | nvfp4, no PDL | 5.50 |" in md and "| 182 | 1.45x |" in md
    assert "| 200 | 1.20x |" in md


def test_a_gpu_without_pdl_labels_the_rows_asked_for_with_it(tmp_path):
    md = _render([_row(attention_graph_ms=2.25, pdl=True, pdl_launched=False)], tmp_path)
    assert "| 1 x 32768 | nvfp4, PDL n/a | 7.84 |" in md


def test_rows_through_cublas_are_paired_with_the_skinny_rows_of_the_same_run(tmp_path):
    base = {"kv_dtype": "nvfp4", "batch": 16, "seq_len": 32768, "weight_gb": 15.1, "non_attention_floor_ms": 5.0,
            "pdl": True, "pdl_launched": True}
    rows = [dict(base, linear="skinny", no_attention_back_to_back_ms=6.30),
            dict(base, linear="cublas", no_attention_back_to_back_ms=6.50)]
    md = _render(rows, tmp_path)
    assert "| 16 x 32768 | nvfp4 | - | - | 6.30 | 6.50 | 1.032 |" in md
    assert "| 16 x 32768 | nvfp4, cuBLAS | - | - | - | - | 6.50 | 1.30x | - |" in md


def test_no_fused_needs_the_cublas_linear_mode():
    import pytest

    from benchmarks.engine.bench_decode_step import main

    with pytest.raises(SystemExit) as e:
        main(["--no-fused"])
    assert e.value.code == 2


def test_a_decode_kernel_named_twice_is_refused():
    with pytest.raises(SystemExit) as e:
        main(["--nvfp4-decode-kernels", "auto", "auto"])
    assert e.value.code == 2
