"""The prefill and decode services' own flags, generated from the Flag metadata of their config fields
(svc_common/config_flags.py): every flag round-trips (argv -> config -> the same values, and the argv generated
back from the parsed flags gives the same config), the defaults are the dataclasses', and --help lists each flag
once with its default."""

from __future__ import annotations

import argparse
import re

import pytest

from decode_svc import config as decode_config
from decode_svc.config import DecodeConfig, Timeouts
from engine.config import EngineConfig
from prefill_svc import config as prefill_config
from prefill_svc.config import PrefillConfig
from svc_common.cli_help import HelpFormatter
from svc_common.config_flags import flag_default, flag_name, flags_to_argv, iter_flags
from svc_common.service_auth import SERVICE_TOKEN_ENV

# Per service: each of its own flags -> (argv values, the config's value(s) they give: getter -> expected).
PREFILL_FLAGS = {
    "--kv-transfer": (["grpc"], {lambda c: c.kv_transfer: "grpc"}),
    "--kv-hold-timeout": (["7.5"], {lambda c: c.kv_hold_timeout_s: 7.5}),
    "--kv-message-bytes": (["65536"], {lambda c: c.kv_message_bytes: 65536}),
    "--kv-lane-timeout": (["3.25"], {lambda c: c.kv_lane_timeout_s: 3.25}),
    "--kv-sender": (["process"], {lambda c: c.kv_sender: "process"}),
    "--kv-exports-ahead": (["5"], {lambda c: c.kv_exports_ahead: 5}),
}
DECODE_FLAGS = {
    "--kv-transfer": (["cuda-ipc"], {lambda c: c.kv_transfer: "cuda-ipc"}),
    "--prefill-addresses": (["h1:1", "h2:2"], {lambda c: c.prefill_addresses: ("h1:1", "h2:2")}),
    "--decode-interval-while-pulling-ms": (["5"], {lambda c: c.decode_interval_while_pulling_s: 0.005}),
    "--kv-grpc-lanes": (["3"], {lambda c: c.kv_grpc_lanes: 3}),
    "--admission-timeout": (["1.5"], {lambda c: c.timeouts.admission_s: 1.5}),
    "--prefill-first-message-timeout": (["2.5"], {lambda c: c.timeouts.prefill_first_message_s: 2.5}),
    "--between-pages-timeout": (["3.5"], {lambda c: c.timeouts.between_pages_s: 3.5}),
    "--between-tokens-timeout": (["4.5"], {lambda c: c.timeouts.between_tokens_s: 4.5}),
}
SERVICES = {"prefill": (prefill_config, PrefillConfig, PREFILL_FLAGS),
            "decode": (decode_config, DecodeConfig, DECODE_FLAGS)}


@pytest.fixture(autouse=True)
def _no_service_token(monkeypatch):
    monkeypatch.delenv(SERVICE_TOKEN_ENV, raising=False)


def _own_flags(cls: type) -> list[str]:
    return [flag_name(f, spec) for f, _, spec in iter_flags(cls, skip=("engine",))]


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_service_flag_round_trips(service):
    module, cls, table = SERVICES[service]
    assert _own_flags(cls) == list(table)  # a new service flag needs its row here
    argv = ["--model", "m"] + [token for name, (values, _) in table.items() for token in (name, *values)]
    p = module.build_arg_parser()
    a = p.parse_args(argv)
    cfg = module.config_from_args(a)
    for name, (_, expected) in table.items():
        for get, value in expected.items():
            assert get(cfg) == (pytest.approx(value) if isinstance(value, float) else value), name
    again = flags_to_argv(cls, a, skip=("engine",))
    assert module.config_from_args(p.parse_args(["--model", "m", *again])) == cfg


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_defaults_are_the_dataclass_defaults(service):
    module, cls, _ = SERVICES[service]
    cfg = module.config_from_args(module.build_arg_parser().parse_args(["--model", "m"]))
    engine = EngineConfig(model_dir="m", disable_cuda_graph=service == "prefill")
    assert cfg == cls(engine=engine)
    if service == "decode":
        assert cfg.timeouts == Timeouts() and cfg.prefill_addresses == ()


def _help_entries(p: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each option's help lines (whitespace joined), keyed by its flag; a flag listed twice has two."""
    p.formatter_class = HelpFormatter
    body = p.format_help().split("\n\n", 2)[2]  # past the usage and the description
    entries: dict[str, list[str]] = {}
    for chunk in re.split(r"\n(?=  -)", "\n" + body):
        m = re.match(r"\s*(--[\w-]+)", chunk)
        if m:
            lines = [line for line in chunk.splitlines() if line.startswith(" ")]  # not the next group's title
            entries.setdefault(m.group(1), []).append(" ".join(" ".join(lines).split()))
    return entries


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_help_lists_each_service_flag_once_with_its_default(service, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    module, cls, _ = SERVICES[service]
    entries = _help_entries(module.build_arg_parser())
    for f, _, spec in iter_flags(cls, skip=("engine",)):
        name = flag_name(f, spec)
        assert len(entries.get(name, [])) == 1, f"{name} is listed {len(entries.get(name, []))} times"
        assert f"(default: {flag_default(f, spec)})" in entries[name][0], entries[name][0]
    if service == "decode":  # the deadlines keep their group
        help_text = module.build_arg_parser().format_help()
        group = help_text[help_text.index("deadlines (seconds):"):]
        assert group.index("--admission-timeout") < group.index("--between-tokens-timeout") < group.index("TLS")


def test_bad_service_values_are_argparse_errors(capsys):
    for argv, said in ((["--kv-transfer", "carrier-pigeon"], "argument --kv-transfer: invalid choice"),
                       (["--admission-timeout", "soon"], "argument --admission-timeout: invalid float value"),
                       (["--decode-interval-while-pulling-ms", "x"], "invalid float value: 'x'")):
        with pytest.raises(SystemExit):
            decode_config.build_arg_parser().parse_args(argv)
        assert said in capsys.readouterr().err
    a = decode_config.build_arg_parser().parse_args(["--model", "m", "--decode-interval-while-pulling-ms", "2000"])
    with pytest.raises(ValueError, match=r"--decode-interval-while-pulling-ms must be in \[0, 1000\], got 2000"):
        decode_config.config_from_args(a)
