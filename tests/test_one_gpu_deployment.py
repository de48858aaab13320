"""The one-GPU deployment: `nvfp4-serve up --num-prefill 0` (decode runs the prompts itself), here also with
`--num-layers 1`, driven by the official openai client; greedy output equals the in-process engine's."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from nvfp4_serve.launcher import up
from tests.service_procs import Launched

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def deployment(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--num-prefill", "0", "--num-layers", "1", "--page-size", "4",
                 "--max-running-requests", "8")
    yield d
    d.stop()


def test_no_prefill_process_and_the_ready_line_says_so(deployment):
    children = subprocess.run(["pgrep", "-P", str(deployment.proc.pid)], capture_output=True, text=True,
                              check=False).stdout.split()
    assert len(children) == 2  # decode, router
    ready = next(line for line in deployment.lines if "nvfp4-serve ready" in line)
    assert "no prefill: decode runs the prompts" in ready and "--num-layers 1" in ready
    assert not any(line.startswith("[prefill]") for line in deployment.lines)


def test_server_info_reports_the_layer_override_and_no_prefill_worker(deployment):
    info = httpx.get(f"{deployment.url}/server_info", timeout=30).json()
    assert info["prefill"] == [] and len(info["decode"]) == 1
    assert info["num_layers"] == {"checkpoint": 2, "served": [1], "override": True}
    assert info["decode"][0]["load"]["layout"]["num_layers"] == 1
    assert info["config"]["prefill_addresses"] == [] and info["config"]["max_concurrent_requests"] == 8


def test_server_info_names_each_workers_attention_backend_and_decode_kernel(deployment):
    info = httpx.get(f"{deployment.url}/server_info", timeout=30).json()
    assert info["decode"][0]["load"]["attention_backend"] == "reference"  # auto on the CPU
    assert info["decode"][0]["load"]["decode_kernel"] == "reference"


def test_greedy_completion_equals_the_in_process_engine_with_the_same_layers(deployment, tiny_model_dir):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32", num_layers=1,
                              cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=4096)))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = eng.generate([prompt], params)[0]
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    # the repeat is served from this decode worker's own prefix cache, streamed, with the same text
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_prefill_gpus_without_a_prefill_service_is_refused(tiny_model_dir):
    with pytest.raises(SystemExit, match="--num-prefill 0 starts none"):
        up(["--model", tiny_model_dir, "--num-prefill", "0", "--prefill-gpus", "0"])
