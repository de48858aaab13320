"""benchmarks/accuracy/lm_eval_kv.py: what it reads from lm-eval's output (bits per byte per document, paired
differences from bf16) on CPU without lm-eval, and, with lm-eval installed (``--run-slow``), a real run of two
variants of a tiny model through ``nvfp4-serve up``."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.accuracy.lm_eval_kv import TASK, add_paired, main, render, summarize


def _out(lls: list[float]) -> dict:
    samples = [{"doc_id": i, "filtered_resps": [ll]} for i, ll in reversed(list(enumerate(lls)))]  # any order
    agg = {"word_perplexity,none": 3.0, "byte_perplexity,none": 1.5, "bits_per_byte,none": 0.58}
    return {"samples": {TASK: samples}, "results": {TASK: agg}}


def test_bits_per_byte_per_document_and_the_paired_difference_from_bf16():
    docs = ["ab", "cdef"]
    base = summarize("bf16", _out([-2.0, -4.0]), docs)
    other = summarize("nvfp4", _out([-2.2, -4.0]), docs)
    assert base["bits_per_byte_per_doc"] == pytest.approx([2 / (2 * math.log(2)), 4 / (4 * math.log(2))])
    rows = [{**base, "seconds": 1.0}, {**other, "seconds": 1.0}]
    add_paired(rows)
    assert rows[0]["bpb_delta_vs_bf16"] == 0
    assert rows[1]["bpb_delta_vs_bf16"] == pytest.approx(0.2 / (2 * math.log(2)) / 2)
    md = render({"model": "m", "device": "cpu", "lm_eval": "0", "num_docs": 2, "doc_tokens": 8, "chunk": 4,
                 "command": "c", "rows": rows})
    assert "| nvfp4 | " in md and "| 3.0000 | 1.50000 | 0.58000 | 1 |" in md
    with pytest.raises(RuntimeError, match="logged 2 samples for 3 documents"):
        summarize("bf16", _out([-1.0, -1.0]), ["a", "b", "c"])


@pytest.mark.slow
def test_two_variants_scored_through_the_server(tiny_model_dir, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval-harness is not installed (pip install -e .[eval])")
    out, md = tmp_path / "lm.json", tmp_path / "lm.md"
    assert main(["--model", tiny_model_dir, "--docs", "3", "--doc-tokens", "48", "--chunk", "8",
                 "--variants", "bf16", "nvfp4 (scale 1.0)", "--out", str(out), "--md", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bf16", "nvfp4 (scale 1.0)"]
    assert rows[1]["bits_per_byte"] > 0 and rows[1]["bits_per_byte"] != rows[0]["bits_per_byte"]
