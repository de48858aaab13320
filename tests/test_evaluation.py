"""The KV-cache evaluation: its engine driver, its metrics, the block-select encoder, the report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.loader import model_fingerprint
from nvfp4_kernels import nvfp4
from nvfp4_kernels import nvfp4_block_select as block_select
from nvfp4_kernels.backends.block_select import BlockSelectBackend
from nvfp4_kernels.kv_layout import LayerKV
from nvfp4_kernels.nvfp4_block_select import quantize_block_select
from offline.calibration import KVScales, calibrate
from offline.evaluation import (
    VARIANTS,
    ContextSpec,
    EvalConfig,
    KVVariant,
    compare,
    evaluate,
    main,
    make_engine,
    teacher_forced_logprobs,
)
from offline.evaluation_report import render_markdown
from offline.synthetic_kv import synthetic_attention_error, synthetic_kv
from tests.engine_reference import PathReference

TEXT = "import os\n\n\ndef walk(top):\n    for name in os.listdir(top):\n        yield name\n" * 40


@pytest.fixture(scope="module")
def tiny_scales(tiny_model_dir) -> KVScales:
    return calibrate(tiny_model_dir, TEXT, num_tokens=64, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tiny_rotated_scales(tiny_model_dir) -> KVScales:
    return calibrate(tiny_model_dir, TEXT, num_tokens=64, device="cpu", dtype="float32", kv_rotation="hadamard")


def windows_of(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n, length), generator=g).tolist()


@pytest.mark.parametrize("kv_dtype", ["bf16", "nvfp4"])
def test_teacher_forced_logprobs_follow_the_path_reference(tiny_model_dir, tiny_scales, kv_dtype):
    """Prefill through path 1, then decode steps over the pool fed the true tokens, as the path reference."""
    cfg = EvalConfig(model_dir=tiny_model_dir, page_size=4)
    variant = next(v for v in VARIANTS if v.kv_dtype == kv_dtype and not v.calibrated)
    eng = make_engine(cfg, variant, tiny_scales, pool_tokens=256, chunk=64)
    wins = windows_of(2, 20, seed=1)
    lp = teacher_forced_logprobs(eng, wins, context_len=14)
    assert lp.shape == (2, 6, eng.model.config.vocab_size)
    for w, got in zip(wins, lp):
        ref = PathReference(eng.model, kv_dtype)
        logits = [ref._run(w[:14], 0, decode=False)]
        logits += [ref._run([w[pos]], pos, decode=True) for pos in range(14, 19)]
        want = torch.log_softmax(torch.stack(logits), -1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    report = eng.check_integrity()
    assert report.num_in_use == 0 and eng.allocator.num_free == eng.allocator.num_pages


def test_compare_measures_kl_agreement_and_greedy_prefix():
    base = torch.log(torch.tensor([[[0.5, 0.5, 0.0 + 1e-30], [0.9, 0.05, 0.05]]]))
    same = compare(base, torch.tensor([[0, 0]]), base, [[1, 2, 3, 4]], [[1, 2, 3, 4]])
    assert same["kl_vs_bf16"] == 0 and same["top1_agreement"] == 1 and same["greedy_agreement"] == 1
    assert same["perplexity"] == pytest.approx(math.exp((math.log(2) - math.log(0.9)) / 2))
    other = torch.log(torch.tensor([[[0.25, 0.75, 1e-30], [0.9, 0.05, 0.05]]]))
    m = compare(other, torch.tensor([[0, 0]]), base, [[1, 2, 9, 4]], [[1, 2, 3, 4]])
    kl_first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert m["kl_vs_bf16"] == pytest.approx(kl_first / 2, rel=1e-5)
    assert m["top1_agreement"] == 0.5  # argmax 1 vs bf16's 0 (first of a tie) at step 0
    assert m["greedy_agreement"] == 0.5 and m["greedy_identical"] == 0
    assert m["nll_delta_vs_bf16"] == pytest.approx((math.log(0.5) - math.log(0.25)) / 2, rel=1e-5)


def test_block_select_is_never_worse_per_block_and_the_reference_decodes_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * torch.exp(torch.randn(256, 1, generator=g))
    x[torch.rand(256, 64, generator=g) < 0.01] *= 30.0
    for scale in (1.0, float(x.abs().max()) / 2688):
        d6, s6 = nvfp4.quantize(x, scale)
        d, s = quantize_block_select(x, scale)
        err6 = (nvfp4.dequantize(d6, s6, scale) - x).view(256, 4, 16).square().sum(-1)
        err = (nvfp4.dequantize(d, s, scale) - x).view(256, 4, 16).square().sum(-1)
        assert bool((err <= err6).all()) and float(err.sum()) < float(err6.sum())
        assert float((err < err6).float().mean()) > 0.1
        kept = (s.view(torch.uint8) == s6.view(torch.uint8)).view(256, 4)
        assert 0.1 < float(kept.float().mean()) < 0.9  # both choices occur
        # where amax/6 was kept, the bytes are the reference's
        codes_equal = (d.view(256, 4, 8) == d6.view(256, 4, 8)).all(-1)
        assert bool(codes_equal[kept].all())
        # never worse than amax/4 either, and codes below c6 are among the choices
        s4 = (x.view(256, 4, 16).abs().amax(-1, keepdim=True) / 4 / scale).clamp(max=448).to(torch.float8_e4m3fn)
        d4 = (block_select._codes_for_scale(x.view(256, 4, 16), s4, torch.tensor(scale))[1] - x.view(256, 4, 16))
        assert bool((err <= d4.square().sum(-1)).all())
        offsets = s.view(torch.uint8).to(torch.int32) - s6.view(torch.uint8).to(torch.int32)
        assert set(offsets.unique().tolist()) <= set(block_select.SCALE_OFFSETS) and int(offsets.min()) == -1


def test_block_select_backend_stores_the_block_select_bytes():
    layer = LayerKV(
        "nvfp4",
        4,
        2,
        32,
        torch.zeros(3, 4, 2, 16, dtype=torch.uint8),
        torch.zeros(3, 4, 2, 16, dtype=torch.uint8),
        torch.zeros(3, 4, 2, 2, dtype=torch.float8_e4m3fn),
        torch.zeros(3, 4, 2, 2, dtype=torch.float8_e4m3fn),
        k_scale=0.01,
        v_scale=0.02,
    )
    k, v = torch.randn(5, 2, 32) * 3, torch.randn(5, 2, 32)
    slots = torch.tensor([4, 5, 6, 7, 9])
    BlockSelectBackend().write_kv(layer, slots, k, v)
    for x, data, sf, scale in ((k, layer.k, layer.k_sf, 0.01), (v, layer.v, layer.v_sf, 0.02)):
        want_d, want_s = quantize_block_select(x, scale)
        assert torch.equal(data.view(12, 2, 16)[slots], want_d)
        assert torch.equal(sf.view(torch.uint8).view(12, 2, 2)[slots], want_s.view(torch.uint8))


def test_synthetic_errors_order_the_formats_and_show_what_calibration_fixes():
    rows = {r["regime"].split(" (")[0]: r for r in synthetic_attention_error(num_tokens=512)}
    for r in rows.values():
        assert r["bf16"] < r["fp8_e4m3 calibrated"] < r["nvfp4 calibrated"] < 0.5
        for fmt in ("nvfp4 calibrated + rotation", "nvfp4 calibrated + rotation + block select"):
            assert r["fp8_e4m3 calibrated"] < r[fmt] < 0.5, fmt  # rotated back: the error is quantization's only
    for regime in ("amax 5000", "amax 0.05"):  # outside what scale 1.0 represents well
        assert rows[regime]["fp8_e4m3 (scale 1.0)"] > 3 * rows[regime]["fp8_e4m3 calibrated"]
        assert rows[regime]["nvfp4 (scale 1.0)"] > 1.5 * rows[regime]["nvfp4 calibrated"]
    q, k, v = synthetic_kv(512, 64, 7.0, torch.Generator().manual_seed(1))
    assert float(k.abs().max()) == pytest.approx(7.0) and float(v.abs().max()) == pytest.approx(7.0)
    assert 1.0 < float((q @ k.T).std() / 8) < 3.0


def test_evaluate_reports_every_variant_and_writes_json_and_markdown(tiny_model_dir, tiny_scales, tiny_rotated_scales,
                                                                    tmp_path):
    cfg = EvalConfig(
        model_dir=tiny_model_dir,
        contexts=(ContextSpec("short", 24, 2), ContextSpec("long", 60, 1)),
        continuation_tokens=4,
        greedy_tokens=3,
        page_size=4,
    )
    res = evaluate(cfg, tiny_scales, TEXT * 3, text_source="test text", log=lambda _: None,
                   rotated_scales=tiny_rotated_scales)
    assert [c["name"] for c in res["contexts"]] == ["short", "long"]
    for c in res["contexts"]:
        rows = {r["variant"]: r for r in c["rows"]}
        assert list(rows) == [v.name for v in VARIANTS]
        assert rows["bf16"]["kl_vs_bf16"] == 0 and rows["bf16"]["greedy_agreement"] == 1
        # 4-bit values are coarser than 8-bit ones: the KL ordering holds even on random weights
        assert 0 < rows["fp8_e4m3 (scale 1.0)"]["kl_vs_bf16"] < rows["nvfp4 (scale 1.0)"]["kl_vs_bf16"]
        assert c["num_windows"] == {"short": 2, "long": 1}[c["name"]]
        assert len(c["amax"]["k"]) == 2 and all(a > 0 for a in c["amax"]["k"] + c["amax"]["v"])
    md = render_markdown(res)
    assert "| nvfp4 calibrated + block select |" in md and "## long context: 60 tokens" in md
    assert "calibration moves NVFP4's KL" in md
    assert "rotation moves calibrated NVFP4's KL" in md and "the best NVFP4 variant" in md
    assert "rotation moves NVFP4's KL with scale 1.0" in md
    assert "| nvfp4 calibrated + rotation + block select |" in md.split("synthetic outlier-heavy")[1]
    assert "synthetic K/V: rotation moves calibrated NVFP4's attention-output error amax 10: " in md
    assert res["calibration"]["rotated_k_amax"] == list(tiny_rotated_scales.k_amax)
    with pytest.raises(ValueError, match="calibrated for model"):
        evaluate(cfg, KVScales("0" * 16, tiny_scales.k_amax, tiny_scales.v_amax), TEXT)


def test_eval_command_writes_the_files(tiny_model_dir, tiny_scales, tiny_rotated_scales, tmp_path):
    scales, rotated, data = tmp_path / "s.json", tmp_path / "r.json", tmp_path / "text.txt"
    tiny_scales.save(scales)
    tiny_rotated_scales.save(rotated)
    data.write_text(TEXT * 3)
    out_json, out_md = tmp_path / "acc.json", tmp_path / "acc.md"
    assert (
        main(
            [
                "--model",
                tiny_model_dir,
                "--kv-scales",
                str(scales),
                "--kv-scales-rotated",
                str(rotated),
                "--data",
                str(data),
                "--json",
                str(out_json),
                "--markdown",
                str(out_md),
                "--short-context",
                "16",
                "--short-windows",
                "2",
                "--long-context",
                "40",
                "--long-windows",
                "1",
                "--continuation-tokens",
                "3",
                "--greedy-tokens",
                "2",
            ]
        )
        == 0
    )
    res = json.loads(out_json.read_text())
    assert res["model"]["fingerprint"] == model_fingerprint(tiny_model_dir)
    assert res["data"]["source"] == str(data)
    assert out_md.read_text().startswith("# KV-cache accuracy")


def test_uncalibrated_variants_ignore_checkpoint_scales(tmp_path):
    from offline.tiny_model import make_tiny_model

    ckpt = str(make_tiny_model(tmp_path / "m", kv_scales={"k": [0.5, 0.5], "v": [0.5, 0.5]}))
    scales = KVScales(model_fingerprint(ckpt), (2688.0, 2688.0), (2688.0, 2688.0))
    cfg = EvalConfig(model_dir=ckpt)
    plain = make_engine(cfg, KVVariant("n", "nvfp4"), scales, 64, 16)
    assert plain.k_scales == [1.0, 1.0] and plain.pool.layers[0].ws_k_scale == 1.0
    cal = make_engine(cfg, KVVariant("c", "nvfp4", calibrated=True), scales, 64, 16)
    assert cal.k_scales == [1.0, 1.0] and cal.pool.layers[0].ws_k_scale == 6.0
    pool_only = make_engine(cfg, KVVariant("p", "nvfp4", calibrated=True, pool_only=True), scales, 64, 16)
    assert pool_only.pool.layers[0].ws_k_scale == 1.0


def test_block_select_is_a_serving_option_by_backend_name(tiny_model_dir):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                              attention_backend="reference-block-select",
                              cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=512)))
    assert isinstance(eng.backend, BlockSelectBackend)
    out = eng.generate([list(range(5, 40))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    eng.check_integrity()
