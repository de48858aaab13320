"""benchmarks.kernels.ncu_bytes: the decode's DRAM bytes against its pages' bytes, read from the Nsight Compute CSV
that pipeline stage tma_ncu_bytes wrote on an H100 (committed under docs/benchmarks/ncu)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.kernels import ncu_bytes

_NCU = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "ncu"


def test_each_profiled_launch_is_paired_with_its_metrics_and_the_pages_it_reads():
    rows = ncu_bytes.parse((_NCU / "decode_bytes_h100.csv").read_text())
    assert [(r.config, r.shape) for r in rows[:5]] == [
        ("gluon-tma_nw1_bw32_st2_p12", "44x32768"), ("gluon-tma_nw1_bw32_st2_p12", "84x32768"),
        ("gluon-tma_nw1_bw32_st2_p12", "10x163840"), ("gluon-tma_nw1_bw32_st2_p12", "128x4096"),
        ("gluon-tma_nw1_bw32_st2_p32_lean", "44x32768")]
    first = rows[0]
    assert first.pages_gb == pytest.approx(44 * 32768 * 8 * 2 * (64 + 8) / 1e9)
    assert first.dram_read_gb == pytest.approx(1.789110784)
    assert first.dram_over_pages == pytest.approx(1.789110784e9 / (44 * 32768 * 8 * 144))
    # the one-head kernels fetch scale sectors more than once; the grouped kernel reads the pages' bytes
    assert all(r.dram_over_pages > 1.04 for r in rows)
    grouped = ncu_bytes.parse((_NCU / "decode_bytes_grouped_h100.csv").read_text())
    assert len(grouped) == 8 and all(r.config.endswith("_hg4") for r in grouped)
    assert all(abs(r.dram_over_pages - 1) < 0.005 and abs(r.l2_sectors_over_pages - 1) < 0.005 for r in grouped)


def test_the_report_writes_its_table_and_json(tmp_path, capsys):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert ncu_bytes.main([str(_NCU / "decode_bytes_grouped_h100.csv"), "--gpu", "H100", "--out-json", str(out_json),
                           "--out-md", str(out_md)]) == 0
    assert "| gluon-tma_nw1_bw32_st2_p12_hg4 | 44x32768 | 9 |" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["gpu"] == "H100"
    assert "DRAM / pages" in out_md.read_text()


def test_a_csv_without_a_profiled_launch_is_refused(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== nothing\n")
    with pytest.raises(SystemExit):
        ncu_bytes.main([str(empty), "--gpu", "H100"])
    broken = tmp_path / "broken.csv"
    broken.write_text("launched gluon-tma_x at 1x32768: 3 splits\n")
    with pytest.raises(ValueError, match="no decode-kernel metrics"):
        ncu_bytes.parse(broken.read_text())
