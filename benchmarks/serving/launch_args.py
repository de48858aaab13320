"""The benchmarks' ``--launch`` arguments: everything after ``--launch`` goes to ``nvfp4-serve up`` unchanged, and
the benchmark reads a few of its flags (the API key, the memory flags) from them. Shared by ``bench run``,
``bench experiments`` and the agentic ``bench --trace``."""

from __future__ import annotations

import os

LAUNCH_FLAG = "--launch"
KEY_ENVS = ("NVFP4_SERVE_API_KEY", "OPENAI_API_KEY")  # where a bearer token comes from when --api-key is not given


def split_launch(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(benchmark args, launcher args or None): everything after ``--launch`` belongs to the launcher."""
    if LAUNCH_FLAG not in argv:
        return argv, None
    i = argv.index(LAUNCH_FLAG)
    return argv[:i], argv[i + 1:]


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), None when absent."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def resolve_api_key(given: str, launch_args: list[str] | None) -> str:
    """The bearer token: ``given``, else the first of ``KEY_ENVS`` set, else the launch args' ``--api-key``."""
    return given or next((os.environ[k] for k in KEY_ENVS if os.environ.get(k)), "") or \
        (flag_value(launch_args or [], "--api-key") or "")
