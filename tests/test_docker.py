"""docker/compose.yaml, the Dockerfiles and .dockerignore: checked as files everywhere, with `docker compose config`
where the docker CLI and its compose plugin exist, and built and started (profile cpu) where a Docker daemon runs."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker" / "compose.yaml"
PROFILES = ("cpu", "gpu", "gpu2")
ROLES = ("prefill", "decode", "router")
yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def defaults(value: str) -> str:
    """A compose string with every ``${VAR:-default}`` replaced by its default (what runs when VAR is unset)."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", value)


def services_of(profile: str) -> dict[str, dict]:
    return {n: s for n, s in load_compose()["services"].items() if profile in s.get("profiles", [])}


def command(svc: dict) -> list[str]:
    return [defaults(c) for c in svc["command"]]


def flag(svc: dict, name: str) -> str:
    cmd = command(svc)
    return cmd[cmd.index(name) + 1]


def gpu_ids(svc: dict) -> list[str]:
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    return [defaults(d) for d in devices[0]["device_ids"]]


# -- the compose file --------------------------------------------------------------------------------
def test_compose_file_validates_against_the_compose_specification():
    schema = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(load_compose())


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"profile_{p}")  # not "gpu": conftest skips that
def test_each_profile_is_the_whole_topology_with_restart_healthchecks_and_start_order(profile):
    services = services_of(profile)
    assert set(services) == {f"{role}-{profile}" for role in ROLES}
    for name, svc in services.items():
        assert svc["restart"] in ("on-failure", "unless-stopped"), name
        assert "build" in svc and svc["build"]["context"] == ".." and "image" in svc, name
        assert (ROOT / svc["build"]["dockerfile"]).is_file()
        assert "test" in svc["healthcheck"], name
        # passed through from the shell when set: the API key (also the gRPC links' token), hub access
        assert {"NVFP4_SERVE_API_KEY", "NVFP4_SERVE_SERVICE_TOKEN", "HF_TOKEN", "HF_HUB_OFFLINE"} <= set(svc["environment"])
    prefill, decode, router = (services[f"{role}-{profile}"] for role in ROLES)
    # decode starts once the prefill is healthy (its pool is allocated), the router once the decode is
    assert decode["depends_on"] == {f"prefill-{profile}": {"condition": "service_healthy"}}
    assert router["depends_on"] == {f"decode-{profile}": {"condition": "service_healthy"}}
    # the decode pulls only from the prefill the router names
    assert flag(decode, "--prefill-addresses") == flag(router, "--prefill-addresses") == f"prefill-{profile}:50051"
    assert flag(router, "--decode-addresses") == f"decode-{profile}:50061"
    assert [defaults(p) for p in router["ports"]] == ["127.0.0.1:8000:8000"]  # the host's loopback by default
    assert "ports" not in prefill and "ports" not in decode


def test_every_image_a_service_names_is_built_by_the_file():
    """No service names an image without a build: (compose would try to pull it)."""
    for name, svc in load_compose()["services"].items():
        assert "build" in svc, f"{name} uses {svc.get('image')} without a build:"


def test_one_gpu_profile_splits_the_gpu_between_prefill_and_decode():
    s = services_of("gpu")
    prefill, decode = s["prefill-gpu"], s["decode-gpu"]
    assert gpu_ids(prefill) == gpu_ids(decode) == ["0"]
    pool, workspace = int(flag(prefill, "--max-total-tokens")), int(flag(prefill, "--workspace-tokens"))
    assert pool == 2 * workspace  # the prompts it has in flight, not a share of the GPU
    assert "--mem-fraction-static" not in command(prefill)
    assert 0 < float(flag(decode, "--mem-fraction-static")) < 1 and "--max-total-tokens" not in command(decode)
    assert flag(decode, "--workspace-tokens") == flag(prefill, "--workspace-tokens")


