"""CPU smoke run of the transfer benchmark (benchmarks/transfer/bench_transfer.py): gRPC path only, tiny
prompts, no timing asserted; the numbers that do not depend on timing are checked."""

from __future__ import annotations

import json

import pytest

from benchmarks.transfer.bench_transfer import main
from benchmarks.transfer.report import summarize
from decode_svc.transfer_phases import PHASES


def test_cpu_smoke_run_writes_rows_ratios_json_and_markdown(tiny_model_dir, tmp_path):
    out_json, out_md = tmp_path / "transfer.json", tmp_path / "transfer.md"
    rc = main(["--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--lengths", "40",
               "--paths", "grpc", "grpc-lanes", "--grpc-lanes", "2", "--decode-tokens", "3", "--warmup-len", "8", "--page-size", "4",
               "--anchor-bytes", str(8 << 20), "--ready-repeats", "2", "--compute-repeats", "3",
               "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json), "--out-md", str(out_md)])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    rows = {(r["kv_dtype"], r["prompt_len"], r["path"]): r for r in doc["rows"]}
    assert sorted(rows) == [(kv, 40, p) for kv in ("fp8_e4m3", "nvfp4") for p in ("grpc", "grpc-lanes")]
    for (kv, n, _), r in rows.items():
        assert r["path_used"] == "grpc" and r["generated_tokens"] == 3  # grpc-lanes is grpc over 2 streams
        assert r["ttft_s"] > 0 and r["prefill_compute_s"] > 0 and r["transfer_s"] > 0
        per_token = 2 * 2 * (8 + 1) if kv == "nvfp4" else 2 * 2 * 16  # 2 KV heads, head_dim 16: K + V bytes
        assert r["transfer_bytes"] == 2 * -(-n // 4) * 4 * per_token  # 2 layers x pages of 4 tokens
        # the same prompt again: every page comes from the prefill's cache, the same bytes travel
        assert r["ready_transfer_bytes"] == r["transfer_bytes"] and r["ready_path_used"] == "grpc"
        assert r["ready_transfer_gbps"] > 0 and r["anchor_gbps"] > 0 and r["of_anchor"] > 0
        # the best of the 2 ready transfers is the row's; the colocated engine ran the same prompt
        assert len(r["ready_gbps_each"]) == 2 and r["ready_transfer_gbps"] == max(r["ready_gbps_each"])
        # prefill vs colocated: the median of 3 prompts' ratios, the first the row's own prompt
        each = r["prefill_of_colocated_each"]
        assert len(each) == 3 and all(x > 0 for x in each)
        assert r["colocated_ttft_s"] > 0 and each[0] == r["colocated_ttft_s"] / r["prefill_compute_s"]
        assert r["prefill_of_colocated"] == sorted(each)[1]
        # the ready transfer phase by phase, on the decode's clock: they add up to its span
        assert sorted(r["ready_phases_s"]) == sorted(PHASES) and min(r["ready_phases_s"].values()) >= 0
        assert sum(r["ready_phases_s"].values()) == pytest.approx(r["ready_transfer_s"], rel=1e-6, abs=1e-9)
        # the engine's process sent the bytes (--kv-sender auto on the CPU): no sender process counters
        assert r["ready_sender_export_s"] is None and r["ready_sender_export_wait_s"] is None
    assert [(s["path"], s["prompt_len"]) for s in doc["summary"]] == \
        [("grpc", 40), ("grpc-lanes", 40)]
    assert doc["setup"]["grpc_lanes"] == 2
    assert all(s["bytes_ratio"] == 0.5625 for s in doc["summary"])
    assert doc["summary"] == summarize(doc["rows"]) and doc["goal_ratio"] == 0.6
    md = out_md.read_text()
    assert "| kv dtype | prompt | path | TTFT s |" in md and "prefill vs colocated" in md and "best of 2" in md and "median over 3 unique prompts" in md and "| grpc | 40 |" in md and "Command: `python -m" in md
    assert (tmp_path / "logs" / "decode-nvfp4-grpc.log").exists()
    assert [(r["channels"], r["keep_freed_blocks"], r["http2_max_frame_bytes"]) for r in doc["anchors"]["raw_grpc"]] \
        == [(1, False, 0), (4, False, 0), (1, True, 0), (1, True, (1 << 24) - 1), (4, True, (1 << 24) - 1)]
    assert "| kv dtype | prompt | path | ready transfer ms | first page ms |" in md and "stream GB/s" in md
    assert "| sender: exports ms | sender: waiting for exports ms |" in md
    assert "| raw grpcio, 2 processes |" in md and "heap setting" in md and "HTTP/2 frames up to" in md
    raw = doc["anchors"]["raw_grpc"]  # grpc judged against raw's best single stream, grpc-lanes against its best
    assert {r["anchor_gbps"] for r in doc["rows"] if r["path"] == "grpc"} == \
        {max(x["best_gb_s"] for x in raw if x["channels"] == 1)}
    assert {r["anchor_gbps"] for r in doc["rows"] if r["path"] == "grpc-lanes"} == {max(x["best_gb_s"] for x in raw)}


def test_the_share_ratio_meets_the_goal_only_at_or_below_0_6():
    def row(kv, share, path="grpc"):
        return {"kv_dtype": kv, "prompt_len": 8, "path": path, "transfer_share": share, "transfer_bytes": 9}

    met = summarize([row("nvfp4", 0.06), row("fp8_e4m3", 0.1), row("nvfp4", 0.07, "cuda-ipc"),
                     row("fp8_e4m3", 0.1, "cuda-ipc")])
    assert [(s["path"], round(s["share_ratio"], 3), s["goal_met"]) for s in met] == [
        ("cuda-ipc", 0.7, False), ("grpc", 0.6, True)]


def test_repeats_below_one_are_refused_with_a_usage_error(capsys):
    import pytest

    for flag in ("--ready-repeats", "--compute-repeats"):
        with pytest.raises(SystemExit) as e:
            main(["--device", "cpu", flag, "0"])
        assert e.value.code == 2 and f"{flag} must be >= 1" in capsys.readouterr().err


def test_the_phase_table_gives_the_stream_rate_and_a_sender_processs_exports():
    from benchmarks.transfer.report import phase_table

    phases = {"first_page": 0.002, "stream": 0.1, "done": 0.001, "drain": 0.003, "finish": 0.004}
    row = {"kv_dtype": "nvfp4", "prompt_len": 32768, "path": "grpc", "ready_transfer_s": 0.11,
           "ready_transfer_bytes": 300_000_000, "ready_phases_s": phases, "ready_sender_export_s": 0.05,
           "ready_sender_export_wait_s": 0.02}
    threaded = {**row, "path": "grpc-lanes", "ready_sender_export_s": None, "ready_sender_export_wait_s": None}
    lines = phase_table([row, threaded, {"kv_dtype": "fp8_e4m3", "prompt_len": 8, "path": "grpc"}]).splitlines()
    assert len(lines) == 4  # header, rule, and one line per row with phases (the third has none)
    assert lines[2] == "| nvfp4 | 32,768 | grpc | 110.0 | 2.0 | 100.0 | 1.0 | 3.0 | 4.0 | 3.00 | 50.0 | 20.0 |"
    assert lines[3].endswith("| 3.00 | - | - |")


def test_the_framing_benchmark_runs_on_cpu_and_writes_its_table(tmp_path):
    """benchmarks/transfer/bench_framing.py: one export's host work per dtype and payload size (no timing
    asserted); each export is the 8 messages of 4 MiB of pages the grpc path sends."""
    from benchmarks.transfer.bench_framing import main as framing_main

    out_json, out_md = tmp_path / "framing.json", tmp_path / "framing.md"
    assert framing_main(["--repeats", "3", "--out-json", str(out_json), "--out-md", str(out_md)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["kv_dtype"], r["payload_scale"]) for r in rows] == [
        ("nvfp4", 128), ("nvfp4", 1), ("fp8_e4m3", 128), ("fp8_e4m3", 1)]
    full = [r for r in rows if r["payload_scale"] == 1]
    assert all(8 * (4 << 20) - 8 * 18432 < r["export_bytes"] <= 8 * (4 << 20) + 8 * 4096 for r in full), full
    assert all(r["export_us"] > 0 and r["frame_us_per_message"] > 0 and r["export_us_beside_busy_thread"] > 0 for r in rows)
    assert "| nvfp4 | full |" in out_md.read_text()
