"""The agentic multi-turn benchmark: trace format, generator, prompt ids, the router's
``return_token_ids``, and a replay sweep against a real `nvfp4-serve up` (tiny model, CPU, 2 decode workers,
a small pool) with its report. No timing is asserted."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import replace

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from benchmarks.agentic import trace as tf
from benchmarks.agentic.__main__ import is_agentic
from benchmarks.agentic.generate import AgentTraceConfig, fit_to_pool, generate
from benchmarks.agentic.prompts import PromptBuilder
from benchmarks.agentic.replay import PointConfig, Replay, replay_sessions
from benchmarks.agentic.report import cache_limits, markdown, read_results, write_report
from benchmarks.agentic.sweep import build_parser, deployments, pool_tokens_for
from benchmarks.serving.__main__ import main as bench_main
from benchmarks.serving.dataset import candidate_token_ids
from router.generation import ChoiceFinished, ChoiceStarted, ChoiceText
from router.openai_protocol import SamplingOptions
from router.responses import Job, sse_body
from router.sse import parse_sse

SMALL = AgentTraceConfig(num_sessions=4, min_turns=3, max_turns=6, shared_prefix_tokens=64,
                         first_user_median=20, tool_result_median=40, tool_result_max=400, output_median=8,
                         output_max=32, user_median=6, max_context_tokens=600, seed=5)


# -- trace format -------------------------------------------------------------------------------------------

def test_trace_round_trips_through_jsonl(tmp_path):
    trace = generate(SMALL)
    path = tf.save(trace, tmp_path / "t.jsonl")
    assert tf.load(path) == trace
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["schema"] == tf.SCHEMA and len(lines) == 1 + trace.num_turns
    # turns of different sessions may interleave; sessions keep the order of their first line
    body = lines[1:]
    shuffled = [lines[0], *body[::2], *body[1::2]]
    again = tf.parse(shuffled)
    assert {s.session_id: s for s in again.sessions} == {s.session_id: s for s in trace.sessions}
    text_turn = tf.Turn("x", 0, "user", 4, 0.0, text="def f():")
    assert tf.parse([json.dumps({"schema": tf.SCHEMA, "shared_prefix_text": "sys"}),
                     json.dumps(text_turn.to_json())]).sessions[0].turns[0] == text_turn


HEADER = json.dumps({"schema": tf.SCHEMA, "shared_prefix_tokens": 8, "seed": 0})
T0 = {"session_id": "a", "turn": 0, "kind": "user", "new_tokens": 5, "output_tokens": 4, "think_time_s": 0}


def _line(**changes) -> str:
    turn = {**T0, **changes}
    return json.dumps({k: v for k, v in turn.items() if v is not None})


BAD_TRACES = [
    ([], "empty trace"),
    (['{"schema": "other/1"}'], ":1: the first line must be the header"),
    ([HEADER, "{not json"], ":2: not valid JSON"),
    ([HEADER, "[1, 2]"], ":2: each line must be a JSON object"),
    ([HEADER, _line(tokens=3)], ":2: unknown key(s) ['tokens']"),
    ([HEADER, _line(output_tokens=None)], ":2: missing key(s) ['output_tokens']"),
    ([HEADER, _line(output_tokens=0)], ":2: output_tokens must be an integer >= 1"),
    ([HEADER, _line(new_tokens=True)], ":2: new_tokens must be an integer >= 1, got True"),
    ([HEADER, _line(new_tokens="5")], ":2: new_tokens must be an integer"),
    ([HEADER, _line(text="hi")], ":2: a turn gives exactly one of new_tokens (a count) and text"),
    ([HEADER, _line(new_tokens=None)], ":2: a turn gives exactly one of new_tokens"),
    ([HEADER, _line(kind="assistant")], ":2: kind must be one of"),
    ([HEADER, _line(think_time_s=-1)], ":2: think_time_s must be a finite number >= 0"),
    ([HEADER, _line(session_id="")], ":2: session_id must be a printable string"),
    ([HEADER, _line(), _line(turn=0)], ":3: session 'a' turn 0 already given on line 2"),
    ([HEADER, _line(), _line(turn=2)], ":2: session 'a' has no turn 1"),
    ([HEADER, _line(turn=1)], ":2: session 'a' has no turn 0"),
    ([HEADER], "the trace has no session"),
    ([json.dumps({"schema": tf.SCHEMA, "seed": -1})], ":1: seed must be an integer >= 0"),
    ([json.dumps({"schema": tf.SCHEMA, "extra": 1})], ":1: unknown header key(s) ['extra']"),
]


@pytest.mark.parametrize("lines, fragment", BAD_TRACES)
def test_a_broken_trace_is_refused_with_the_line_that_breaks_it(tmp_path, lines, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(tf.TraceError) as e:
        tf.load(path)
    assert fragment in str(e.value) and str(path) in str(e.value)


# -- generator ----------------------------------------------------------------------------------------------

def test_generator_is_seeded_and_a_larger_trace_extends_a_smaller_one():
    a, b = generate(SMALL), generate(SMALL)
    assert tf.dumps(a) == tf.dumps(b)
    assert tf.dumps(generate(replace(SMALL, seed=6))) != tf.dumps(a)
    big = generate(replace(SMALL, num_sessions=9))
    assert big.sessions[:4] == a.sessions and len(big.sessions) == 9


def test_default_trace_has_the_coding_agent_shape():
    cfg = AgentTraceConfig(num_sessions=12)
    trace = generate(cfg)
    s = trace.stats()
    assert trace.shared_prefix_tokens == cfg.shared_prefix_tokens == 12000
    for session in trace.sessions:
        first = session.turns[0]
        assert first.kind == "user" and first.think_time_s == 0
        lens = session.context_lens(trace.shared_prefix_tokens)
        assert all(b > a for a, b in itertools.pairwise(lens))  # contexts only grow
        assert lens[-1] <= cfg.max_context_tokens
    assert s["final_context_tokens"]["max"] > 100_000 and s["final_context_tokens"]["median"] > 50_000
    tool, user = s["tool_result_tokens"], [t.new_tokens for x in trace.sessions for t in x.turns[1:]
                                           if t.kind == "user"]
    assert tool["max"] > 10 * tool["median"]  # a heavy tail of huge tool results
    assert user and max(user) < tool["max"] and np.median(user) < tool["median"]  # user turns are short
    kinds = [t.kind for x in trace.sessions for t in x.turns[1:]]
    assert 0.02 < kinds.count("user") / len(kinds) < 0.2


def test_scale_shrinks_token_counts_and_keeps_the_sessions():
    full = generate(SMALL)
    small = generate(replace(SMALL, scale=0.1, think_time_scale=0.0))
    assert small.shared_prefix_tokens == round(0.1 * full.shared_prefix_tokens)
    for a, b in zip(full.sessions, small.sessions, strict=True):
        assert [(t.turn, t.kind) for t in a.turns] == [(t.turn, t.kind) for t in b.turns]
        assert a.session_id == b.session_id
        for ta, tb in zip(a.turns, b.turns, strict=True):
            assert tb.new_tokens == max(1, round(0.1 * ta.new_tokens))
            assert tb.output_tokens == max(1, round(0.1 * ta.output_tokens)) and tb.think_time_s == 0


def test_fit_to_pool_makes_every_session_end_at_pool_over_saturation():
    cfg = fit_to_pool(AgentTraceConfig(num_sessions=16, output_median=32), pool_tokens=540_000,
                      saturate_at=12, turns_to_fill=12)
    trace = generate(cfg)
    finals = [s.context_lens(trace.shared_prefix_tokens)[-1] for s in trace.sessions]
    # the shared prefix is cached once: 12 sessions of shared + (540K - shared) / 12 fill the pool exactly
    shared = cfg.shared_prefix_tokens
    cap = shared + (540_000 - shared) // 12
    assert cfg.max_context_tokens == cap and max(finals) <= cap and min(finals) > cap - 100
    assert shared + 12 * (cap - shared) <= 540_000 < shared + 13 * (cap - shared)
    assert 6 <= trace.stats()["turns_per_session"]["mean"] <= 24
    with pytest.raises(ValueError, match="lower --turns-to-fill"):
        fit_to_pool(AgentTraceConfig(), pool_tokens=100_000, saturate_at=8, turns_to_fill=50)


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--min-turns"):
        AgentTraceConfig(min_turns=9, max_turns=3)
    with pytest.raises(ValueError, match="--max-context-tokens"):
        AgentTraceConfig(max_context_tokens=1000)
    with pytest.raises(ValueError, match="--scale"):
        AgentTraceConfig(scale=0)


# -- prompt ids ---------------------------------------------------------------------------------------------

def test_prompt_ids_are_shared_where_the_trace_shares_and_distinct_elsewhere(tiny_model_dir):
    candidates = candidate_token_ids(tiny_model_dir, 512)
    trace = generate(SMALL)
    builder = PromptBuilder(trace, candidates)
    assert builder.shared == PromptBuilder(trace, candidates).shared and len(builder.shared) == 64
    s0, s1 = trace.sessions[0], trace.sessions[1]
    a, b = builder.new_ids(s0.turns[1]), builder.new_ids(s1.turns[1])
    assert len(a) == s0.turns[1].new_tokens and a != b and a == builder.new_ids(s0.turns[1])
    assert set(a) <= set(candidates.tolist())
    # the ids of a session do not depend on the rest of the trace
    assert PromptBuilder(trace.head(1), candidates).new_ids(s0.turns[1]) == a
    text_trace = tf.Trace((tf.SessionTrace("x", (tf.Turn("x", 0, "user", 4, text="def fib(n):"),)),),
                          shared_prefix_text="import os\n")
    tb = PromptBuilder(text_trace, candidates, tiny_model_dir)
    assert tb.shared and tb.new_ids(text_trace.sessions[0].turns[0])
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        PromptBuilder(text_trace, candidates, "/nonexistent")


# -- router: return_token_ids ------------------------------------------------------------------------------

def test_return_token_ids_must_be_a_boolean_and_is_refused_on_chat(tiny_model_dir):
    from nvfp4_serve.launcher import free_port
    from router.app import create_app
    from router.config import RouterConfig

    cfg = RouterConfig(decode_addresses=(f"127.0.0.1:{free_port()}",), model_dir=tiny_model_dir,
                       prefill_addresses=(f"127.0.0.1:{free_port()}",), served_model_name="tiny",
                       health_check_interval_s=60.0)
    with TestClient(create_app(cfg)) as client:
        r = client.post("/v1/completions",
                        json={"model": "tiny", "prompt": [5, 6], "return_token_ids": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"
        assert "valid boolean" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"model": "tiny", "return_token_ids": True,
                                                      "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "/v1/completions only" in r.json()["error"]["message"]


OPTS = SamplingOptions(max_tokens=8, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, stop=(),
                       stop_token_ids=(), ignore_eos=True)


def _stream(job: Job, events: list) -> list[dict]:
    async def rest():
        for e in events[1:]:
            yield e

    async def collect() -> bytes:
        return b"".join([c async for c in sse_body(job, rest(), events[0], 0.0)])

    return [json.loads(p) for p in parse_sse(asyncio.run(collect()))[:-1]]


def test_streamed_chunks_carry_each_chunks_token_ids_and_the_prompt_ids_once():
    events = [ChoiceStarted(0, 0), ChoiceText(0, "", (7,)), ChoiceText(0, "ab", (8, 9)), ChoiceText(0, "!"),
              ChoiceFinished(0, "length", 3)]
    job = Job("completion", "c", "tiny", [(1, 2, 3)], [OPTS], 1, True, False, return_token_ids=True)
    chunks = [c["choices"][0] for c in _stream(job, events)]
    assert [(c["text"], c["token_ids"]) for c in chunks] == [("", [7]), ("ab", [8, 9]), ("!", []), ("", [])]
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3] and all("prompt_token_ids" not in c for c in chunks[1:])
    plain = [c["choices"][0] for c in _stream(replace(job, return_token_ids=False), events)]
    assert [c["text"] for c in plain] == ["ab", "!", ""]  # an id-only event makes no chunk without the flag
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason", "stop_reason"} for c in plain)


# -- the replayer against a scripted router ---------------------------------------------------------------

class ScriptedRouter:
    """/v1/completions as SSE with ``return_token_ids``: each prompt's answer is ids 400, 401, ...; cached
    tokens are the whole pages of the longest earlier context (prompt + answer, less its last id) that the
    prompt starts with. ``fail`` holds (session marker id, prompt length) pairs answered with HTTP 500."""

    def __init__(self, page: int = 4) -> None:
        self.page, self.contexts, self.prompts, self.fail = page, [], [], set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt, n = body["prompt"], body["max_tokens"]
        assert body["return_token_ids"] is True and body["ignore_eos"] is True and body["stream"] is True
        self.prompts.append(prompt)
        if any(len(prompt) == length and marker in prompt for marker, length in self.fail):
            return httpx.Response(500, json={"error": {"message": "scripted failure"}})
        cached = max([(len(c) - 1) // self.page * self.page for c in self.contexts if prompt[:len(c)] == c],
                     default=0)
        out = list(range(400, 400 + n))
        self.contexts.append(prompt + out)
        events = [{"choices": [{"index": 0, "text": "x", "token_ids": [t], "finish_reason": None}]}
                  for t in out]
        events.append({"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                                "prompt_tokens_details": {"cached_tokens": cached}}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


def _replay(router: ScriptedRouter, trace: tf.Trace, cfg: PointConfig) -> Replay:
    builder = PromptBuilder(trace, np.arange(10, 300))

    async def go() -> Replay:
        transport = httpx.MockTransport(router)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await replay_sessions(client, "m", trace, builder, cfg, router.page, time.perf_counter())

    return asyncio.run(go())


def test_each_turn_extends_the_previous_prompt_with_its_answer_and_new_ids():
    trace = generate(replace(SMALL, think_time_scale=0.0))
    router = ScriptedRouter()
    replay = _replay(router, trace, PointConfig(concurrency=2, num_sessions=4))
    assert (replay.num_not_sent, replay.num_sessions_completed) == (0, 4)
    assert len(replay.records) == trace.num_turns
    builder = PromptBuilder(trace, np.arange(10, 300))
    for session in trace.sessions:
        context = list(builder.shared)
        for turn in session.turns:
            context += builder.new_ids(turn)
            assert context in router.prompts
            context += list(range(400, 400 + turn.output_tokens))
    records = [r for r in replay.records if r.turn > 0]
    assert all(r.reprefill_tokens == 0 and r.cacheable_tokens == r.result.cached_tokens for r in records)
    assert {r.result.index for r in replay.records} == set(range(trace.num_turns))


def test_a_failed_turn_ends_its_session_and_the_deadline_stops_new_turns():
    trace = generate(replace(SMALL, think_time_scale=0.0))
    builder = PromptBuilder(trace, np.arange(10, 300))
    s1 = trace.sessions[1]
    marker = builder.new_ids(s1.turns[0])[0]
    length = len(builder.shared) + s1.turns[0].new_tokens + s1.turns[0].output_tokens + s1.turns[1].new_tokens
    router = ScriptedRouter()
    router.fail.add((marker, length))  # session 1's turn 1
    replay = _replay(router, trace, PointConfig(concurrency=4, num_sessions=4))
    failed = [r for r in replay.records if not r.result.ok]
    assert [(r.session_id, r.turn) for r in failed] == [(s1.session_id, 1)]
    assert "scripted failure" in failed[0].result.error and failed[0].reprefill_tokens == 0
    assert replay.num_not_sent == len(s1.turns) - 2 and replay.num_sessions_completed == 3
    # every later turn waits 0.5 s
    slow = generate(replace(SMALL, think_time_median_s=0.5, think_time_sigma=0.0))
    replay = _replay(ScriptedRouter(), slow, PointConfig(concurrency=4, num_sessions=4, max_duration_s=0.2))
    assert len(replay.records) == 4 and all(r.turn == 0 for r in replay.records)
    assert replay.num_not_sent == slow.num_turns - 4 and replay.num_sessions_completed == 0


# -- the sweep command -------------------------------------------------------------------------------------

def test_the_bench_command_routes_trace_modes_and_sizes_equal_byte_pools():
    assert is_agentic(["--trace", "t.jsonl", "--concurrency", "1"])
    assert is_agentic(["gen-trace", "--out", "x"])
    assert not is_agentic(["run", "--input-len", "4", "--launch", "--trace", "x"])
    assert pool_tokens_for("fp8_e4m3", 900) == 900 and pool_tokens_for("nvfp4", 900) == 1600
    assert pool_tokens_for("bf16", 900) == 450
    a = build_parser().parse_args(["--trace", "t", "--concurrency", "1", "--kv-dtypes", "fp8_e4m3", "nvfp4",
                                   "--equal-pool-bytes", "900"])
    assert deployments(a, ["--page-size", "4"]) == [
        ("fp8_e4m3", ["--page-size", "4", "--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "900"]),
        ("nvfp4", ["--page-size", "4", "--kv-cache-dtype", "nvfp4", "--max-total-tokens", "1600"])]
    with pytest.raises(ValueError, match="not in the launch args"):
        deployments(a, ["--kv-cache-dtype", "nvfp4"])
    with pytest.raises(ValueError, match="need --launch"):
        deployments(a, None)


REPLAY_TRACE = AgentTraceConfig(num_sessions=8, min_turns=4, max_turns=4, shared_prefix_tokens=16,
                                first_user_median=40, tool_result_median=30, tool_result_sigma=0.5,
                                tool_result_min=8, tool_result_max=120, output_median=8, output_sigma=0.3,
                                output_max=16, user_median=10, max_context_tokens=240, think_time_scale=0.0,
                                seed=0)


@pytest.fixture(scope="module")
def deployment(tiny_model_dir):
    from tests.service_procs import Launched

    # 64 pages of 4 tokens per decode worker: one session (<= 240 tokens) fits, four at once do not.
    d = Launched("--model", tiny_model_dir, "--num-decode", "2", "--page-size", "4",
                 "--max-total-tokens", "256")
    yield d
    d.stop()


def test_return_token_ids_gives_the_ids_behind_the_text(deployment, tiny_model_dir):
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    prompt = [int(x) for x in candidate_token_ids(tiny_model_dir, 512)[:20]]
    body = {"model": "x", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    with httpx.Client(base_url=deployment.url, timeout=60) as c:
        body["model"] = c.get("/v1/models").json()["data"][0]["id"]
        choice = c.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
        assert tok.decode(choice["token_ids"]) == choice["text"]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and "[DONE]" not in line]
    chunks = [e["choices"][0] for e in events]
    ids = [i for ch in chunks for i in ch["token_ids"]]
    assert len(ids) == 6 and tok.decode(ids) == "".join(ch["text"] for ch in chunks)
    assert chunks[0]["prompt_token_ids"] == prompt


def test_replay_sweep_reuses_each_sessions_prefix_on_one_worker_then_evicts_under_pressure(
        deployment, tmp_path, capsys):
    trace_path = tf.save(generate(REPLAY_TRACE), tmp_path / "trace.jsonl")
    out = tmp_path / "agentic.json"
    code = bench_main(["--trace", str(trace_path), "--concurrency", "1", "8", "--sessions-per-point", "8",
                       "--no-progress", "--out", str(out), "--base-url", deployment.url])
    assert code == 0, capsys.readouterr().err
    doc = read_results(out)
    [run] = doc["runs"]
    assert run["kv_dtype"] == "nvfp4" and run["gpu"] == "cpu" and doc["trace"]["stats"]["num_sessions"] == 8
    points = {p["concurrency"]: p for p in run["points"]}
    assert sorted(points) == [1, 8]
    for p in points.values():
        assert (p["completed"], p["failed"], p["turns_not_sent"], p["sessions_completed"]) == (32, 0, 0, 8)
        assert p["integrity_ok"] and not p["failed_point"]
        for report in p["server"]["integrity"].values():
            assert report["ok"] and report["num_in_use"] == 0
        assert p["cache_hit_rate_later_turns"] > 0
        turns = p["turns"]
        assert all(t["completion_tokens"] > 0 and t["prompt_tokens"] > 0 for t in turns)
        # turn t+1's prompt = turn t's prompt + output + new tokens, exactly
        by_session: dict[str, list[dict]] = {}
        for t in turns:
            by_session.setdefault(t["session_id"], []).append(t)
        for ts in by_session.values():
            ts.sort(key=lambda t: t["turn"])
            for prev, cur in itertools.pairwise(ts):
                context = prev["prompt_tokens"] + prev["completion_tokens"]
                assert cur["prompt_tokens"] == context + cur["new_tokens"]
                assert cur["prev_context_len"] == context
        workers = {a: m for a, m in p["server"]["decode_metrics"].items() if a != "sum"}
        assert len(workers) == 2
    # One session at a time: every later turn found all of its previous context (whole pages) on the worker
    # it went to, so the router kept each session on the worker that holds its prefix; both workers served.
    calm = points[1]
    assert calm["reprefill_tokens"] == 0
    assert all(t["cached_tokens"] >= t["cacheable_tokens"] > 0 for t in calm["turns"] if t["turn"] > 0)
    # the later-turn hit rate's ceiling: what earlier turns computed, over the later prompts; nothing re-prefilled,
    # so the hit rate reaches it (new tokens of a turn are never cached)
    later = [t for t in calm["turns"] if t["turn"] > 0]
    assert calm["later_prompt_tokens"] == sum(t["prompt_tokens"] for t in later)
    assert calm["later_hit_ceiling"] == sum(t["cacheable_tokens"] for t in later) / calm["later_prompt_tokens"] < 1
    assert calm["cache_hit_rate_later_turns"] >= calm["later_hit_ceiling"]
    assert all(m["requests_total"] > 0 for a, m in calm["server"]["decode_metrics"].items() if a != "sum")
    # Eight at once on 2 x 64 pages: the radix caches evict session prefixes and turns re-prefill them.
    busy = points[8]
    assert busy["evicted_pages"] > 0 and busy["evicted_tokens"] == 4 * busy["evicted_pages"]
    assert busy["reprefill_tokens"] > 0
    assert busy["server"]["decode_metrics"]["sum"]["prefix_cache_hit_tokens_total"] == busy["cached_tokens"]

    md_path = tmp_path / "docs" / "agentic.md"
    written = write_report([doc], md_path, [str(out)])
    text = md_path.read_text()
    assert "CPU smoke run" in text and "## nvfp4" in text and "| 8 | 8 | 32 / 0 / 0 |" in text
    limits = cache_limits(run["points"])
    assert limits["saturation_concurrency"] in (1, 8) and limits["peak_throughput_concurrency"] in (1, 8)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "Figures need matplotlib" in text and written == [md_path]
        return
    assert len(written) == 5
    for png in written[1:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in text


def test_report_compares_fp8_and_nvfp4_where_both_ran():
    def point(c: int, tok_s: float, hit: float, evicted: int) -> dict:
        return {"concurrency": c, "num_sessions": 2 * c, "completed": 4, "failed": 0, "turns_not_sent": 0,
                "output_tok_s": tok_s, "tok_s_per_user": 10.0, "ttft_ms": {"median": 5.0, "p99": 9.0},
                "cache_hit_rate": hit, "cache_hit_rate_later_turns": hit, "reprefill_tokens": 0,
                "evicted_pages": evicted, "evicted_tokens": 4 * evicted, "retractions": 0,
                "integrity_ok": True, "server": {"pool": {"peak_pages_used": 1, "pages_total": 8}}}

    dep = {"model": "m", "model_path": "", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "page_size": 4,
           "num_decode_workers": 1, "num_prefill_workers": 1, "pool_pages_total": 8}
    stats = tf.Trace((tf.SessionTrace("a", (tf.Turn("a", 0, "user", 2, new_tokens=3),)),)).stats()
    runs = [{"kv_dtype": "nvfp4", "gpu": "H200", "deployment": dep,
             "points": [point(4, 200.0, 0.95, 0), point(16, 500.0, 0.9, 3)]},
            {"kv_dtype": "fp8_e4m3", "gpu": "H200", "deployment": dep,
             "points": [point(4, 190.0, 0.95, 0), point(16, 150.0, 0.3, 900)]}]
    doc = {"trace": {"path": "t.jsonl", "stats": stats}, "command": "c", "runs": runs}
    text = markdown([doc], ["r.json"], None)
    assert "CPU smoke run" not in text and "Figures need matplotlib" in text
    assert ("**fp8_e4m3**: first evictions at C=16; later-turn cache hit rate below 90% of its best (95.0%) "
            "from C=16 (30.0%)") in text
    assert "**nvfp4**: first evictions at C=16; later-turn cache hit rate within 90% of its best" in text
    assert "| 16 | 150.0 | 500.0 | 3.33 | 30.0% | 90.0% |" in text
    assert "NVFP4 / FP8 = 1.05 at C=4, 3.33 at C=16; NVFP4 stays at least 10% ahead from C=16 on" in text
    assert "peak output throughput 190.0 tok/s at C=4, then 150.0 tok/s at C=16 (-21%)." in text
    assert text.index("## fp8_e4m3") < text.index("## nvfp4")
    assert math.isclose(cache_limits(runs[1]["points"])["falloff_hit_rate"], 0.3)