def test_two_gpu_profile_puts_prefill_and_decode_on_different_gpus():
    s = services_of("gpu2")
    assert gpu_ids(s["prefill-gpu2"]) == ["0"] and gpu_ids(s["decode-gpu2"]) == ["1"]
    for role in ("prefill", "decode"):
        assert 0 < float(flag(s[f"{role}-gpu2"], "--mem-fraction-static")) < 1


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"profile_{p}")  # not "gpu": conftest skips that
def test_the_default_model_volume_exists_and_every_service_reads_the_same_model(profile):
    for name, svc in services_of(profile).items():
        mounts = {defaults(v).rsplit(":", 2)[1]: defaults(v) for v in svc["volumes"]}
        source, target, mode = mounts["/model"].split(":")
        assert mode == "ro" and target == "/model"
        model = (COMPOSE.parent / source).resolve()
        assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file(), model
        assert model == (ROOT / "svc_common" / "models" / "default").resolve()
        assert "hf-cache:/var/cache/huggingface" in svc["volumes"]
        model_flag = "--model-dir" if name.startswith("router") else "--model"
        assert flag(svc, model_flag) == "/model"
        assert svc["command"][svc["command"].index(model_flag) + 1] == "${MODEL:-/model}"  # or a hub id
    assert set(load_compose()["volumes"]) == {"hf-cache", "jit-cache"}


def test_gpu_services_keep_their_jit_caches_on_a_volume_the_image_points_at():
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    for svc in (*services_of("gpu").values(), *services_of("gpu2").values()):
        assert "jit-cache:/var/cache/nvfp4-serve" in svc["volumes"]
    assert "TRITON_CACHE_DIR=/var/cache/nvfp4-serve/" in text and "FLASHINFER_WORKSPACE_BASE=/var/cache/nvfp4-serve" in text


def test_compose_commands_parse_with_the_real_cli_parsers():
    from decode_svc.config import build_arg_parser as decode_parser
    from prefill_svc.config import build_arg_parser as prefill_parser
    from router.config import build_arg_parser as router_parser

    parsers = {"prefill": prefill_parser, "decode": decode_parser, "router": router_parser}
    for svc in load_compose()["services"].values():
        cmd = command(svc)
        parsers[cmd[0]]().parse_args(cmd[1:])  # raises SystemExit on an unknown or bad option


# -- the Dockerfiles and the build context -----------------------------------------------------------------
def _instructions(name: str) -> list[tuple[str, str]]:
    text = (ROOT / "docker" / name).read_text().replace("\\\n", " ")
    return [(line.split()[0], line) for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfiles_copy_every_package_and_use_the_cli(name):
    instructions = _instructions(name)
    kinds = [k for k, _ in instructions]
    assert kinds[0] in ("FROM", "ARG") and "FROM" in kinds
    assert set(kinds) <= {"ARG", "FROM", "ENV", "WORKDIR", "RUN", "COPY", "EXPOSE", "ENTRYPOINT", "CMD"}
    copied = {shlex.split(line)[1] for k, line in instructions if k == "COPY"}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in (p.rstrip("*") for p in packages):  # every package the project installs
        assert pkg in copied, f"{name} does not copy {pkg}"
    assert 'ENTRYPOINT ["nvfp4-serve"]' in (ROOT / "docker" / name).read_text()
    assert any("HF_HOME=/var/cache/huggingface" in line for k, line in instructions if k == "ENV")


def test_gpu_image_is_a_cuda_devel_base_with_pinned_torch_triton_and_flashinfer():
    instructions = _instructions("Dockerfile.gpu")
    base = next(line for k, line in instructions if k == "ARG" and "CUDA_IMAGE=" in line).split("=", 1)[1]
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-devel-ubuntu\d\d\.\d\d", base), base  # nvcc + gcc: JIT works
    assert ("FROM", "FROM ${CUDA_IMAGE}") in instructions
    pins = " ".join(line for k, line in instructions if k == "RUN")
    assert re.search(r"\btorch==2\.13\.0\b", pins) and re.search(r"\btriton==\d+\.\d+\.\d+\b", pins)
    assert re.search(r"\bflashinfer-python==\d+\.\d+\.\d+(\.post\d+)?\b", pins)


def test_cpu_image_pins_the_cpu_build_of_torch():
    runs = " ".join(line for k, line in _instructions("Dockerfile.cpu") if k == "RUN")
    assert re.search(r"--index-url \S+/whl/cpu torch==2\.13\.0\b", runs)
    assert next(line for k, line in _instructions("Dockerfile.cpu") if k == "FROM").startswith("FROM python:3.11-")


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule, for the patterns used here: a pattern matches the path or one of its parents."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        pat = pat.removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p.rsplit("/", 1)[-1], pat) and "/" not in pat
               for p in prefixes):
            return True
    return False


