"""Every flag of every nvfp4-serve command has a description and shows its default in --help; --version works."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from svc_common.cli_help import HelpFormatter

ROOT = Path(__file__).resolve().parent.parent

# (entry module, its main) for each command; the parser is caught where main parses its argv
COMMANDS = {
    "up": ("nvfp4_serve.launcher", "up"),
    "prefill": ("prefill_svc.__main__", "main"),
    "decode": ("decode_svc.__main__", "main"),
    "router": ("router.__main__", "main"),
    "calibrate": ("offline.calibration", "main"),
    "eval": ("offline.evaluation", "main"),
    "make-model": ("offline.tiny_model", "main"),
    "warm-cache": ("offline.warm_cache", "main"),
    "bench": ("benchmarks.serving.__main__", "main"),
    "bench gen-trace": ("benchmarks.agentic.generate", "main"),
    "bench --trace": ("benchmarks.agentic.sweep", "main"),
    "bench agentic-report": ("benchmarks.agentic.report", "main"),
    "experiments-report": ("benchmarks.serving.experiments_report", "main"),
}


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(command: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser the command's main builds, caught at its parse_args (so run_service's flags are on it)."""
    def catch(self, *args, **kwargs):
        raise _Caught(self)

    module, fn = COMMANDS[command]
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    with pytest.raises(_Caught) as caught:
        getattr(importlib.import_module(module), fn)([])
    monkeypatch.undo()
    return caught.value.parser


def options(parser: argparse.ArgumentParser):
    """(parser, action) for every flag of the parser and of its sub-commands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from options(sub)
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser, action


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_a_description_and_its_default_in_help(command, monkeypatch):
    parser = parser_of(command, monkeypatch)
    undocumented, no_default = [], []
    for owner, action in options(parser):
        assert issubclass(owner.formatter_class, HelpFormatter), f"{owner.prog} does not show defaults"
        if not (action.help or "").strip():
            undocumented.append(f"{owner.prog} {action.option_strings[0]}")
            continue
        shown = owner._get_formatter()._expand_help(action)
        unset = action.default is None or action.default is False or action.default == ""
        if not unset and "default" not in shown:
            no_default.append(f"{owner.prog} {action.option_strings[0]}")
    assert not undocumented, f"flags without a description: {undocumented}"
    assert not no_default, f"flags whose help does not show the default: {no_default}"


def test_help_appends_the_default_unless_the_text_names_it():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--model", default=None, help="a directory; default: the embedded model")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds; 0: none")
    p.add_argument("--flag", action="store_true", help="turn it on")
    text = " ".join(p.format_help().split())
    assert "tokens per KV page (default: 16)" in text and "seconds; 0: none (default: 0.0)" in text
    assert "default: the embedded model (default" not in text and "turn it on (default" not in text


@pytest.mark.parametrize("command", ["up", "prefill", "decode"])
def test_attention_backend_help_lists_every_registered_backend(command, monkeypatch):
    from nvfp4_kernels.backends.registry import available_backends

    parser = parser_of(command, monkeypatch)
    action = next(a for _, a in options(parser) if "--attention-backend" in a.option_strings)
    assert "reference-block-select" in available_backends()
    for name in available_backends():
        assert name in action.help and name in action.choices


@pytest.mark.parametrize("command", ["up", "prefill", "decode"])
def test_context_length_and_its_vllm_alias_parse_on_every_engine_command(command, monkeypatch):
    parser = parser_of(command, monkeypatch)
    assert parser.parse_args(["--context-length", "4096"]).context_length == 4096
    assert parser.parse_args(["--max-model-len", "2048"]).context_length == 2048
    assert parser.parse_args([]).context_length is None


def test_version_from_the_installed_command():
    r = subprocess.run([sys.executable, "-m", "nvfp4_serve.cli", "--version"], check=False, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"nvfp4-serve {metadata.version('nvfp4-serve')}"


@pytest.mark.parametrize("command", ["up", "prefill", "decode", "router", "calibrate", "eval"])
def test_every_command_has_version(command, capsys):
    from nvfp4_serve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"nvfp4-serve {metadata.version('nvfp4-serve')}"
