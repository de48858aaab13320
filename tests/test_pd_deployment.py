"""The disaggregated deployment as users start it: `nvfp4-serve up --num-prefill 2` (two prefill services, the
router balancing prompts over them, the decode pulling only from them), and the `bench pd` comparison's CPU
smoke run (no timing asserted)."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest

from benchmarks.serving.pd import main as pd_main
from benchmarks.serving.pd import report
from nvfp4_serve_proto import common_pb2, prefill_pb2_grpc
from tests.service_procs import Launched

openai = pytest.importorskip("openai")


async def _prompt_tokens(address: str) -> float:
    async with grpc.aio.insecure_channel(address) as ch:
        text = (await prefill_pb2_grpc.PrefillStub(ch).GetMetrics(common_pb2.MetricsRequest())).prometheus_text
    m = re.search(r"^nvfp4_prefill_prompt_tokens_total (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_two_prefill_services_share_the_prompts_and_outputs_equal_the_engine(tiny_model_dir):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    d = Launched("--model", tiny_model_dir, "--num-prefill", "2", "--page-size", "4", "--kv-transfer", "grpc")
    try:
        ready = next(line for line in d.lines if "nvfp4-serve ready" in line)
        assert "2 prefill (" in ready
        prefills = [d.address("prefill-0"), d.address("prefill-1")]
        # each decode is started naming exactly the prefills of its deployment
        assert f"--prefill-addresses {prefills[0]} {prefills[1]}" in " ".join(
            line for line in d.lines if "decode" in line) or all(p in d.output for p in prefills)
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        prompts = [f"def f{i}(x):\n    return x + {i}\n" * 3 for i in range(4)]
        got = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
               for p in prompts]
        served = [asyncio.run(_prompt_tokens(a)) for a in prefills]
    finally:
        d.stop()
    assert all(n > 0 for n in served), served  # the router balanced the four prompts over both
    eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                              cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=4096)))
    for p, r in zip(prompts, got, strict=True):
        ids = eng.tokenizer.encode(p)
        ref = eng.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        assert r.choices[0].text == ref.text


def test_bench_pd_cpu_smoke_writes_every_deployment_ratios_and_the_report(tiny_model_dir, tmp_path):
    out, md = tmp_path / "pd.json", tmp_path / "pd.md"
    rc = pd_main(["--input-len", "48", "--output-len", "4", "--concurrency", "2", "--num-prompts", "3",
                  "--warmup", "0", "--deployments", "colocated", "pd-grpc", "pd-grpc-fp8", "--out", str(out),
                  "--report", str(md), "--launch", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32",
                  "--page-size", "4", "--chunked-prefill-size", "16", "--max-total-tokens", "2048"])
    assert rc == 0
    doc = json.loads(out.read_text())
    deps = doc["deployments"]
    assert list(deps) == ["colocated", "pd-grpc", "pd-grpc-fp8"] and all(d["status"] == "ok" for d in deps.values())
    assert all(d["summary"]["completed"] == 3 and d["summary"]["failed"] == 0 for d in deps.values())
    assert deps["colocated"]["summary"]["transfer"]["bytes"] == 0  # colocated: no page travels
    nv, f8 = (deps[k]["summary"]["transfer"]["bytes"] for k in ("pd-grpc", "pd-grpc-fp8"))
    assert nv > 0 and nv / f8 == 0.5625  # the same prompts: exactly the format's byte ratio
    per_token = [deps[k]["summary"]["transfer"]["bytes_per_token"] for k in ("pd-grpc", "pd-grpc-fp8")]
    assert per_token[0] / per_token[1] == 0.5625
    # the prefill services' own time per prompt (their metrics): none when colocated, 3 prompts' when PD, and
    # below the client's TTFT, which also holds the last pages' transfer
    assert deps["colocated"]["summary"]["prefill_ms"] is None
    for k in ("pd-grpc", "pd-grpc-fp8"):
        s = deps[k]["summary"]
        pm = deps[k]["point"]["server"]["prefill_metrics"]["sum"]
        assert pm["ttft_seconds_count"] == 3 and 0 < s["prefill_ms"] < s["ttft_mean_ms"]
        assert s["after_prefill_ms"] == s["ttft_mean_ms"] - s["prefill_ms"]
    text = md.read_text()
    assert "| colocated |" in text and "## Against colocated (same run)" in text and "0.5625x" in text
    assert "past the prefill service's own time" in text
    # overlap on against off, from the same document with the colocated deployment again as if run without it
    doc["deployments"]["colocated-sync"] = json.loads(json.dumps(deps["colocated"]))
    doc["deployments"]["colocated-sync"]["summary"].update(output_tok_s=deps["colocated"]["summary"]["output_tok_s"] / 2,
                                                           itl_p50_ms=20.0)
    text = report(doc)
    assert "## Overlap scheduling on / off (colocated / colocated-sync)" in text and "2.00x" in text
    assert re.search(r"1 / TPOT: [\d,]+ vs 50$", text, re.MULTILINE)

def test_shared_launch_args_lose_the_flags_the_deployments_set():
    from benchmarks.serving.pd import _OWN_FLAGS, _OWN_SWITCHES, DEPLOYMENTS, _strip, _with_own

    shared = ["--model", "m", "--kv-cache-dtype", "fp8_e4m3", "--disable-overlap-schedule", "--num-prefill=1",
              "--page-size", "16"]
    kept = _strip(shared, _OWN_FLAGS, _OWN_SWITCHES)
    assert kept == ["--model", "m", "--page-size", "16"]
    assert _with_own(kept, DEPLOYMENTS["colocated-fp8-sync"])[-2:] == ["fp8_e4m3", "--disable-overlap-schedule"]
    assert "--disable-overlap-schedule" not in _with_own(kept, DEPLOYMENTS["colocated-fp8"])


def test_a_deployments_own_decode_args_join_the_shared_ones():
    from benchmarks.serving.pd import DEPLOYMENTS, _with_own

    shared = ["--model", "m", "--decode-args", "--between-tokens-timeout 300"]
    args = _with_own(shared, DEPLOYMENTS["pd-grpc-lanes4"])
    assert args.count("--decode-args") == 1
    assert args[args.index("--decode-args") + 1] == "--between-tokens-timeout 300 --kv-grpc-lanes 4"
    assert _with_own(shared, DEPLOYMENTS["pd-grpc"]) == [*shared, *DEPLOYMENTS["pd-grpc"]]  # nothing to join
