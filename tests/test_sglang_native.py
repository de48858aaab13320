"""SGLang's native API against a real deployment (`nvfp4-serve up`, a prefill and a decode service, CPU): /generate
with text or input_ids, streamed (cumulative text, meta_info, [DONE]) and not, a batch, the request shape
`python -m sglang.bench_serving --backend sglang` sends, the same tokens as /v1/completions, 400s naming what is
refused; /health_generate runs one token (200) or answers 503."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.config import RouterConfig
from tests.service_procs import Launched, free_port


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--page-size", "4", "--context-length", "128")
    d.http = httpx.Client(base_url=d.url, timeout=60)
    d.model = d.http.get("/v1/models").json()["data"][0]["id"]
    yield d
    d.http.close()
    d.stop()


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _warm(dep, prompt) -> None:
    """Run the prompt once, so later runs of it all start from the decode worker's prefix cache: on the tiny
    random-weight model a first run (K/V from the prefill service) may pick another greedy token than a cached one."""
    body = {"input_ids": prompt} if isinstance(prompt, list) else {"text": prompt}
    assert dep.http.post("/generate", json={**body, "sampling_params": GREEDY}).status_code == 200


def _sse(resp: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]


def test_generate_text_is_the_completions_flow_with_sglang_meta_info(dep):
    _warm(dep, "def main():")
    r = dep.http.post("/generate", json={"text": "def main():", "sampling_params": GREEDY, "rid": "r-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["id"] == "r-1" and meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    cmpl = dep.http.post("/v1/completions", json={"model": dep.model, "prompt": "def main():", "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True,
                                                   "return_token_ids": True}).json()
    assert out["text"] == cmpl["choices"][0]["text"]
    assert out["output_ids"] == cmpl["choices"][0]["token_ids"]
    assert meta["prompt_tokens"] == cmpl["usage"]["prompt_tokens"]


def test_generate_input_ids_stops_on_a_stop_token_with_its_id_matched(dep):
    ids = dep.http.post("/tokenize", json={"prompt": "class A:"}).json()["tokens"]
    _warm(dep, ids)
    full = dep.http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    stop_id = full["output_ids"][2]
    first = full["output_ids"].index(stop_id)
    out = dep.http.post("/generate", json={"input_ids": ids, "sampling_params": {
        **GREEDY, "stop_token_ids": [stop_id]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == full["output_ids"][:first + 1]


def test_generate_stream_sends_cumulative_text_meta_info_then_done(dep):
    _warm(dep, "import os")
    full = dep.http.post("/generate", json={"text": "import os", "sampling_params": GREEDY}).json()
    r = dep.http.post("/generate", json={"text": "import os", "sampling_params": GREEDY, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = _sse(r)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_generate_batch_answers_a_list_in_prompt_order(dep):
    prompts = ["def f(x):", "x = 1"]
    _warm(dep, prompts[0])
    r = dep.http.post("/generate", json={"text": prompts, "sampling_params": [GREEDY, {**GREEDY,
                                                                                        "max_new_tokens": 3}]})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [6, 3]
    one = dep.http.post("/generate", json={"text": prompts[0], "sampling_params": GREEDY}).json()
    assert outs[0]["output_ids"] == one["output_ids"]


def test_the_request_sglang_bench_serving_sends_is_served_as_it_reads_it(dep):
    # the payload of bench_serving --backend sglang, and its reader: "text" non-empty, meta_info.completion_tokens
    payload = {"text": "for i in range(10):", "sampling_params": {"temperature": 0.0, "max_new_tokens": 5,
                                                                  "ignore_eos": True},
               "stream": True, "stream_options": {"include_usage": True}, "lora_path": None, "return_logprob": False,
               "return_routed_experts": False, "logprob_start_len": -1}  # sglang 0.5.23 sends return_routed_experts
    r = dep.http.post("/generate", json=payload)
    assert r.status_code == 200, r.text
    output_len = 0
    for chunk in _sse(r):
        if chunk != "[DONE]":
            data = json.loads(chunk)
            if data["text"]:
                output_len = data["meta_info"]["completion_tokens"]
    assert output_len == 5


@pytest.mark.parametrize("body, param", [
    ({"text": "x", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"text": "x", "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 100000}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
    ({"text": "x", "sampling_params": {"stop_token_ids": [10 ** 8]}}, "sampling_params.stop_token_ids"),
    ({"text": "x", "return_logprob": True}, "return_logprob"),
    ({"text": "x", "image_data": "data:image/png;base64,AAAA"}, "image_data"),
    ({"text": "x", "frobnicate": 1}, "frobnicate"),
    ({"text": "x", "input_ids": [1, 2]}, "input_ids"),
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"input_ids": [1, -5]}, "input_ids"),
    ({"text": ["a", "b"], "sampling_params": [GREEDY]}, "sampling_params"),
])
def test_bad_generate_requests_are_400_naming_the_parameter(dep, body, param):
    r = dep.http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_health_generate_runs_one_token_or_is_503(dep, tiny_model_dir):
    r = dep.http.get("/health_generate")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    config = RouterConfig(decode_addresses=(f"127.0.0.1:{free_port()}",), prefill_addresses=(),
                          model_dir=tiny_model_dir, served_model_name="tiny", health_check_interval_s=60.0)
    with TestClient(create_app(config)) as client:
        r = client.get("/health_generate")
    assert r.status_code == 503 and "health_generate failed" in r.json()["error"]["message"]
