"""Rotated K/V (``--kv-rotation hadamard``, engine/kv_rotation.py): the transform is orthogonal, attention through
every path is unchanged up to rounding with an unquantized (bf16) cache, prefill and decode services agree on rotated
pages, and a decode refuses pages rotated differently. What it buys an NVFP4 cache is measured, not asserted:
docs/benchmarks/accuracy.md (``nvfp4-serve eval``)."""

from __future__ import annotations

import grpc
import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kv_rotation import head_rotation, rotation_matrix
from engine.sampling import SamplingParams
from nvfp4_kernels.model_ops import rotate_heads
from offline.evaluation import teacher_forced_logprobs
from tests.test_services import (
    gen_request,
    generate,
    procs,  # noqa: F401 - the fixture
    prompt,
    run,
)
from tests.test_timeouts import decode_is_idle


def test_the_hadamard_rotation_is_orthogonal_fixed_and_refuses_other_head_dims():
    r = rotation_matrix("hadamard", 128)
    assert r.dtype == torch.float32 and r.shape == (128, 128)
    assert torch.allclose(r @ r.T, torch.eye(128), atol=1e-6)
    assert torch.equal(r, rotation_matrix("hadamard", 128))  # part of the format: the same every time
    assert torch.allclose(r.abs(), torch.full_like(r, 128 ** -0.5))  # every entry +-1/sqrt(D)
    assert rotation_matrix("none", 128) is None
    x = torch.randn(5, 3, 128)
    rotated = rotate_heads(x, head_rotation("hadamard", 128, "cpu", torch.float32))
    assert torch.allclose(rotated, x @ r, atol=1e-5) and torch.allclose(rotated @ r.T, x, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        rotation_matrix("hadamard", 96)
    with pytest.raises(ValueError, match="--kv-rotation must be one of"):
        CacheConfig(kv_rotation="quarot")


def _engine(model_dir: str, kv_dtype: str, rotation: str) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", cache=CacheConfig(
        kv_dtype=kv_dtype, kv_rotation=rotation, page_size=4, max_total_tokens=2048)))


def test_with_a_bf16_cache_rotation_changes_no_prediction_beyond_rounding(tiny_model_dir):
    """Prefill (path 1) then teacher-forced decode steps over the pool (path 3): the same next-token log-probs
    with and without the rotation, since only quantization could tell them apart."""
    windows = [prompt(40), prompt(40, offset=11)]
    plain = teacher_forced_logprobs(_engine(tiny_model_dir, "bf16", "none"), windows, 24)
    rotated = teacher_forced_logprobs(_engine(tiny_model_dir, "bf16", "hadamard"), windows, 24)
    assert (plain - rotated).abs().max() < 5e-2
    assert torch.equal(plain.argmax(-1), rotated.argmax(-1))


def test_a_rotated_nvfp4_engine_serves_prefix_hits_and_stays_consistent(tiny_model_dir):
    eng = _engine(tiny_model_dir, "nvfp4", "hadamard")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = eng.generate([prompt(37)], sp)[0]
    again = eng.generate([prompt(37)], sp)[0]  # its prefix now comes from the radix cache (path 2)
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    assert eng.check_integrity().num_in_use == 0


def test_rotated_pages_through_prefill_and_decode_services_equal_the_rotated_engine(procs, tiny_model_dir):  # noqa: F811
    args = ("--model", tiny_model_dir, "--kv-cache-dtype", "nvfp4", "--page-size", "4", "--kv-rotation", "hadamard")
    p, d = procs.many(("prefill_svc", *args), ("decode_svc", *args))  # started together
    ids = prompt(37)
    tokens, _ = run(generate(d.address, gen_request("r", ids, p.address, max_tokens=8)))
    ref = _engine(tiny_model_dir, "nvfp4", "hadamard").generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert tokens == ref.token_ids
    load = run(_load(d.address))  # what /server_info shows of each worker
    assert load.layout.kv_rotation == "hadamard" and load.layout.kv_dtype == "nvfp4"


async def _load(address: str):
    from nvfp4_serve_proto import common_pb2, decode_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).GetLoad(common_pb2.GetLoadRequest())


