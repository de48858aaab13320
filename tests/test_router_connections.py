"""The gateway's connections: read deadlines (silent, dribbled headers, dribbled body), a bounded number of
open connections that never stops it answering a fresh client, and clients that leave counted as 499.

One decode service (it runs the prompts itself; its engine stalls after each token so that a stream is still
going when its client leaves) behind a router with 1 s deadlines, run with a file limit of 256 descriptors.
"""

from __future__ import annotations

import re
import socket
import sys
import time

import httpx
import openai
import pytest

from tests.service_procs import _ROUTER_READY, _Launch, free_port, start

TIMEOUT_S = 1.0
CLOSED_WITHIN_S = TIMEOUT_S + 3.0  # the deadline plus room for a loaded CI machine
NOFILE = 256
# The router under a file limit: more idle connections than it allows would otherwise make accept() fail.
_LIMITED = (f"import resource, runpy; resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
            "runpy.run_module('router', run_name='__main__', alter_sys=True)")


@pytest.fixture(scope="module")
def decode(tiny_model_dir):
    proc = start("decode_svc", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--page-size",
                 "4", "--debug-token-delay-s", "0.2")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(decode, tiny_model_dir):
    cmd = [sys.executable, "-c", _LIMITED, "--port", str(free_port()), "--model-dir", tiny_model_dir,
           "--decode-addresses", decode.address, "--health-check-interval-s", "0.5",
           "--header-timeout-s", str(TIMEOUT_S), "--body-timeout-s", str(TIMEOUT_S),
           "--keep-alive-timeout-s", str(TIMEOUT_S)]
    proc = _Launch("router", cmd, {}, _ROUTER_READY).wait(time.monotonic() + 60)
    url = f"http://{proc.address}"
    with httpx.Client(base_url=url, timeout=30) as c:  # healthy before any test counts on the decode
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
    proc.url = url
    yield proc
    proc.stop()


def _connect(router) -> socket.socket:
    host, _, port = router.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=CLOSED_WITHIN_S + 5)


def _until_closed(sock: socket.socket, dribble: bytes = b"") -> tuple[float, bytes]:
    """Send ``dribble`` one byte every 0.1 s (then nothing) and read until the server closes: (seconds, bytes)."""
    start, got = time.monotonic(), b""
    sock.settimeout(0.1)
    for i in range(int((CLOSED_WITHIN_S + 5) / 0.1)):
        if i < len(dribble):
            try:
                sock.send(dribble[i:i + 1])
            except OSError:  # closed by the server
                break
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return time.monotonic() - start, got


def _count(router, endpoint: str, status: int) -> float:
    text = httpx.get(router.url + "/metrics", timeout=30).text
    m = re.search(rf'nvfp4_router_requests_total{{endpoint="{re.escape(endpoint)}",status="{status}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_a_silent_connection_is_closed_within_the_header_timeout(router):
    with _connect(router) as s:
        seconds, got = _until_closed(s)
    assert TIMEOUT_S * 0.8 <= seconds < CLOSED_WITHIN_S and got == b""


def test_dribbled_headers_get_408_and_the_connection_closed(router):
    headers = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with _connect(router) as s:
        seconds, got = _until_closed(s, dribble=headers)
    assert TIMEOUT_S * 0.8 <= seconds < CLOSED_WITHIN_S
    assert got.startswith(b"HTTP/1.1 408") and b"request headers did not arrive within 1 s" in got


def test_a_dribbled_body_gets_408_and_the_connection_closed(router):
    body = b'{"model": "x", "prompt": "' + b"a" * 200 + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    before = _count(router, "/v1/completions", 408)
    with _connect(router) as s:
        s.sendall(head)
        seconds, got = _until_closed(s, dribble=body)
    assert TIMEOUT_S * 0.8 <= seconds < CLOSED_WITHIN_S
    assert got.startswith(b"HTTP/1.1 408") and b"request body did not arrive within 1 s" in got
    deadline = time.monotonic() + 10
    while _count(router, "/v1/completions", 408) == before and time.monotonic() < deadline:
        time.sleep(0.05)  # the request's handler ends once it sees the connection gone
    assert _count(router, "/v1/completions", 408) == before + 1


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(router):
    with _connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        seconds, got = _until_closed(s)
    assert got.startswith(b"HTTP/1.1 200") and seconds < CLOSED_WITHIN_S


def test_more_idle_connections_than_the_file_limit_allows_do_not_stop_a_fresh_client(router):
    idle = []
    try:
        for i in range(NOFILE + 50):  # past what the router could accept with one descriptor each
            s = _connect(router)
            if i % 2:
                s.send(b"GET /he")  # half of them started a request and stalled
            idle.append(s)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=20)
        t0 = time.monotonic()
        assert client.models.list().data[0].id  # a fresh client is answered at once
        out = client.completions.create(model=client.models.list().data[0].id, prompt="def f(x):", max_tokens=2)
        assert out.usage.completion_tokens == 2 and time.monotonic() - t0 < 10
    finally:
        for s in idle:
            s.close()
    assert "closed the longest idle connection" in router.output


def test_a_client_that_leaves_mid_upload_is_499_not_an_internal_error(router):
    before_499, before_500 = _count(router, "/v1/completions", 499), _count(router, "/v1/completions", 500)
    with _connect(router) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b'{"model": "m", "prompt": "')
    deadline = time.monotonic() + 10
    while _count(router, "/v1/completions", 499) == before_499 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _count(router, "/v1/completions", 499) == before_499 + 1
    assert _count(router, "/v1/completions", 500) == before_500
    assert "Traceback" not in router.output and "internal error" not in router.output


def test_a_client_that_leaves_mid_stream_is_counted_as_499(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    before_200, before_499 = _count(router, "/v1/completions", 200), _count(router, "/v1/completions", 499)
    stream = client.completions.create(model=model, prompt="def f(x):", max_tokens=50, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the stream has started (HTTP 200) ...
    stream.close()  # ... and the client leaves
    deadline = time.monotonic() + 20
    while _count(router, "/v1/completions", 499) == before_499 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _count(router, "/v1/completions", 499) == before_499 + 1
    assert _count(router, "/v1/completions", 200) == before_200
