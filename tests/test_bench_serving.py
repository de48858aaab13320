"""The serving benchmark client: its figures on exact timelines, its prompts, and the committed commands
(`run --launch`, `sweep --launch`, `plot`) against a real `nvfp4-serve up` on the tiny model on CPU.

No timing is asserted: only that the JSON is consistent (counts, tokens, TTFT within the run)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.serving.__main__ import main
from benchmarks.serving.client import RequestResult
from benchmarks.serving.dataset import WARMUP_STREAM, candidate_token_ids, random_prompts
from benchmarks.serving.launch_args import split_launch
from benchmarks.serving.stats import full_batch_intervals, peak_batch_decode, summarize

STEP = 0.125  # exact in binary: window sums below are exact


def _request(index: int, first: float, num_chunks: int, tokens_per_chunk: int = 1) -> RequestResult:
    times = [first + k * STEP for k in range(num_chunks)]
    return RequestResult(index, start=first - 0.25, chunk_times=times, end=times[-1], prompt_tokens=16,
                         completion_tokens=num_chunks * tokens_per_chunk, finish_reason="length")


def test_peak_batch_decode_is_the_best_full_window_while_the_batch_is_full():
    a = _request(0, 0.0, 25)  # decoding over [0, 3]
    b = _request(1, 0.5, 17, tokens_per_chunk=2)  # decoding over [0.5, 2.5]; each chunk carries 2 tokens
    assert full_batch_intervals([a, b], 2) == [(0.5, 2.5)]
    out = peak_batch_decode([a, b], batch=2, window_s=1.0)
    # Best window e.g. [0.625, 1.625): 8 chunks of a (1 token) + 8 of b (2 tokens); b's first chunk never
    # counts.
    assert out["peak_decode_tok_s"] == 24.0
    # Over [0.5, 2.5]: a's 17 chunks + b's 16 later chunks x 2 tokens, in 2 s.
    assert out["full_batch_decode_tok_s"] == pytest.approx(49 / 2.0)
    assert out["full_batch_s"] == 2.0
    shorter = peak_batch_decode([a, b], batch=2, window_s=2.5)  # no full stretch lasts 2.5 s
    assert shorter["peak_decode_tok_s"] is None
    assert shorter["full_batch_decode_tok_s"] == out["full_batch_decode_tok_s"]
    never = peak_batch_decode([a, b], batch=3, window_s=1.0)
    assert never["peak_decode_tok_s"] is None and never["full_batch_decode_tok_s"] is None


def test_chunks_with_token_counts_weigh_exactly_what_they_carry():
    a = _request(0, 0.0, 9)  # [0, 1]: 9 chunks
    a.chunk_tokens = [1, 1, 3, 1, 1, 1, 1, 1, 1]
    a.completion_tokens = sum(a.chunk_tokens)
    # Over the whole [0, 1]: the 8 chunks after the first carry 10 tokens (by count; the old per-request average
    # would give 8 x 11 / 9).
    assert peak_batch_decode([a], batch=1, window_s=1.0)["full_batch_decode_tok_s"] == 10.0


class _Lines:
    """An SSE body as ``read_stream`` reads it (only ``aiter_lines`` is used)."""

    def __init__(self, events: list[dict]) -> None:
        self.lines = [f"data: {json.dumps(e)}" for e in events] + ["", "data: [DONE]"]

    async def aiter_lines(self):
        for line in self.lines:
            yield line


def test_read_stream_times_token_ids_when_the_server_sends_them_else_text():
    import asyncio

    from benchmarks.serving.client import read_stream

    with_ids = [{"choices": [{"index": 0, "text": "", "token_ids": [5]}]},  # a token without text yet
                {"choices": [{"index": 0, "text": "ab", "token_ids": [6, 7]}]},
                {"choices": [{"index": 0, "text": "c", "token_ids": [], "finish_reason": "length"}]},  # tail
                {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}]
    r, out = RequestResult(0, 0.0), []
    asyncio.run(read_stream(_Lines(with_ids), r, 0.0, out))
    assert (len(r.chunk_times), r.chunk_tokens, out) == (2, [1, 2], [5, 6, 7])
    assert (r.finish_reason, r.completion_tokens) == ("length", 3)
    text_only = [{"choices": [{"index": 0, "text": ""}]}, {"choices": [{"index": 0, "text": "hi"}]},
                 {"choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}]
    r = RequestResult(1, 0.0)
    asyncio.run(read_stream(_Lines(text_only), r, 0.0))
    assert (len(r.chunk_times), r.chunk_tokens, r.finish_reason) == (2, [], "stop")


def test_a_hand_over_at_the_same_instant_does_not_count_as_full_batch():
    a = _request(0, 0.0, 9)  # [0, 1]
    b = _request(1, 0.0, 17)  # [0, 2]
    c = _request(2, 1.0, 9)  # [1, 2]: starts when a ends
    assert full_batch_intervals([a, b, c], 2) == [(0.0, 1.0), (1.0, 2.0)]
    failed = RequestResult(3, 0.0, [0.1], 2.0, error="HTTP 503: overloaded")
    assert full_batch_intervals([a, failed], 2) == []


def test_summary_counts_only_successful_requests():
    ok = _request(0, 0.0, 8)
    bad = RequestResult(1, 0.0, error="HTTP 429: busy", end=0.5)
    s = summarize([ok, bad], duration_s=2.0, batch=1, window_s=1.0)
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, ["HTTP 429: busy"])
    assert s["total_output_tokens"] == 8 and s["output_tok_s"] == 4.0
    assert s["ttft_ms"]["max"] == pytest.approx(250.0)
    assert s["itl_ms"]["median"] == pytest.approx(STEP * 1e3)
    assert s["tok_s_per_user"] == pytest.approx(1 / STEP)


def test_prompts_have_the_exact_length_no_special_token_and_depend_only_on_the_seed(tiny_model_dir):
    ids = candidate_token_ids(tiny_model_dir, 512)
    assert not {0, 1, 2} & set(ids.tolist()) and ids.max() < 512
    prompts = random_prompts(ids, 3, 33, seed=7)
    assert prompts.shape == (3, 33) and set(prompts.ravel().tolist()) <= set(ids.tolist())
    assert np.array_equal(prompts, random_prompts(ids, 3, 33, seed=7))
    assert not np.array_equal(prompts, random_prompts(ids, 3, 33, seed=8))
    assert not np.array_equal(prompts, random_prompts(ids, 3, 33, seed=7, stream=WARMUP_STREAM))
    assert candidate_token_ids(tiny_model_dir, 300).max() < 300


def test_launch_takes_every_argument_after_it_and_exactly_one_target_is_required(capsys):
    assert split_launch(["run", "--input-len", "4", "--launch", "--port", "9", "--model", "m"]) == (
        ["run", "--input-len", "4"], ["--port", "9", "--model", "m"])
    assert split_launch(["run", "--base-url", "http://x"]) == (["run", "--base-url", "http://x"], None)
    with pytest.raises(SystemExit) as e:
        main(["run", "--input-len", "4", "--output-len", "2", "--concurrency", "1", "--num-prompts", "1"])
    assert e.value.code == 2 and "exactly one of --base-url" in capsys.readouterr().err


def _up_args(model_dir: str, *extra: str) -> list[str]:
    return ["--launch", "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--page-size", "4",
            *extra]


def test_run_launch_against_a_real_deployment_writes_consistent_json(tiny_model_dir, tmp_path):
    out = tmp_path / "run.json"
    argv = ["run", "--input-len", "16", "--output-len", "8", "--concurrency", "2", "--num-prompts", "4",
            "--seed", "3", "--no-progress", "--out", str(out), *_up_args(tiny_model_dir)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["launched"] and doc["command"].startswith("python -m benchmarks.serving run ")
    assert doc["gpu"] == "cpu"
    dep = doc["deployment"]
    assert (dep["kv_dtype"], dep["page_size"], dep["num_layers"]) == ("nvfp4", 4, 2)
    assert dep["num_layers_note"] == "" and doc["max_concurrency"] == dep["pool_pages_total"] // 6
    assert dep["pool_pages_total"] > 0 and dep["num_decode_workers"] == 1
    [p] = doc["points"]
    assert (p["completed"], p["failed"], p["concurrency"], p["batch"]) == (4, 0, 2, 2)
    assert p["total_input_tokens"] == 4 * 16 and p["total_output_tokens"] == 4 * 8
    assert p["input_len_mismatch"] == 0 and p["output_len_mismatch"] == 0
    assert 0 < p["ttft_ms"]["max"] / 1e3 <= p["duration_s"]
    reqs = p["requests"]
    assert sorted(r["index"] for r in reqs) == [0, 1, 2, 3]
    for r in reqs:
        assert r["error"] == "" and r["finish_reason"] == "length"
        assert 0 <= r["start"] < r["start"] + r["ttft"] <= r["end"] <= p["duration_s"]
        assert len(r["itl"]) == r["num_chunks"] - 1 and 1 <= r["num_chunks"] <= 8
        # return_token_ids: every chunk says how many tokens it carries, and they add up to the usage count
        assert len(r["chunk_tokens"]) == r["num_chunks"] and sum(r["chunk_tokens"]) == 8
    assert p["cached_tokens"] == sum(r["cached_tokens"] for r in reqs)
    metrics = p["server"]["decode_metrics"]["sum"]
    assert metrics["generated_tokens_total"] == 4 * 8  # (requests_total can miss a request: see the report)
    assert p["server"]["flush_cache"]["flushed"] is True
    pool = p["server"]["pool"]
    assert pool["num_samples"] >= 1 and pool["pages_total"] == dep["pool_pages_total"]


def test_sweep_launch_writes_one_point_per_concurrency_and_plot_draws_or_says_what_is_missing(
        tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["sweep", "--input-len", "8", "--output-len", "4", "--concurrency", "1", "2", "--num-prompts", "2",
            "--warmup", "0", "--no-save-requests", "--no-progress", "--out", str(out),
            *_up_args(tiny_model_dir, "--kv-cache-dtype", "fp8_e4m3")]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["deployment"]["kv_dtype"] == "fp8_e4m3"
    assert [p["concurrency"] for p in doc["points"]] == [1, 2]
    for p in doc["points"]:
        assert (p["completed"], p["total_output_tokens"]) == (2, 2 * 4) and "requests" not in p
    capsys.readouterr()
    code = main(["plot", str(out), "--out-dir", str(tmp_path / "png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 1 and 'pip install -e ".[bench]"' in capsys.readouterr().err
        return
    assert code == 0
    for name in ("throughput_vs_concurrency.png", "pareto.png", "ttft_vs_concurrency.png"):
        assert (tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
