"""Router configuration: one frozen dataclass, parsed once at the entry point, passed down.

The argparse flags are generated from the dataclass fields (defaults, types and help come from it), so
the all-in-one launcher reuses them with ``add_router_args(parser)`` + ``config_from_args(args)``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from svc_common.service_auth import API_KEY_ENV, SERVICE_TOKEN_ENV, resolve_service_token
from svc_common.tls import TLSConfig

_SECRETS = ("api_key", "service_token")  # never printed: not in --help defaults, "<set>" in /server_info
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _opt(help_text: str, *aliases: str) -> dict[str, Any]:
    return {"help": help_text, "aliases": aliases}


@dataclass(frozen=True)
class RouterConfig:
    """Everything the OpenAI gateway needs; see ``--help`` for each field's meaning."""

    decode_addresses: tuple[str, ...] = field(
        default=(), metadata=_opt("decode services, host:port (space or comma separated)", "--decode"))
    prefill_addresses: tuple[str, ...] = field(
        default=(), metadata=_opt("prefill services, host:port; none -> decode services run prompts locally",
                                  "--prefill"))
    model_dir: str = field(default="", metadata=_opt("model directory (tokenizer, chat template, config.json) or "
                                                     "Hugging Face hub id (its cached snapshot; required)",
                                                     "--model"))
    served_model_name: str = field(
        default="", metadata=_opt("model id in the API (default: the hub id, else the model dir's name)"))
    host: str = field(default="127.0.0.1", metadata=_opt("bind address (localhost only by default)"))
    port: int = field(default=8000, metadata=_opt("HTTP port"))
    max_model_len: int = field(default=0, metadata=_opt("context limit in tokens; 0 -> config.json's"))
    api_key: str = field(default="", repr=False,
                         metadata=_opt(f"require 'Authorization: Bearer KEY' (or ${API_KEY_ENV})"))
    metrics_open: bool = field(
        default=False, metadata=_opt("serve /metrics without the API key (it names the workers' gRPC addresses)"))
    max_body_bytes: int = field(default=16 << 20, metadata=_opt("largest request body; beyond -> 413"))
    header_timeout_s: float = field(
        default=10.0, metadata=_opt("a request's headers must arrive within this (from the connection or its "
                                    "first byte); else 408 and the connection is closed"))
    body_timeout_s: float = field(
        default=60.0, metadata=_opt("a request's body must arrive within this after its headers; else 408"))
    keep_alive_timeout_s: float = field(
        default=5.0, metadata=_opt("an idle keep-alive connection is closed after this without a byte"))
    max_connections: int = field(
        default=4096, metadata=_opt("open HTTP connections (lowered to fit the file limit); beyond: the longest "
                                    "idle one is closed, or 503 when all are busy"))
    max_concurrent_requests: int = field(default=256, metadata=_opt("requests generating at once"))
    max_queued_requests: int = field(default=1024, metadata=_opt("requests waiting for a slot; beyond -> 429"))
    queue_timeout_s: float = field(default=60.0, metadata=_opt("longest wait for a slot; beyond -> 503"))
    retry_after_s: int = field(default=1, metadata=_opt("Retry-After seconds sent with 429/503"))
    max_n: int = field(default=16, metadata=_opt("largest n (choices per prompt)"))
    first_token_timeout_s: float = field(
        default=600.0, metadata=_opt("longest wait for a decode worker's first message (admission + prefill)"))
    inter_token_timeout_s: float = field(default=120.0, metadata=_opt("longest wait between two token messages"))
    request_timeout_s: float = field(default=0.0, metadata=_opt("gRPC deadline of a whole Generate; 0 -> none"))
    max_retries: int = field(default=2, metadata=_opt("retries on another worker before the first token"))
    health_check_interval_s: float = field(default=2.0, metadata=_opt("seconds between worker polls"))
    health_check_timeout_s: float = field(default=2.0, metadata=_opt("deadline of one GetLoad/Health call, and of each worker's GetMetrics in /metrics"))
    health_failure_threshold: int = field(
        default=2, metadata=_opt("failed polls (timeouts) before a worker is skipped; refused -> at once"))
    cache_threshold: float = field(
        default=0.5, metadata=_opt("prefix match / prompt length from which a decode worker's cache wins"))
    balance_abs_threshold: int = field(
        default=32, metadata=_opt("load gap (requests) beyond which the cache choice yields to balance"))
    balance_rel_threshold: float = field(
        default=1.5, metadata=_opt("load ratio beyond which (with the gap) the cache choice yields"))
    tree_max_tokens: int = field(
        default=1 << 21, metadata=_opt("tokens the router's prefix tree keeps per decode worker"))
    grpc_max_message_bytes: int = field(default=64 << 20, metadata=_opt("gRPC send/receive message limit"))
    tls_cert: str = field(default="", metadata=_opt("PEM client certificate for the gRPC links (enables TLS)"))
    tls_key: str = field(default="", metadata=_opt("PEM private key of --tls-cert"))
    tls_ca: str = field(default="", metadata=_opt("PEM CA that signs the workers' certificates"))
    tls_server_name: str = field(default="", metadata=_opt("verify workers against this name, not their host"))
    service_token: str = field(default="", repr=False, metadata=_opt(
        f"token sent on every gRPC call to the workers (or ${SERVICE_TOKEN_ENV}; default: the API key)"))
    log_level: str = field(default="info", metadata=_opt("log level: " + "|".join(_LOG_LEVELS)))

    def __post_init__(self) -> None:
        for name in ("decode_addresses", "prefill_addresses"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            parts = tuple(p.strip() for item in value for p in str(item).split(",") if p.strip())
            object.__setattr__(self, name, parts)
            for addr in parts:
                host, sep, port = addr.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ValueError(f"--{name.replace('_', '-')}: {addr!r} is not host:port")
            if len(set(parts)) != len(parts):
                raise ValueError(f"--{name.replace('_', '-')} lists an address twice: {parts}")
        if not self.decode_addresses:
            raise ValueError("--decode-addresses needs at least one decode service host:port")
        if not self.model_dir:
            raise ValueError("--model-dir is required (the router tokenizes with the model's tokenizer)")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        positive = ("max_body_bytes", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
                    "max_connections", "max_concurrent_requests", "max_n", "first_token_timeout_s",
                    "inter_token_timeout_s", "health_check_interval_s", "health_check_timeout_s",
                    "health_failure_threshold", "tree_max_tokens", "grpc_max_message_bytes", "queue_timeout_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        non_negative = ("max_model_len", "max_queued_requests", "retry_after_s", "request_timeout_s",
                        "max_retries", "balance_abs_threshold")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        self.tls  # noqa: B018 - validates the TLS files and their combination

    @property
    def tls(self) -> TLSConfig:
        """The client side of the router's gRPC links (plaintext when no certificate is given)."""
        return TLSConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca, server_name=self.tls_server_name,
                         service_token=self.service_token)

    @property
    def model_name(self) -> str:
        """The model id clients must send (and that responses carry)."""
        return self.served_model_name or Path(self.model_dir).name

    def public_dict(self) -> dict[str, Any]:
        """The config as JSON-able values, the API key and the service token replaced by whether one is set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        for name in _SECRETS:
            out[name] = "<set>" if getattr(self, name) else ""
        return out


class ModelLimits(NamedTuple):
    context_len: int  # longest prompt + completion
    vocab_size: int  # token ids must be below it (0: unknown)


def model_limits(config: RouterConfig, tokenizer_vocab_size: int = 0) -> ModelLimits:
    """Context length and vocabulary size from --max-model-len and the model's config.json."""
    hf: dict[str, Any] = {}
    path = Path(config.model_dir) / "config.json"
    if path.is_file():
        hf = json.loads(path.read_text())
        hf = {**hf.get("text_config", {}), **hf}
    context = config.max_model_len
    if not context:
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            if isinstance(hf.get(key), int) and hf[key] > 0:
                context = hf[key]
                break
    if not context:
        raise ValueError(f"cannot find the context length in {path}; pass --max-model-len")
    vocab = hf.get("vocab_size") if isinstance(hf.get("vocab_size"), int) else 0
    return ModelLimits(context, max(vocab or 0, tokenizer_vocab_size))


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per RouterConfig field (``--decode-addresses`` ...), defaults taken from the dataclass."""
    for f in fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag, *f.metadata.get("aliases", ())]
        default = f.default if f.default is not MISSING else None
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        help_text = f.metadata.get("help", "")
        if kind.startswith("tuple"):
            parser.add_argument(*names, dest=f.name, nargs="*", default=list(default), metavar="HOST:PORT",
                                help=help_text)
        elif kind == "bool":
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            conv = {"int": int, "float": float, "str": str}[kind]
            parser.add_argument(*names, dest=f.name, type=conv, default=default,
                                help=help_text if f.name in _SECRETS or default == "" or "default" in help_text
                                else f"{help_text} (default: {default!r})")
    return parser


def build_arg_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m router``."""
    parser = argparse.ArgumentParser(
        prog="nvfp4-serve router", description="nvfp4-serve router: the OpenAI-compatible HTTP gateway")
    return add_router_args(parser)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> RouterConfig:
    """Build the RouterConfig from parsed flags (the API key falls back to $NVFP4_SERVE_API_KEY, the service
    token to $NVFP4_SERVE_SERVICE_TOKEN, then to the API key)."""
    values = {f.name: getattr(args, f.name) for f in fields(RouterConfig) if hasattr(args, f.name)}
    for name in ("decode_addresses", "prefill_addresses"):
        if name in values:
            values[name] = tuple(values[name] or ())
    if not values.get("api_key"):
        values["api_key"] = os.environ.get(API_KEY_ENV, "")
    values["service_token"] = resolve_service_token(values.get("service_token"), values["api_key"])
    values.update(overrides)
    return RouterConfig(**values)
