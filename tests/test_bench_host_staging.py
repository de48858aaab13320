"""The host-staging benchmark runs on CPU at tiny settings and writes its JSON and table (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine.bench_host_staging import main


def test_cpu_smoke_run_writes_every_shape_and_both_paths(tmp_path):
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    assert main(["--shapes", "2x100", "3x9000", "--steps", "17", "--rounds", "1", "--out", str(out),
                 "--md", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(2, 100), (3, 9000)]
    keys = ("staging_refill_ms", "staging_append_only_ms", "csr_mask_ms", "csr_rows_ms")
    assert all(r[k] > 0 for r in rows for k in keys)
    assert "| 3 x 9000 |" in md.read_text()


@pytest.mark.parametrize("bad", [["--shapes", "44"], ["--shapes", "0x100"], ["--steps", "0"]])
def test_bad_flags_are_usage_errors(bad, tmp_path):
    with pytest.raises(SystemExit) as e:
        main([*bad, "--out", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md")])
    assert e.value.code == 2
