"""KV-cache calibration: the scales file, amax recording, scale precedence, and the transfer header check."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import grpc
import pytest
import torch

from engine.engine import Engine
from engine.loader import model_fingerprint
from offline.calibration import KVScales, calibrate, main
from offline.tiny_model import make_tiny_model
from svc_common.engine_args import add_engine_args, engine_args_to_argv, engine_config_from_args
from tests.model_fixtures import read_checkpoint

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x, self.y = x, y\n"
) * 3


def _scales(fp: str = "0123456789abcdef", k=(2688.0, 0.0), v=(4.48, 1.0)) -> KVScales:
    return KVScales(fp, tuple(k), tuple(v), num_tokens=10, source="test")


def test_scales_file_round_trips_and_derives_nvfp4_and_fp8_scales(tmp_path):
    s = _scales()
    path = tmp_path / "s.json"
    s.save(path)
    assert KVScales.load(path, "0123456789abcdef") == s
    data = json.loads(path.read_text())
    assert data["format"] == "nvfp4-serve/kv-scales" and data["version"] == 1 and data["num_layers"] == 2
    assert data["nvfp4"] == {"k_scales": [1.0, 1.0], "v_scales": [4.48 / 2688, 1 / 2688]}  # amax 0 keeps 1.0
    assert data["fp8"] == {"k_scales": [6.0, 1.0], "v_scales": [0.01, 1 / 448]}
    nv = s.cache_scales("nvfp4")
    assert (
        nv["k_scales"] == (1.0, 1.0)
        and nv["ws_k_scales"] == (6.0, 1.0)
        and nv["ws_v_scales"] == (0.01, 1 / 448)
    )
    assert s.cache_scales("fp8_e4m3") == {"k_scales": (6.0, 1.0), "v_scales": (0.01, 1 / 448)}
    assert s.cache_scales("bf16") == {}


def test_loading_refuses_other_models_edited_scales_and_foreign_files(tmp_path):
    path = tmp_path / "s.json"
    _scales().save(path)
    with pytest.raises(ValueError, match="calibrated for model 0123456789abcdef.*recalibrate"):
        KVScales.load(path, "ffffffffffffffff")
    data = json.loads(path.read_text())
    data["nvfp4"]["k_scales"][0] = 0.5
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="nvfp4.k_scales does not follow from amax"):
        KVScales.load(path)
    path.write_text(json.dumps({"k_scale": 1.0}))
    with pytest.raises(ValueError, match="not an nvfp4-serve KV scales file"):
        KVScales.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        KVScales.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="finite and >= 0"):
        KVScales("x", (1.0, float("nan")), (1.0, 1.0))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_calibrate_records_the_amax_of_the_cached_k_and_v(tiny_model_dir):
    """Layer 0's K (after k_norm and RoPE) and V recomputed from the raw checkpoint in float64."""
    scales = calibrate(tiny_model_dir, TEXT, num_tokens=40, device="cpu", dtype="float32")
    assert scales.num_tokens == 40 and scales.model_fingerprint == model_fingerprint(tiny_model_dir)
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    from tokenization.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(tiny_model_dir).encode(TEXT, add_special_tokens=False)[:40]
    w = {k: t.double() for k, t in read_checkpoint(tiny_model_dir).items()}
    d, hk, eps = cfg["head_dim"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    x = _rms(w["model.embed_tokens.weight"][ids], w["model.layers.0.input_layernorm.weight"], eps)
    k = _rms(
        (x @ w["model.layers.0.self_attn.k_proj.weight"].T).view(-1, hk, d),
        w["model.layers.0.self_attn.k_norm.weight"],
        eps,
    )
    v = x @ w["model.layers.0.self_attn.v_proj.weight"].T
    pos = torch.arange(len(ids), dtype=torch.float64)[:, None]
    ang = pos / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    k = torch.cat(
        [k[..., : d // 2] * cos - k[..., d // 2 :] * sin, k[..., d // 2 :] * cos + k[..., : d // 2] * sin], -1
    )
    assert scales.k_amax[0] == pytest.approx(float(k.abs().max()), rel=1e-4)
    assert scales.v_amax[0] == pytest.approx(float(v.abs().max()), rel=1e-4)
    assert all(a > 0 for a in scales.k_amax + scales.v_amax)


def test_calibrate_command_writes_a_loadable_file(tiny_model_dir, tmp_path, capsys):
    data, out = tmp_path / "calib.txt", tmp_path / "scales.json"
    data.write_text(TEXT)
    assert (
        main(
            [
                "--model",
                tiny_model_dir,
                "--out",
                str(out),
                "--data",
                str(data),
                "--num-tokens",
                "32",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    s = KVScales.load(out, model_fingerprint(tiny_model_dir))
    assert s.num_tokens == 32 and s.source == f"file {data}"
    assert "layer   1" in capsys.readouterr().out


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "256", *argv])


def test_scale_precedence_is_file_then_checkpoint_then_one(tmp_path):
    ckpt = make_tiny_model(tmp_path / "ckpt", kv_scales={"k": [0.5, 0.25], "v": [2.0, 4.0]})
    plain = make_tiny_model(tmp_path / "plain")
    file = tmp_path / "s.json"
    _scales(model_fingerprint(ckpt), k=(26.88, 53.76), v=(2.688, 5.376)).save(file)

    def engine(*argv: str) -> Engine:
        return Engine(engine_config_from_args(_parse(*argv)))

    from_ckpt = engine("--model", str(ckpt))  # checkpoint scales are FP8 scales: nvfp4 pool = scale / 6
    assert from_ckpt.k_scales == pytest.approx([0.5 / 6, 0.25 / 6])
    assert from_ckpt.v_scales == pytest.approx([2.0 / 6, 4.0 / 6])
    assert from_ckpt.pool.layers[0].ws_k_scale == 0.5 and from_ckpt.pool.layers[1].ws_v_scale == 4.0
    fp8_ckpt = engine("--model", str(ckpt), "--kv-cache-dtype", "fp8_e4m3")
    assert fp8_ckpt.k_scales == [0.5, 0.25] and fp8_ckpt.v_scales == [2.0, 4.0]
    from_file = engine("--model", str(ckpt), "--kv-scales", str(file))
    assert from_file.k_scales == pytest.approx([0.01, 0.02]) and from_file.v_scales == pytest.approx(
        [1e-3, 2e-3]
    )
    layer = from_file.pool.layers[1]
    assert layer.k_scale == pytest.approx(0.02) and layer.ws_k_scale == pytest.approx(0.12)  # amax / 448
    fp8_file = engine("--model", str(ckpt), "--kv-scales", str(file), "--kv-cache-dtype", "fp8_e4m3")
    assert fp8_file.k_scales == pytest.approx([0.06, 0.12]) and fp8_file.pool.layers[
        0
    ].ws_v_scale == pytest.approx(2.688 / 448)
    neither = engine("--model", str(plain))
    assert neither.k_scales == [1.0, 1.0] and neither.v_scales == [1.0, 1.0]
    with pytest.raises(ValueError, match="recalibrate for this model"):
        engine_config_from_args(_parse("--model", str(plain), "--kv-scales", str(file)))


def test_launcher_forwards_the_scales_file_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = engine_args_to_argv(_parse("--model", "m", "--kv-scales", "s.json"))
    assert argv[argv.index("--kv-scales") + 1] == str(tmp_path / "s.json")
    assert "--kv-scales" not in engine_args_to_argv(_parse("--model", "m"))


def test_decode_refuses_a_prefill_with_other_kv_scales(tiny_model_dir, tmp_path):
    from tests.service_procs import start_many

    fp = model_fingerprint(tiny_model_dir)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _scales(fp, k=(3.0, 4.0), v=(1.0, 2.0)).save(a)
    _scales(fp, k=(5.0, 4.0), v=(1.0, 2.0)).save(b)
    common = (
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--model",
        tiny_model_dir,
        "--page-size",
        "4",
        "--kv-cache-dtype",
        "nvfp4",
    )
    p, d = start_many(
        [("prefill_svc", *common, "--kv-scales", str(a)), ("decode_svc", *common, "--kv-scales", str(b))]
    )
    try:
        _expect_k_scales_refusal(p, d)
    finally:
        p.stop()
        d.stop()


def _expect_k_scales_refusal(p, d) -> None:
    from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc

    req = decode_pb2.GenerateRequest(
        request_id="s",
        token_ids=list(range(3, 23)),
        prefill_address=p.address,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    )

    async def generate():
        async with grpc.aio.insecure_channel(d.address) as ch:
            return [m async for m in decode_pb2_grpc.DecodeStub(ch).Generate(req)]

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(generate())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = e.value.details()
    assert "k_scales" in msg and "v_scales" not in msg and "--kv-scales" in msg
    assert str(5.0 / 2688)[:6] in msg and str(3.0 / 2688)[:6] in msg
