"""docker/compose.yaml and the Dockerfiles, checked without a Docker engine (CI has none)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_compose_file_validates_against_the_compose_specification():
    schema = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(load_compose())


def test_compose_has_a_cpu_and_a_gpu_profile_with_the_whole_topology():
    services = load_compose()["services"]
    for profile in ("cpu", "gpu"):
        names = {n for n, s in services.items() if profile in s.get("profiles", [])}
        assert {f"prefill-{profile}", f"decode-{profile}", f"router-{profile}"} == names
    gpu = services["decode-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_compose_commands_parse_with_the_real_cli_parsers():
    from decode_svc.config import build_arg_parser as decode_parser
    from prefill_svc.config import build_arg_parser as prefill_parser
    from router.config import build_arg_parser as router_parser

    parsers = {"prefill": prefill_parser, "decode": decode_parser, "router": router_parser}
    for svc in load_compose()["services"].values():
        cmd = [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", c) for c in svc["command"]]
        parsers[cmd[0]]().parse_args(cmd[1:])  # raises SystemExit on an unknown or bad option


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfiles_copy_every_package_and_use_the_cli(name):
    text = (ROOT / "docker" / name).read_text()
    instructions = [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert instructions[0] == "FROM" and set(instructions) <= {"FROM", "ENV", "WORKDIR", "RUN", "COPY", "EXPOSE",
                                                               "ENTRYPOINT", "CMD"}
    copied = {shlex.split(line)[1] for line in text.splitlines() if line.startswith("COPY")}
    for pkg in ("kernels", "engine", "prefill_svc", "decode_svc", "router", "nvfp4_serve", "nvfp4_serve_proto"):
        assert pkg in copied, f"{name} does not copy {pkg}"
    assert 'ENTRYPOINT ["nvfp4-serve"]' in text
