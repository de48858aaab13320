"""The gateway over HTTP (create_app + TestClient) with no worker reachable: validation, errors, auth,
health, metrics, and that the router never imports torch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import openai
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2_grpc

from router.app import create_app
from router.config import RouterConfig

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from offline.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256))


def _config(model_dir: str, **kw) -> RouterConfig:
    base = {"decode_addresses": (f"127.0.0.1:{_free_port()}",), "prefill_addresses": (f"127.0.0.1:{_free_port()}",),
            "model_dir": model_dir, "served_model_name": "tiny", "health_check_interval_s": 60.0}
    return RouterConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def client(model_dir):
    with TestClient(create_app(_config(model_dir, max_body_bytes=8192, max_model_len=64, max_n=4))) as c:
        yield c


def _assert_openai_error(resp, status: int, param: str | None = None, contains: str = "") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) >= {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


COMPLETION_CASES = [
    # (body, status, param, message fragment)
    (b"{not json", 400, None, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, "not valid JSON"),  # invalid UTF-8
    (b"[1, 2]", 400, None, "must be a JSON object"),
    (b"", 400, None, "not valid JSON"),
    (b'{"prompt": "hi"}', 400, "model", "Field required"),
    (b'{"model": "tiny"}', 400, "prompt", "Field required"),
    (b'{"model": "gpt-9", "prompt": "hi"}', 404, "model", "does not exist"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "10"}', 400, "max_tokens", "valid integer"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": -1}', 400, "max_tokens", "greater than or equal to 0"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "only with echo"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000000000}', 400, "max_tokens", "maximum context length"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 2.5}', 400, "temperature", "less than or equal to 2"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature", "valid number"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": 0}', 400, "top_p", "greater than 0"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": -5}', 400, "top_k", "greater than or equal to -1"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": 2147483648}', 400, "top_k", "less than or equal to 2147483647"),
    (b'{"model": "tiny", "prompt": "hi", "min_p": 1.5}', 400, "min_p", "less than or equal to 1"),
    (b'{"model": "tiny", "prompt": "hi", "n": 5}', 400, "n", "n must be <= 4"),
    (b'{"model": "tiny", "prompt": "hi", "n": 0}', 400, "n", "greater than or equal to 1"),
    (b'{"model": "tiny", "prompt": "hi", "seed": -3}', 400, "seed", "greater than or equal to 0"),
    (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', 400, "stream", "valid boolean"),
    (b'{"model": "tiny", "prompt": "hi", "stop": [""]}', 400, "stop", "must not be empty"),
    (b'{"model": "tiny", "prompt": "hi", "stop": 7}', 400, "stop", ""),
    (b'{"model": "tiny", "prompt": []}', 400, "prompt", "must not be empty"),
    (b'{"model": "tiny", "prompt": [1, true]}', 400, "prompt", "list of token ids"),
    (b'{"model": "tiny", "prompt": ""}', 400, "prompt", "at least one token"),
    (b'{"model": "tiny", "prompt": [1, 2, 99999]}', 400, "prompt", "token id 99999 is out of the vocabulary"),
    (b'{"model": "tiny", "prompt": [-1]}', 400, "prompt", "out of the vocabulary"),
    (b'{"model": "tiny", "prompt": "hi", "stop_token_ids": [512]}', 400, "stop_token_ids", "out of the vocabulary"),
    (json.dumps({"model": "tiny", "prompt": list(range(100))}).encode(), 400, "prompt",
     "maximum context length is 64 tokens, but the prompt has 100 tokens"),
    (json.dumps({"model": "tiny", "prompt": list(range(60)), "max_tokens": 10}).encode(), 400, "max_tokens",
     "you requested 70 tokens (60 in the prompt, 10 for the completion)"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 21}', 400, "logprobs", "less than or equal to 20"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0, "logprobs": 1}', 400, "max_tokens", "only with echo"),
    (b'{"model": "tiny", "prompt": "hi", "best_of": 3}', 400, "best_of", "not supported"),
    (b'{"model": "tiny", "prompt": "hi", "presence_penalty": 2.5}', 400, "presence_penalty", "less than or equal to 2"),
    (b'{"model": "tiny", "prompt": "hi", "frequency_penalty": -3}', 400, "frequency_penalty", "greater than or equal"),
    (b'{"model": "tiny", "prompt": "hi", "repetition_penalty": 0}', 400, "repetition_penalty", "greater than 0"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": 101}}', 400, "logit_bias", "[-100, 100]"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"a": 1}}', 400, "logit_bias", "must be token ids"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"9999": 1}}', 400, "logit_bias", "out of the vocabulary"),
    (b'{"model": "tiny", "prompt": "hi", "min_tokens": 5, "max_tokens": 2}', 400, "min_tokens", "must be <="),
    (b'{"model": "tiny", "prompt": "hi", "min_tokens": -1}', 400, "min_tokens", "greater than or equal to 0"),
    (b'{"model": "tiny", "prompt": "hi", "include_stop_str_in_output": 1}', 400, "include_stop_str_in_output",
     "valid boolean"),
    (b'{"model": "tiny", "prompt": "hi", "skip_special_tokens": "no"}', 400, "skip_special_tokens", "valid boolean"),
    (b'{"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options",
     "only allowed with stream"),
    (b'{"model": "tiny", "prompt": "hi", "response_format": {"type": "yaml"}}', 400, "response_format", "type must"),
    (b'{"model": "tiny", "prompt": "hi", "response_format": {"type": "json_schema"}}', 400, "response_format",
     "schema"),
    (b'{"model": "tiny", "prompt": "hi", "regex": "a", "guided_json": {}}', 400, "guided_json", "at most one"),
    (b'{"model": "tiny", "prompt": "hi", "regex": ""}', 400, "regex", "must not be empty"),
    (b'{"model": "tiny", "prompt": "hi", "guided_choice": []}', 400, "guided_choice", "non-empty"),
    *[(json.dumps({"model": "tiny", "prompt": "hi", name: value}).encode(), 400, name, "not supported")
      for name, value in (("suffix", "x"), ("use_beam_search", True), ("length_penalty", 0.5), ("bad_words", ["a"]),
                          ("allowed_token_ids", [1]), ("truncate_prompt_tokens", 3), ("prompt_logprobs", 1),
                          ("return_tokens_as_token_ids", True), ("spaces_between_special_tokens", False),
                          ("guided_whitespace_pattern", " "), ("structural_tag", "{}"), ("priority", 2),
                          ("lora_request", {}))],
    (b'{"model": "tiny", "prompt": "hi", "guided_decoding_backend": "outlines"}', 400, "guided_decoding_backend",
     "xgrammar"),
]


@pytest.mark.parametrize("body, status, param, fragment", COMPLETION_CASES)
def test_bad_completion_requests_get_openai_shaped_errors(client, body, status, param, fragment):
    resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    _assert_openai_error(resp, status, param, fragment)


CHAT_CASES = [
    ({"model": "tiny", "messages": []}, 400, "messages", "at least 1 item"),
    ({"model": "tiny", "messages": "hello"}, 400, "messages", "valid array"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, 400, "messages", "Field required"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs=true"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs", "less than or equal to 20"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo", "not supported"),
    *[({"model": "tiny", "messages": [{"role": "user", "content": "x"}], name: value}, 400, name, "not supported")
      for name, value in (("functions", [{}]), ("function_call", "auto"), ("audio", {}), ("modalities", ["audio"]),
                          ("prediction", {}), ("store", True), ("service_tier", "flex"), ("reasoning_effort", "low"),
                          ("web_search_options", {}), ("continue_final_message", True), ("chat_template", "x"),
                          ("chat_template_kwargs", {}), ("documents", []), ("mm_processor_kwargs", {}))],
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice", "not supported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format", "type must be"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}, 400,
     "max_tokens", "maximum context length is 64"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 80}]}, 400, "messages",
     "maximum context length is 64 tokens, but the prompt has"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 1 << 40}, 400, "top_k",
     "less than or equal to 2147483647"),
]


@pytest.mark.parametrize("body, status, param, fragment", CHAT_CASES)
def test_bad_chat_requests_get_openai_shaped_errors(client, body, status, param, fragment):
    _assert_openai_error(client.post("/v1/chat/completions", json=body), status, param, fragment)


def test_no_route_answers_422_validation_errors_are_400(client):
    resp = client.post("/v1/completions", data={"model": "tiny", "prompt": "hi"})  # a form, not JSON
    _assert_openai_error(resp, 400, None, "not valid JSON")


def test_bodies_over_the_limit_get_413_declared_or_streamed(client):
    big = json.dumps({"model": "tiny", "prompt": "x" * 10000}).encode()
    _assert_openai_error(client.post("/v1/completions", content=big), 413, None, "exceeds the limit of 8192 bytes")

    def chunked():  # no content-length: counted while reading
        for _ in range(10):
            yield b" " * 1000

    _assert_openai_error(client.post("/v1/chat/completions", content=chunked()), 413, None, "8192")


def test_valid_request_without_a_healthy_worker_is_503_with_retry_after(client):
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
    err = _assert_openai_error(resp, 503, None, "no healthy decode worker")
    assert err["code"] == "no_healthy_worker" and err["type"] == "server_error"
    assert resp.headers["retry-after"] == "1"
    assert "UNAVAILABLE" in err["message"]  # says why: connection refused
    resp = client.post("/v1/chat/completions", json={"model": "tiny", "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    _assert_openai_error(resp, 503, None, "no healthy decode worker")  # streams fail before the first byte


def test_health_is_503_when_no_worker_is_reachable(client):
    resp = client.get("/health")
    err = _assert_openai_error(resp, 503, None, "not ready")
    assert err["code"] == "no_healthy_worker"
    body = resp.json()
    assert (body["status"], body["decode_healthy"], body["decode_total"]) == ("unavailable", 0, 1)


def test_unknown_routes_and_methods_are_openai_shaped(client):
    _assert_openai_error(client.get("/v1/nothing"), 404, None, "not found")
    _assert_openai_error(client.get("/v1/completions"), 405, None, "method not allowed")


def test_models_server_info_and_flush_cache(client):
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    (card,) = oai.models.list().data
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="needs logprobs=true"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    info = client.get("/server_info").json()
    assert info["config"]["decode_addresses"] and info["config"]["api_key"] == ""
    assert info["context_len"] == 64 and info["vocab_size"] == 512
    (dec,) = info["decode"]
    assert dec["healthy"] is False and "UNAVAILABLE" in dec["last_error"] and dec["load"] is None
    _assert_openai_error(client.post("/flush_cache"), 503, None, "no healthy decode worker")


def test_metrics_count_requests_by_endpoint_and_status(client):
    client.post("/v1/completions", content=b"{")
    client.get("/v1/nothing/at/all")
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert 'nvfp4_router_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert 'nvfp4_router_requests_total{endpoint="other",status="404"}' in text  # raw paths never become labels
    assert "/v1/nothing" not in text
    assert 'nvfp4_router_worker_healthy{address="' in text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "generated_tokens_total",
                 "cached_prompt_tokens_total", "in_flight_requests", "queued_requests", "failures_total"):
        assert f"nvfp4_router_{name}" in text


@pytest.mark.parametrize("metrics_open", [False, True])
def test_api_key_is_required_except_on_health(model_dir, metrics_open):
    cfg = _config(model_dir, api_key="s3cret", metrics_open=metrics_open)
    with TestClient(create_app(cfg)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            resp = c.get("/v1/models", headers=headers)
            err = _assert_openai_error(resp, 401, None, "API key")
            assert err["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": "bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 503  # open, and honest: no worker
        assert c.get("/metrics").status_code == (200 if metrics_open else 401)  # it names the gRPC addresses
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
        resp = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                      headers={"Authorization": "Bearer s3cret"})
        assert resp.status_code == 503  # past the key check, no worker


def test_a_worker_that_is_not_a_decode_service_is_reported_as_such(model_dir):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # standard Health only
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with TestClient(create_app(_config(model_dir, decode_addresses=(f"127.0.0.1:{port}",)))) as c:
            err = _assert_openai_error(c.get("/health"), 503, None, "UNIMPLEMENTED")
            assert f"is 127.0.0.1:{port} really a decode service" in err["message"]
    finally:
        server.stop(None)


def test_router_never_imports_torch(model_dir):
    code = ("import sys, router.app, router.__main__\n"
            "from router.config import RouterConfig\n"
            "router.app.create_app(RouterConfig(decode_addresses=('127.0.0.1:1',), model_dir=sys.argv[1]))\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code, model_dir], check=False, cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_tokenize_detokenize_model_retrieve_version_and_model_info(client):
    resp = client.post("/tokenize", json={"model": "tiny", "prompt": "def f(x):"})
    body = resp.json()
    assert resp.status_code == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 64
    back = client.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()
    assert back == {"prompt": "def f(x):"}
    _assert_openai_error(client.post("/detokenize", json={"tokens": [99999]}), 400, "tokens", "out of the vocabulary")
    _assert_openai_error(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model")
    _assert_openai_error(client.post("/tokenize", json={"prompt": 3}), 400, "prompt")
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    card = oai.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-9")
    assert client.get("/version").json()["version"]
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True and info["served_model_name"] == "tiny"
