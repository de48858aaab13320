"""Optional (mutual) TLS on the gRPC links router -> decode -> prefill.

One ``TLSConfig`` per process, from ``--tls-cert/--tls-key/--tls-ca`` (same flags on every service, the
router and the launcher). Every process of a deployment is both a server and a client, so the same files
serve both roles:

    server side (prefill, decode): presents cert/key; with a CA, requires and verifies a client certificate
                                   signed by it (mutual TLS); without one, any client may connect over TLS
    client side (router, decode):  verifies the server against the CA (the system roots without one) and
                                   presents cert/key as its client certificate

No flag: plaintext gRPC (the default, for loopback deployments). Certificates are read once at start-up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class TLSConfig:
    """Paths of PEM files ("" = unset) and an optional name to verify servers by."""

    cert: str = ""  # this process's certificate (chain), PEM
    key: str = ""  # its private key, PEM
    ca: str = ""  # CA that signs every peer; set -> clients must present a certificate signed by it
    server_name: str = ""  # verify servers against this name instead of the host of the address

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: pass both (or neither for plaintext gRPC)")
        if (self.ca or self.server_name) and not self.cert:
            raise ValueError("--tls-ca/--tls-server-name need --tls-cert and --tls-key (every process presents "
                             "a certificate in a mutual-TLS deployment)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path!r} is not a readable file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        """Servers require client certificates signed by ``ca``."""
        return bool(self.ca)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.ca).read_bytes() if self.ca else None
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), ca

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def describe(self) -> str:
        if not self.enabled:
            return "plaintext"
        return "mutual TLS (client certificates required)" if self.mutual else "TLS"


def open_channel(address: str, tls: TLSConfig, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: secure when ``tls`` is enabled, else plaintext."""
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS between services (default: plaintext gRPC)")
    g.add_argument("--tls-cert", default="", help="PEM certificate this process presents (server and client)")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="",
                   help="PEM CA bundle that signs the peers; servers then require client certificates (mTLS)")
    g.add_argument("--tls-server-name", default="",
                   help="verify gRPC servers against this name instead of the host of their address")


def tls_from_args(a: argparse.Namespace) -> TLSConfig:
    return TLSConfig(cert=a.tls_cert, key=a.tls_key, ca=a.tls_ca, server_name=a.tls_server_name)


def tls_argv(tls: TLSConfig) -> list[str]:
    """The flags that recreate ``tls`` (the launcher passes them to every child)."""
    out: list[str] = []
    for flag, value in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca),
                        ("--tls-server-name", tls.server_name)):
        if value:
            out += [flag, str(Path(value).resolve()) if flag != "--tls-server-name" else value]
    return out
