"""How the gRPC links router -> decode -> prefill are secured: the service token and optional (mutual) TLS.

One ``TLSConfig`` per process, from ``--tls-cert/--tls-key/--tls-ca`` and ``--service-token`` (same flags on
every service, the router and the launcher). Every process of a deployment is both a server and a client, so
the same files serve both roles:

    server side (prefill, decode): presents cert/key; with a CA, requires and verifies a client certificate
                                   signed by it (mutual TLS). Without a CA any client completes the TLS
                                   handshake, so a server refuses to start that way unless a service token
                                   authenticates its callers or ``--tls-any-client`` says it is meant
    client side (router, decode):  verifies the server against the CA (the system roots without one) and
                                   presents cert/key as its client certificate
    both:                          the service token (``svc_common/service_auth.py``) in every call's metadata

No flag: plaintext gRPC, no token (the default, for loopback deployments). Certificates are read once at
start-up, and checked then: files that do not load (a key that is not the certificate's, a CA that is not
PEM) fail the start with the reason, before any port is bound.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from svc_common.service_auth import SERVICE_TOKEN_ENV, client_interceptors, resolve_service_token


@dataclass(frozen=True)
class TLSConfig:
    """Paths of PEM files ("" = unset) and an optional name to verify servers by."""

    cert: str = ""  # this process's certificate (chain), PEM
    key: str = ""  # its private key, PEM
    ca: str = ""  # CA that signs every peer; set -> clients must present a certificate signed by it
    server_name: str = ""  # verify servers against this name instead of the host of the address
    service_token: str = field(default="", repr=False)  # sent on every call; servers require it when set
    any_client: bool = False  # a server with a certificate and no CA: accept any client (an explicit choice)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: pass both (or neither for plaintext gRPC)")
        if (self.ca or self.server_name) and not self.cert:
            raise ValueError("--tls-ca/--tls-server-name need --tls-cert and --tls-key (every process presents "
                             "a certificate in a mutual-TLS deployment)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path!r} is not a readable file")
        if self.enabled:
            self._load_context()

    def _load_context(self) -> ssl.SSLContext:
        """The files as an SSL context: a clear error now for a key that does not match, a CA that is not PEM."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--tls-cert {self.cert!r} / --tls-key {self.key!r} do not load as a PEM certificate "
                             f"and its private key ({e})") from None
        if self.ca:
            try:
                ctx.load_verify_locations(self.ca)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"--tls-ca {self.ca!r} does not load as a PEM CA bundle ({e})") from None
        return ctx

    def check_server(self) -> None:
        """A server presents a certificate but checks none without ``--tls-ca``: refuse that unless a service token
        authenticates the callers or ``--tls-any-client`` makes it an explicit choice."""
        if self.enabled and not self.mutual and not self.service_token and not self.any_client:
            raise ValueError("--tls-cert without --tls-ca accepts any client over TLS: pass --tls-ca (clients must "
                             "present a certificate signed by it), a --service-token, or --tls-any-client to accept "
                             "unauthenticated clients on purpose")

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
            link = "plaintext"
        else:
            link = "mutual TLS (client certificates required)" if self.mutual else "TLS"
        return f"{link}, service token required" if self.service_token else link


def open_channel(address: str, tls: TLSConfig, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: secure when ``tls`` is enabled, else plaintext; every call carries
    the service token when there is one."""
    interceptors = client_interceptors(tls.service_token)
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()],
                                   interceptors=interceptors)


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS between services (default: plaintext gRPC)")
    g.add_argument("--tls-cert", default="", help="PEM certificate this process presents (server and client)")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="",
                   help="PEM CA bundle that signs the peers; servers then require client certificates (mTLS)")
    g.add_argument("--tls-server-name", default="",
                   help="verify gRPC servers against this name instead of the host of their address")
    g.add_argument("--tls-any-client", action="store_true",
                   help="with --tls-cert and no --tls-ca: accept clients without a certificate on purpose (servers "
                        "refuse to start that way otherwise, unless a service token authenticates the callers)")
    g.add_argument("--service-token", default=None,
                   help=f"token every gRPC call between the services carries and every service requires (default: "
                        f"${SERVICE_TOKEN_ENV}, else the API key); prefer the variable: flags show in `ps`")


def tls_from_args(a: argparse.Namespace) -> TLSConfig:
    """The links of a process that serves gRPC (a service, or the launcher of services): ``check_server`` holds."""
    token = resolve_service_token(getattr(a, "service_token", None), getattr(a, "api_key", None))
    tls = TLSConfig(cert=a.tls_cert, key=a.tls_key, ca=a.tls_ca, server_name=a.tls_server_name,
                    service_token=token, any_client=getattr(a, "tls_any_client", False))
    tls.check_server()
    return tls


def tls_argv(tls: TLSConfig) -> list[str]:
    """The flags that recreate ``tls`` but its token (the launcher passes them to every child; the token goes
    through the environment, out of `ps`)."""
    out: list[str] = []
    for flag, value in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca),
                        ("--tls-server-name", tls.server_name)):
        if value:
            out += [flag, str(Path(value).resolve()) if flag != "--tls-server-name" else value]
    if tls.any_client:
        out.append("--tls-any-client")
    return out


def check_handshake(tls: TLSConfig, server_name: str) -> None:
    """A TLS handshake in memory between these files as server and as client, dialled as ``server_name``:
    raises ValueError with the reason (certificate not signed by the CA, not valid for the name, expired,
    client certificate refused) instead of letting every link of a deployment fail later."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tls.cert, tls.key)
    client = tls._load_context()
    if tls.ca:
        server.load_verify_locations(tls.ca)
        server.verify_mode = ssl.CERT_REQUIRED
    else:
        client.load_default_certs()
    name = tls.server_name or server_name
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_out, c_in = ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = server.wrap_bio(to_server, s_out, server_side=True)
    cli = client.wrap_bio(c_in, to_client, server_hostname=name)
    done = {"client": False, "server": False}
    for _ in range(16):
        for side, obj in (("client", cli), ("server", srv)):
            if done[side]:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except ssl.SSLError as e:
                who = "a server" if side == "client" else "a client"
                why = getattr(e, "verify_message", "") or e.reason or str(e)
                raise ValueError(f"TLS check failed: these certificates do not work as {who} dialled as {name!r} "
                                 f"({why}); check that --tls-ca signed --tls-cert and that the certificate names "
                                 f"{name!r} (or pass --tls-server-name)") from None
            to_server.write(to_client.read())
            c_in.write(s_out.read())
        if all(done.values()):  # the server judged the client certificate when it read the client's Finished
            return
    raise ValueError(f"TLS check: the handshake with {name!r} did not complete")