def test_dockerignore_keeps_local_state_out_and_everything_the_images_copy_in():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for junk in (".git/HEAD", ".venv/bin/python", ".gpu-carry/flashinfer.tar.xz", ".whl/x.whl", "dist/a.whl",
                 "engine/__pycache__/engine.cpython-311.pyc", "nvfp4_serve.egg-info/PKG-INFO", ".pytest_cache/v"):
        assert _ignored(junk, patterns), f"{junk} would enter the build context"
    needed = {"pyproject.toml", "README.md", "svc_common/models/default/model.safetensors",
              "svc_common/models/default/tokenizer.json", "proto/nvfp4_serve_proto/common.proto"}
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        for kind, line in _instructions(name):
            if kind == "COPY":
                needed.update(shlex.split(line)[1:-1])
    for path in sorted(needed):
        assert (ROOT / path).exists(), path
        assert not _ignored(path, patterns), f"{path} is copied by a Dockerfile but .dockerignore drops it"


# -- with the docker CLI -----------------------------------------------------------------------------------
def _compose_cli() -> list[str]:
    if shutil.which("docker") is None:
        pytest.skip("the docker CLI is not installed")
    r = subprocess.run(["docker", "compose", "version"], check=False, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"the docker compose plugin is not installed ({(r.stderr or r.stdout).strip().splitlines()[0]})")
    return ["docker", "compose", "-f", str(COMPOSE)]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"profile_{p}")  # not "gpu": conftest skips that
def test_docker_compose_config_accepts_each_profile(profile):
    r = subprocess.run([*_compose_cli(), "--profile", profile, "config", "--format", "json"], check=False,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout)
    assert set(config["services"]) == {f"{role}-{profile}" for role in ROLES}
    source = config["services"][f"prefill-{profile}"]["volumes"][0]["source"]
    assert Path(source) == (ROOT / "svc_common" / "models" / "default").resolve()


def _daemon() -> None:
    _compose_cli()
    r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"no Docker daemon to build and start images ({(r.stderr or r.stdout).strip().splitlines()[-1]})")


@pytest.mark.slow
def test_cpu_profile_builds_starts_and_serves_a_completion():
    """Builds nvfp4-serve:cpu, starts the cpu profile, asks for a completion, stops it (minutes: --run-slow)."""
    _daemon()
    project = ["-p", "nvfp4-serve-test"]
    cli = [*_compose_cli(), *project, "--profile", "cpu"]
    env_port = "18000"
    env = {**os.environ, "PORT": env_port}
    try:
        subprocess.run([*cli, "up", "--build", "--detach", "--wait", "--wait-timeout", "900"], check=True,
                       timeout=3000, env=env)
        url = f"http://127.0.0.1:{env_port}"
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}).encode()
        deadline = time.monotonic() + 120
        while True:
            try:
                req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as resp:
                    out = json.loads(resp.read())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        assert out["usage"]["completion_tokens"] >= 1 and out["choices"][0]["text"]
    finally:
        subprocess.run([*cli, "down", "--volumes"], check=False, timeout=600, env=env)


def test_gpu_image_builds_the_launcher_stubs_against_the_toolkit_stub_for_that_step_only():
    instructions = _instructions("Dockerfile.gpu")
    warm = [line for k, line in instructions if k == "RUN" and "warm-cache" in line]
    assert len(warm) == 1 and "--no-host-launchers" not in warm[0]
    link = re.search(r"ln -s /usr/local/cuda/lib64/stubs/libcuda\.so (\S+)/libcuda\.so\.1", warm[0])
    assert link and f"TRITON_LIBCUDA_PATH={link.group(1)}" in warm[0]
    assert warm[0].index("TRITON_LIBCUDA_PATH") < warm[0].index("warm-cache")
    # the stub must not reach the running image: there the host's driver is the libcuda.so.1 found
    assert not any("TRITON_LIBCUDA_PATH" in line for k, line in instructions if k in ("ENV", "ARG"))
