"""A prompt far longer than the context is refused from its length in bytes, before it is tokenized, and the
gateway keeps answering meanwhile: a real router (no worker needed: it answers /health 503 promptly)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.service_procs import free_port, start_router

PROMPT_BYTES = 15_000_000


@pytest.fixture(scope="module")
def router(tiny_model_dir):
    proc = start_router(tiny_model_dir, [f"127.0.0.1:{free_port()}"], [])
    proc.url = f"http://{proc.address}"
    yield proc
    proc.stop()


def test_a_15_mb_prompt_is_refused_at_once_and_health_answers_meanwhile(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
    result: dict = {}
    done = threading.Event()

    def send() -> None:
        t0 = time.monotonic()
        try:
            client.completions.create(model="model", prompt="def f(x): return x\n" * (PROMPT_BYTES // 20))
        except openai.BadRequestError as e:
            result["error"] = e
        result["seconds"] = time.monotonic() - t0
        done.set()

    threading.Thread(target=send, daemon=True).start()
    health_s = []
    with httpx.Client(base_url=router.url, timeout=30) as c:
        while not done.is_set():
            t0 = time.monotonic()
            assert c.get("/health").status_code in (200, 503)
            health_s.append(time.monotonic() - t0)
    err = result["error"]
    assert err.status_code == 400 and err.body["code"] == "context_length_exceeded"
    assert "bytes" in err.body["message"]
    assert result["seconds"] < 10  # upload and parse; tokenizing it took ~30 s on one core
    assert max(health_s) < 2.0, health_s
