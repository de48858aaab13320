"""``--model`` as a Hugging Face hub id, offline: a hub cache laid out at test time (models--org--name/blobs,
snapshots/<rev>/..., refs/main) under a temporary HF_HOME with HF_HUB_OFFLINE=1. Every entry point resolves the
id once, to the snapshot directory, and every child process of ``up`` is given that directory."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from svc_common.model_source import MODEL_FILE_PATTERNS, ModelSourceError, hub_id_of, resolve_model
from tests.service_procs import Launched

ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "tiny-org/tiny-qwen3"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(hf_home: Path, repo_id: str, model_dir: str | Path, revision: str = REVISION) -> Path:
    """Lay ``model_dir``'s files out as huggingface_hub caches a download; returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(Path(model_dir).iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model_dir):
    hf_home = tmp_path_factory.mktemp("hf_home")
    return hf_home, make_hub_cache(hf_home, REPO_ID, tiny_model_dir)


def _resolve_in(env: dict[str, str], spec: str) -> subprocess.CompletedProcess:
    """resolve_model in a fresh interpreter (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE at import)."""
    code = ("import sys; from svc_common.model_source import resolve_model, ModelSourceError\n"
            "try: print(resolve_model(sys.argv[1]))\n"
            "except ModelSourceError as e: print(e, file=sys.stderr); sys.exit(3)")
    return subprocess.run([sys.executable, "-c", code, spec], check=False, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_a_hub_id_in_the_cache_resolves_offline_to_its_snapshot(hub):
    hf_home, snapshot = hub
    r = _resolve_in(offline_env(hf_home), REPO_ID)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snapshot
    assert json.loads((snapshot / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_a_hub_id_missing_from_the_cache_offline_says_how_to_get_it(hub):
    hf_home, _ = hub
    r = _resolve_in(offline_env(hf_home), "tiny-org/not-downloaded")
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr and "hf download tiny-org/not-downloaded" in r.stderr
    assert str(hf_home / "hub") in r.stderr


def test_directories_resolve_to_themselves_and_paths_that_are_no_directory_are_refused(tmp_path, tiny_model_dir):
    assert resolve_model(tiny_model_dir) == str(Path(tiny_model_dir).resolve())
    assert resolve_model(None).endswith(os.path.join("svc_common", "models", "default"))
    for spec in ("./no-such-dir", str(tmp_path / "missing"), "a/b/c", "~/nope"):
        with pytest.raises(ModelSourceError, match="no such directory"):
            resolve_model(spec)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="is a file: pass the checkpoint's directory"):
        resolve_model(str(tmp_path / "config.json"))


def test_only_hub_ids_name_the_served_model(tmp_path, tiny_model_dir):
    assert hub_id_of("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B" and hub_id_of("gpt2") == "gpt2"
    assert hub_id_of(tiny_model_dir) is None and hub_id_of(None) is None and hub_id_of("./x") is None
    (tmp_path / "org").mkdir()
    assert hub_id_of(str(tmp_path / "org")) is None


@pytest.mark.parametrize("name,wanted", [
    ("config.json", True), ("generation_config.json", True), ("tokenizer.json", True),
    ("tokenizer_config.json", True), ("model.safetensors.index.json", True), ("model-00001-of-00004.safetensors", True),
    ("chat_template.jinja", True), ("merges.txt", True), ("tokenizer.model", True),
    ("pytorch_model.bin", False), ("model.gguf", False), ("onnx/model.onnx", False), ("original/consolidated.pth", False),
])
def test_only_config_tokenizer_and_safetensors_files_are_downloaded(name, wanted):
    assert any(fnmatch.fnmatch(name, p) for p in MODEL_FILE_PATTERNS) is wanted


def test_a_service_main_resolves_the_hub_id_before_it_loads(hub):
    """`nvfp4-serve prefill --model ORG/NAME` serves the cached snapshot (ready line), offline."""
    hf_home, _ = hub
    from nvfp4_serve.launcher import free_port

    proc = subprocess.Popen([sys.executable, "-m", "prefill_svc", "--model", REPO_ID, "--device", "cpu",
                             "--port", str(free_port()), "--max-total-tokens", "256", "--page-size", "4"],
                            env=offline_env(hf_home), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "ready on" in line:
                break
        assert any("ready on" in line for line in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def deployment(hub):
    hf_home, _ = hub
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(offline_env(hf_home))
    try:
        from nvfp4_serve.launcher import free_port

        metrics_port = free_port()
        d = Launched("--model", REPO_ID, "--page-size", "4", "--max-total-tokens", "1024", "--context-length", "256",
                     "--prefill-metrics-port", str(metrics_port), "--decode-args", "--between-tokens-timeout 300")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    d.metrics_port = metrics_port
    yield d
    d.stop()


def _child_argvs(pid: int) -> dict[str, list[str]]:
    """argv of each child of ``pid`` by module (prefill_svc, decode_svc, router)."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(pid)], check=False, capture_output=True, text=True).stdout.split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().rstrip("\0").split("\0")
        out[argv[argv.index("-m") + 1]] = argv
    return out


def test_up_gives_every_child_the_resolved_snapshot_directory(deployment, hub):
    _, snapshot = hub
    argvs = _child_argvs(deployment.proc.pid)
    assert set(argvs) == {"prefill_svc", "decode_svc", "router"}
    for name in ("prefill_svc", "decode_svc"):
        assert argvs[name][argvs[name].index("--model") + 1] == str(snapshot)
    assert argvs["router"][argvs["router"].index("--model-dir") + 1] == str(snapshot)
    assert f"model {snapshot}" in next(line for line in deployment.lines if "nvfp4-serve ready" in line)


def test_up_passes_context_length_metrics_port_and_service_args(deployment):
    argvs = _child_argvs(deployment.proc.pid)
    for name in ("prefill_svc", "decode_svc"):
        assert argvs[name][argvs[name].index("--context-length") + 1] == "256"
    assert argvs["router"][argvs["router"].index("--max-model-len") + 1] == "256"
    assert argvs["decode_svc"][-2:] == ["--between-tokens-timeout", "300"]
    assert "--metrics-port" not in argvs["decode_svc"]
    metrics = httpx.get(f"http://127.0.0.1:{deployment.metrics_port}/metrics", timeout=10)
    assert metrics.status_code == 200 and "nvfp4_prefill_" in metrics.text


def test_the_hub_model_serves_and_the_context_length_is_enforced(deployment):
    model = httpx.get(f"{deployment.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == REPO_ID  # named by its hub id, not by the snapshot's revision directory
    ok = httpx.post(f"{deployment.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    too_long = httpx.post(f"{deployment.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": list(range(1, 300)), "max_tokens": 4})
    assert too_long.status_code == 400 and "256" in too_long.text
