"""`nvfp4-serve up` as a user runs it, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2_grpc
from tests.service_procs import Launched

openai = pytest.importorskip("openai")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Deployment(Launched):
    """A launched deployment plus the official client on its /v1."""

    def __init__(self, *args: str):
        super().__init__(*args)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id


@pytest.fixture(scope="module")
def deployment(tiny_model_dir):
    d = Deployment("--model", tiny_model_dir, "--num-decode", "2", "--page-size", "4")
    yield d
    d.stop()


def decode_requests(address: str) -> float:
    async def get() -> float:
        async with grpc.aio.insecure_channel(address) as ch:
            text = (await decode_pb2_grpc.DecodeStub(ch).GetMetrics(common_pb2.MetricsRequest())).prometheus_text
        return sum(float(v) for v in re.findall(r"^nvfp4_decode_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE))

    return asyncio.run(get())


def test_completions_streamed_and_not_equal_the_in_process_engine(deployment, tiny_model_dir):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    c = deployment.client
    r = c.completions.create(model=deployment.model, prompt=prompt, max_tokens=10, temperature=0)
    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                              cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=4096)))
    ref = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    assert r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.token_ids)
    # the same prompt streamed: same text, chunk by chunk, then [DONE] (the client stops on it)
    chunks = list(c.completions.create(model=deployment.model, prompt=prompt, max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert len(text) > 0 and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the repeat hit the cache


def test_chat_completions_streamed_and_not(deployment):
    c = deployment.client
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    r = c.chat.completions.create(model=deployment.model, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("length", "stop")
    stream = c.chat.completions.create(model=deployment.model, messages=msgs, max_tokens=8, temperature=0,
                                       stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == r.choices[0].message.content


def test_two_turn_chat_repeated_hits_the_cache_on_one_decode_worker(deployment):
    c = deployment.client
    before = {a: decode_requests(a) for a in deployment.decode_addresses()}
    assert len(before) == 2
    turn1 = [{"role": "system", "content": "You are a helpful assistant that answers briefly. " * 4},
             {"role": "user", "content": "What is a radix tree?"}]
    cached = []
    for _ in range(2):
        a1 = c.chat.completions.create(model=deployment.model, messages=turn1, max_tokens=6, temperature=0)
        turn2 = [*turn1, {"role": "assistant", "content": a1.choices[0].message.content},
                 {"role": "user", "content": "And a page table?"}]
        a2 = c.chat.completions.create(model=deployment.model, messages=turn2, max_tokens=6, temperature=0)
        cached.append((a1.usage.prompt_tokens_details.cached_tokens, a2.usage.prompt_tokens_details.cached_tokens))
    assert cached[1][0] > 0 and cached[1][1] > 0 and cached[0][1] > 0
    served = {a: decode_requests(a) - before[a] for a in before}
    assert sorted(served.values()) == [0, 4], served  # all four requests on the worker holding the prefix


def test_errors_are_openai_shaped(deployment):
    c = deployment.client
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=deployment.model, prompt="x", max_tokens=-3)
    assert "max_tokens" in str(e.value)
    assert c.completions.create(model=deployment.model, prompt="still up", max_tokens=2).choices


def test_ctrl_c_stops_every_child(deployment):
    # the module's deployment, stopped here: keep this test the module's last
    d = deployment
    assert d.proc.poll() is None
    pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(d.proc.pid)], capture_output=True,
                                           text=True, check=False).stdout.split()]
    assert len(pids) == 4  # prefill, two decodes, router
    assert d.stop() == 0
    time.sleep(0.5)
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return "zombie" not in f.read()
        except FileNotFoundError:
            return False

    alive = [p for p in pids if running(p)]
    assert alive == []
