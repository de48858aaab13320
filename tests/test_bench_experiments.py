"""`nvfp4-serve bench experiments`: one deployment per KV dtype, every experiment against it, one JSON and the
markdown report. The committed command's CPU version runs here on the tiny model (no timing is asserted);
the ratios and targets are pinned on a hand-made results document."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.serving import experiments
from benchmarks.serving.__main__ import main
from benchmarks.serving.experiments import ExperimentPlan, PointSpec, _resolve, _State, capacity, parse_iso
from benchmarks.serving.experiments_report import main as report_main
from benchmarks.serving.experiments_report import render, summarize
from benchmarks.serving.launch import LaunchedDeployment


def _info(*pools: int, page: int = 16, router: int = 256) -> dict:
    return {"config": {"max_concurrent_requests": router},
            "decode": [{"load": {"page_size": page, "max_total_tokens": t}} for t in pools]}


def test_capacity_is_pool_tokens_over_page_rounded_request_plus_one_page_capped_by_every_limit():
    # (1000 + 24) tokens = 64 pages, + 1 = 65 pages = 1040 tokens per request
    cap = capacity(_info(10_400, 5_199), 1000, 24, [], None)
    assert cap["pages_per_request"] == 65 and cap["limits"]["pool"] == 10 + 4
    assert (cap["concurrency"], cap["limited_by"]) == (14, "pool")
    assert capacity(_info(10_400, 5_199), 1000, 24, [], 3)["limited_by"] == "max_concurrency"
    assert capacity(_info(10**9, router=40), 1, 1, ["--max-running-requests", "50"], None)["concurrency"] == 40
    two = capacity(_info(10**9, 10**9, router=10**6), 1, 1, ["--max-running-requests", "50"], None)
    assert (two["concurrency"], two["limited_by"]) == (100, "decode")  # 50 per decode service
    assert capacity(_info(10**9, router=10**6), 1, 1, [], None)["concurrency"] == 256


def test_default_running_limit_is_the_schedulers():
    from engine.config import SchedulerConfig

    assert experiments.DEFAULT_MAX_RUNNING_REQUESTS == SchedulerConfig().max_running_requests


def test_fit_is_the_smallest_concurrency_every_dtype_so_far_holds_and_oversized_points_are_skipped():
    state = _State()
    small, big = capacity(_info(20 * 1040), 1000, 24, [], None), capacity(_info(70 * 1040), 1000, 24, [], None)
    assert _resolve(PointSpec("iso_concurrency", 1000, "fit"), small, state) == (20, "")
    assert _resolve(PointSpec("iso_concurrency", 1000, "fit"), big, state) == (20, "")  # iso with the first
    assert _resolve(PointSpec("iso_capacity", 1000, "max"), big, state) == (70, "")
    c, why = _resolve(PointSpec("sweep", 1000, 21), small, state)
    assert c == 21 and "needs more than the decode pool holds" in why and "(20 requests)" in why
    assert _resolve(PointSpec("iso_capacity", 1000, "max"), capacity(_info(100), 1000, 24, [], None), state)[1]


def test_plan_options_are_checked_before_anything_starts():
    assert parse_iso("32768:44") == (32768, 44) and parse_iso("1000000:fit") == (1000000, "fit")
    for bad in ("32768", "a:4", "4:b"):
        with pytest.raises(argparse.ArgumentTypeError, match="INPUT_LEN:CONCURRENCY"):
            parse_iso(bad)
    with pytest.raises(ValueError, match="nothing to run"):
        ExperimentPlan()
    with pytest.raises(ValueError, match="one input length twice"):
        ExperimentPlan(iso=((16, 2), (16, 4)))
    with pytest.raises(ValueError, match="unknown"):
        ExperimentPlan(kv_dtypes=("int4",), sweep_concurrency=(1,))
    plan = ExperimentPlan(iso=((16, 2),), capacity_input_lens=(16, 16), sweep_concurrency=(1, 4, 1),
                          sweep_input_len=8)
    assert plan.points() == [PointSpec("iso_concurrency", 16, 2), PointSpec("iso_capacity", 16, "max"),
                             PointSpec("sweep", 8, 1), PointSpec("sweep", 8, 4)]


def test_launch_is_required_and_sets_the_kv_dtype_itself(capsys, tmp_path):
    assert main(["experiments", "--sweep-concurrency", "1"]) == 2
    assert "give --launch" in capsys.readouterr().err
    out = str(tmp_path / "r.json")
    assert main(["experiments", "--sweep-concurrency", "1", "--out", out, "--launch", "--kv-cache-dtype",
                 "bf16"]) == 2
    assert "must not set --kv-cache-dtype" in capsys.readouterr().err
    assert main(["experiments", "--input-lens", "16", "--out", out, "--launch"]) == 2
    assert "--input-lens needs --iso-concurrency" in capsys.readouterr().err


def _point(experiment: str, dtype: str, length: int, c: int, peak: float | None, ttft: float) -> dict:
    return {"experiment": experiment, "kv_dtype": dtype, "input_len": length, "output_len": 1024, "status": "ok",
            "concurrency": c, "peak_decode_tok_s": peak, "full_batch_decode_tok_s": None if peak is None else peak / 2,
            "ttft_ms": {"mean": ttft, "median": ttft * 2, "p99": ttft}}


def test_ratios_and_targets_are_read_off_the_points():
    plan = {"target_input_len": 32768, "output_len": 1024}
    doc = {"plan": plan, "deployments": [
        {"points": [_point("iso_concurrency", "bf16", 32768, 44, 1000.0, 100.0),
                    _point("iso_capacity", "bf16", 32768, 20, 800.0, 90.0)]},
        {"points": [_point("iso_concurrency", "fp8_e4m3", 32768, 44, 1600.0, 200.0),
                    _point("iso_capacity", "fp8_e4m3", 32768, 40, 1500.0, 90.0),
                    {**_point("iso_concurrency", "fp8_e4m3", 163840, 8, 10.0, 1.0), "status": "failed"}]},
        {"points": [_point("iso_concurrency", "nvfp4", 32768, 44, 2400.0, 201.0),
                    _point("iso_capacity", "nvfp4", 32768, 71, 3000.0, 95.0),
                    _point("iso_concurrency", "nvfp4", 163840, 8, None, 1.0)]},
    ]}
    s = summarize(doc)
    iso, cap = s["iso_concurrency"]["32768"], s["iso_capacity"]["32768"]
    assert iso["decode_nvfp4_fp8"] == pytest.approx(1.5) and iso["decode_nvfp4_bf16"] == pytest.approx(2.4)
    assert iso["full_batch_decode_nvfp4_fp8"] == pytest.approx(1.5) and iso["same_concurrency"]
    assert iso["ttft_overhead_pct"] == pytest.approx(0.5) and iso["ttft_overhead_pct_median"] == pytest.approx(0.5)
    assert cap["concurrency_nvfp4_fp8"] == pytest.approx(71 / 40) and cap["decode_nvfp4_fp8"] == pytest.approx(2.0)
    assert cap["concurrency"] == {"bf16": 20, "fp8_e4m3": 40, "nvfp4": 71} and not cap["same_concurrency"]
    # a failed point gives no ratio; a missing peak figure gives none either
    assert s["iso_concurrency"]["163840"]["decode_nvfp4_fp8"] is None
    assert [t["status"] for t in s["targets"]] == ["met", "met", "met", "met"]
    doc["deployments"][2]["points"][0]["ttft_ms"]["mean"] = 203.0  # +1.5 %
    doc["deployments"][2]["points"][1]["concurrency"] = 69  # 1.725x
    assert [t["status"] for t in summarize(doc)["targets"]] == ["met", "not met", "met", "not met"]
    doc["plan"]["target_input_len"] = 65536
    assert {t["status"] for t in summarize(doc)["targets"]} == {"not measured"}


class _FailingBf16(LaunchedDeployment):
    """The bf16 deployment does not start (as on an out-of-memory GPU); the others are real."""

    def start(self) -> str:
        if "bf16" in self.args:
            raise RuntimeError("nvfp4-serve up exited with code 1 before it was ready (injected)")
        return super().start()


def test_cpu_run_of_every_experiment_writes_the_json_and_the_report(tiny_model_dir, tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(experiments, "LaunchedDeployment", _FailingBf16)
    out = tmp_path / "docs" / "serving.json"
    argv = ["experiments", "--kv-dtypes", "bf16", "fp8_e4m3", "nvfp4", "--iso", "16:2", "24:fit", "6000:1",
            "--capacity-input-lens", "16", "--max-concurrency", "3", "--sweep-concurrency", "1", "2", "1000",
            "--sweep-input-len", "16", "--output-len", "4", "--target-input-len", "16", "--peak-window-s", "0.01",
            "--no-progress", "--out", str(out),
            "--launch", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--page-size", "4",
            "--max-total-tokens", "8192", "--num-prefill", "0", "--num-layers", "1"]
    assert main(argv) == 1  # the bf16 deployment and the too-long point failed; the rest ran
    doc = json.loads(out.read_text())
    assert doc["schema"] == experiments.SCHEMA and doc["command"] == "nvfp4-serve bench " + " ".join(argv)
    assert [d["kv_dtype"] for d in doc["deployments"]] == ["bf16", "fp8_e4m3", "nvfp4"]
    bf16, fp8, nv = doc["deployments"]
    assert bf16["status"] == "failed" and "injected" in bf16["error"]
    assert {p["status"] for p in bf16["points"]} == {"not run"} and len(bf16["points"]) == 7
    assert all("bf16 deployment failed" in p["error"] for p in bf16["points"])
    for d in (fp8, nv):
        assert d["status"] == "ok" and d["exit_code"] == 0 and d["launch_args"][-1] == d["kv_dtype"]
        dep = d["deployment"]
        assert (dep["kv_dtype"], dep["num_layers"], dep["num_prefill_workers"]) == (d["kv_dtype"], 1, 0)
        assert d["num_layers"] == {"checkpoint": 2, "served": [1], "override": True}
        pts = {(p["experiment"], p["input_len"], p["requested_concurrency"]): p for p in d["points"]}
        iso = pts[("iso_concurrency", 16, 2)]
        assert (iso["status"], iso["concurrency"], iso["completed"], iso["total_output_tokens"]) == ("ok", 2, 2, 8)
        assert iso["config"]["warmup"] == 1 and pts[("iso_concurrency", 24, "fit")]["config"]["warmup"] == 0
        fit = pts[("iso_concurrency", 24, "fit")]
        assert (fit["status"], fit["concurrency"], fit["capacity"]["limited_by"]) == ("ok", 3, "max_concurrency")
        too_long = pts[("iso_concurrency", 6000, 1)]
        assert too_long["status"] == "failed" and "HTTP 400" in too_long["error"]
        cap = pts[("iso_capacity", 16, "max")]
        assert (cap["status"], cap["concurrency"], cap["num_prompts"]) == ("ok", 3, 3)
        assert cap["capacity"]["limits"]["pool"] == 8192 // 24  # (16 + 4) / 4 + 1 = 6 pages of 4 tokens
        assert [pts[("sweep", 16, c)]["status"] for c in (1, 2, 1000)] == ["ok", "ok", "skipped"]
        assert pts[("sweep", 16, 1)]["server"]["flush_cache"]["flushed"] is True
    summary = doc["summary"]
    assert summary["iso_concurrency"]["16"]["concurrency"] == {"fp8_e4m3": 2, "nvfp4": 2}
    assert summary["iso_capacity"]["16"]["concurrency_nvfp4_fp8"] == 1.0
    assert [t["status"] for t in summary["targets"]][1] == "not met"  # 1.0x < 1.75x

    report = (out.parent / "README.md").read_text()
    for text in ("## Design targets", "NVFP4/FP8 max concurrency at iso-capacity", "| 16/4 | 1.00x | >= 1.75x |",
                 "## Iso-concurrency", "| 16 | fp8_e4m3 2, nvfp4 2 |", "## Iso-capacity", "3 (max_concurrency)",
                 "## Pareto sweep (input 16, output 4)", "**fp8_e4m3**", "**nvfp4**", "+26% to +30%",
                 "+37% to +78%", "TTFT overhead NVFP4 vs FP8", "1 of the checkpoint's 2 layers (`--num-layers 1`",
                 "GPU: cpu", doc["command"], "injected", "| fp8_e4m3 | sweep | 16 | 1,000 | skipped |",
                 ("peak-batch decode tok/s | full-batch decode tok/s | output tok/s | TTFT mean / median / p99 ms"
                  " | ITL median / p99 ms | max pool usage")):
        assert text in report, text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "No plots: plot needs matplotlib" in report
    else:
        for name in ("serving_decode_throughput.png", "serving_throughput_vs_concurrency.png",
                     "serving_pareto.png", "serving_ttft_vs_concurrency.png"):
            assert f"![{name}]({name})" in report
            assert (out.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out.parent / "README.md").unlink()
    capsys.readouterr()
    assert report_main([str(out)]) == 0  # the report regenerates from the JSON alone
    assert (out.parent / "README.md").read_text() == report
    assert render(doc).startswith("# Serving benchmark")
