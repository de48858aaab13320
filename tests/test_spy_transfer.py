"""The transfer profiler's reading of py-spy output (benchmarks/transfer/spy_transfer.py), and a CPU run of the
whole script where py-spy is installed."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.transfer.services import REPO_ROOT
from benchmarks.transfer.spy_transfer import main, markdown, parse_collapsed, summarize


def test_samples_are_counted_per_thread_with_the_innermost_frame_of_ours_and_the_leaf():
    root = str(REPO_ROOT)
    text = "\n".join([
        (f"process 12:\"python -m decode_svc\";thread (0x1a): kv-write_0;_worker (/usr/lib/thread.py:80);"
        f"write ({root}/svc_common/kv_copy.py:190);copy_ (torch/_tensor.py:10) 30"),
        f"thread (0x1b): kv-write_1;_worker (/usr/lib/thread.py:80);write ({root}/svc_common/kv_copy.py:190) 10",
        "thread (77): MainThread;run (/usr/lib/asyncio/runners.py:118) 50",
        "garbage line without a count",
        ""])
    parsed = parse_collapsed(text)
    assert sorted(parsed) == ["MainThread", "kv-write"]  # pool threads folded into one row
    w = parsed["kv-write"]
    assert w["samples"] == 40
    assert w["ours"] == {"svc_common/kv_copy.py:190 write": 40}
    assert w["leaf"] == {"torch/_tensor.py:10 copy_": 30, "svc_common/kv_copy.py:190 write": 10}
    assert parsed["MainThread"]["ours"] == {"(none of ours)": 50}
    rows = summarize(parsed, rate=100, seconds=1.0)
    assert [(r["thread"], r["share"]) for r in rows] == [("MainThread", 0.5), ("kv-write", 0.4)]
    md = markdown({"length": 8, "command": "x", "results": [
        {"kv_dtype": "nvfp4", "mode": "gil", "process": "decode", "transfers": 3, "transfer_gbps": 1.5,
         "threads": rows}]})
    assert "## nvfp4 · decode · gil (3 transfers, 1.50 GB/s)" in md
    assert "| kv-write | 40% | svc_common/kv_copy.py:190 write (40%) |" in md


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_cpu_run_samples_both_services(tiny_model_dir, tmp_path):
    out_json = tmp_path / "spy.json"
    rc = main(["--model", tiny_model_dir, "--device", "cpu", "--length", "96", "--seconds", "1", "--rate", "50",
               "--kv-dtypes", "nvfp4", "--grpc-lanes", "2", "--extra", "--dtype float32 --warmup-len 8 --page-size 4",
               "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json), "--out-md", str(tmp_path / "s.md")])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert [(r["mode"], r["process"]) for r in doc["results"]] == [
        ("cpu", "prefill"), ("cpu", "decode"), ("gil", "prefill"), ("gil", "decode")]
    assert all(r["transfers"] > 0 for r in doc["results"])
    assert "via grpc over 2 lanes" in (tmp_path / "logs" / "decode-nvfp4-grpc-lanes.log").read_text()