def test_a_decode_refuses_pages_rotated_differently(procs, tiny_model_dir):  # noqa: F811
    common = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = procs.many(("prefill_svc", *common, "--kv-rotation", "hadamard"), ("decode_svc", *common))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(generate(d.address, gen_request("m", prompt(20), p.address)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_rotation" in e.value.details() and "'hadamard'" in e.value.details()
    rep = run(decode_is_idle(d.address))
    assert rep.ok and rep.num_in_use == 0


def test_calibration_records_rotated_amax_and_a_server_refuses_scales_of_another_rotation(tiny_model_dir, tmp_path):
    import argparse

    from engine.kv_scales import KVScales
    from engine.loader import model_fingerprint
    from offline.calibration import calibrate
    from svc_common.engine_args import add_engine_args, engine_config_from_args

    text = "def f(x):\n    return [i * x for i in range(10)]\n" * 8
    plain = calibrate(tiny_model_dir, text, num_tokens=64, device="cpu", dtype="float32")
    rotated = calibrate(tiny_model_dir, text, num_tokens=64, device="cpu", dtype="float32", kv_rotation="hadamard")
    assert plain.kv_rotation == "none" and rotated.kv_rotation == "hadamard"
    assert rotated.k_amax != plain.k_amax  # the amax of what a rotated pool stores
    path = tmp_path / "rot.json"
    rotated.save(path)
    assert KVScales.load(path, model_fingerprint(tiny_model_dir)) == rotated

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_engine_args(p)
        return p.parse_args(["--model", tiny_model_dir, "--device", "cpu", "--kv-scales", str(path), *argv])
    assert engine_config_from_args(parse("--kv-rotation", "hadamard")).cache.kv_rotation == "hadamard"
    with pytest.raises(ValueError, match="calibrated with --kv-rotation hadamard, this server runs --kv-rotation none"):
        engine_config_from_args(parse())


def test_eval_refuses_rotated_scales_calibrated_without_the_rotation(tiny_model_dir, tmp_path, capsys):
    from offline.calibration import calibrate
    from offline.evaluation import main

    path = tmp_path / "plain.json"
    calibrate(tiny_model_dir, "x = 1\n" * 40, num_tokens=32, device="cpu", dtype="float32").save(path)
    with pytest.raises(SystemExit):
        main(["--model", tiny_model_dir, "--kv-scales", str(path), "--kv-scales-rotated", str(path)])
    assert "was calibrated with --kv-rotation none, --kv-scales-rotated needs --kv-rotation hadamard" in \
        capsys.readouterr().err


def test_a_head_dim_the_rotation_cannot_serve_is_refused_at_start_up_in_one_line(tmp_path):
    from offline.tiny_model import make_tiny_model
    from svc_common.preflight import check_model

    model = make_tiny_model(tmp_path / "hd48", head_dim=48)
    check_model(str(model), "nvfp4", "cpu", "auto", None)  # unrotated it serves
    with pytest.raises(ValueError, match=r"--kv-rotation hadamard needs head_dim a power of two \(.* has 48\)"):
        check_model(str(model), "nvfp4", "cpu", "auto", None, "hadamard")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_fused_rotation_changes_no_prediction_beyond_rounding(tmp_path):
    """On CUDA q, k and v are rotated inside the fused q/k-norm + RoPE kernel and o_proj's weight is folded: with a
    bf16 cache the next-token log-probs equal the unrotated engine's up to rounding, as on the CPU. head_dim 128:
    the kernel rotates heads of 32 values or more, and FlashInfer's prefill takes no 16-value heads."""
    from offline.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=128,
                                    intermediate_size=1024, seed=4))

    def engine(rotation: str) -> Engine:
        return Engine(EngineConfig(model_dir=model_dir, device="cuda", cache=CacheConfig(
            kv_dtype="bf16", kv_rotation=rotation, page_size=16, max_total_tokens=2048)))

    windows = [prompt(40), prompt(40, offset=11)]
    plain = teacher_forced_logprobs(engine("none"), windows, 24)
    rotated = teacher_forced_logprobs(engine("hadamard"), windows, 24)
    assert (plain - rotated).abs().max() < 1e-1  # bf16 model and activations on the GPU
    assert (plain.argmax(-1) == rotated.argmax(-1)).float().mean() >= 0.95


def test_a_rotated_model_hands_attention_rotated_vectors_and_computes_the_same_logits(tiny_model_dir):
    """``CausalLM.rotate_kv``: q, k, v reach the AttnFn as ``x @ R`` (rotated inside qk_norm_rope) and the folded
    o_proj takes the rotated output back, so the logits are those of the plain model; folding twice is refused."""
    from engine.loader import load_model
    from engine.model import causal_attention_no_cache

    def run_model(rotated: bool):
        model = load_model(tiny_model_dir, dtype=torch.float32).model
        if rotated:
            model.rotate_kv(head_rotation("hadamard", model.config.head_dim, "cpu", torch.float32))
        seen = []
        inner = causal_attention_no_cache([10])

        def attn(layer_id, q, k, v):
            seen.append((q, k, v))
            return inner(layer_id, q, k, v)

        with torch.no_grad():
            logits = model.compute_logits(model(torch.arange(3, 13), torch.arange(10), attn))
        return model, logits, seen

    _, plain, plain_seen = run_model(False)
    model, rotated, rotated_seen = run_model(True)
    r = rotation_matrix("hadamard", model.config.head_dim)
    for plain_qkv, rot_qkv in zip(plain_seen, rotated_seen, strict=True):
        for x, xr in zip(plain_qkv, rot_qkv, strict=True):
            torch.testing.assert_close(xr, (x.float() @ r).to(x.dtype), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rotated, plain, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="already rotated"):
        model.rotate_kv(model.kv_rotation)
