"""Security: mutual TLS between router, decode and prefill (certificates generated here), the API key on the
gateway, loopback-only binding by default, and no request content in the logs above debug level.

One deployment, started as a user would: ``nvfp4-serve up --api-key KEY --tls-cert --tls-key --tls-ca``.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nvfp4_serve_proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from svc_common.tls import TLSConfig, tls_argv
from tests.service_procs import Launched

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-test-4f1c9b"
MARKER = "ZQXJV-PRIVATE-7731"  # in every prompt: it must never reach a log line at info level


# -- certificates -------------------------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(path: Path, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, _ = _write(path, key, cert)
    return key, cert, cert_path


def make_leaf(path: Path, cn: str, ca_key, ca_cert) -> tuple[str, str]:
    """A certificate for localhost/127.0.0.1 usable as server and as client (every service is both)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _write(path, key, cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca = make_ca(d / "ca", "nvfp4-serve test CA")
    node_cert, node_key = make_leaf(d / "node", "nvfp4-serve node", ca_key, ca_cert)
    rogue_key, rogue_ca_cert, rogue_ca = make_ca(d / "rogue-ca", "someone else")
    rogue_cert, rogue_key_path = make_leaf(d / "rogue", "intruder", rogue_key, rogue_ca_cert)
    return {"ca": ca, "cert": node_cert, "key": node_key, "rogue_ca": rogue_ca, "rogue_cert": rogue_cert,
            "rogue_key": rogue_key_path}


# -- the deployment -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deployment(tiny_model_dir, pki):
    d = Launched("--model", tiny_model_dir, "--page-size", "4", "--api-key", API_KEY, "--log-level", "info",
                 "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"])
    yield d
    d.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


# -- TLS ----------------------------------------------------------------------------------------------------------

def test_requests_flow_over_mutual_tls_router_decode_prefill(deployment):
    with httpx.Client(base_url=deployment.url, timeout=60) as c:
        r = c.post("/v1/completions", headers=_auth(),
                   json={"model": "model", "prompt": f"{MARKER} def f(x):", "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    decode_log = "".join(line for line in deployment.lines if line.startswith("[decode-0]"))
    assert "gRPC on 127.0.0.1" in decode_log and "mutual TLS (client certificates required)" in decode_log
    assert "gRPC links to the workers: mutual TLS" in deployment.output


async def _get_load(address: str, stub_cls, credentials: grpc.ChannelCredentials | None, metadata=None):
    channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
    async with channel:
        return await stub_cls(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5, metadata=metadata)


def _creds(root: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(root), read(key), read(cert))


@pytest.mark.parametrize("role, stub_cls", [("decode-0", decode_pb2_grpc.DecodeStub),
                                            ("prefill", prefill_pb2_grpc.PrefillStub)])
def test_services_refuse_plaintext_and_clients_without_a_certificate_of_the_ca(deployment, pki, role, stub_cls):
    address = deployment.address(role)
    refused = {
        "plaintext": None,
        "TLS without a client certificate": _creds(pki["ca"], None, None),
        "client certificate of another CA": _creds(pki["ca"], pki["rogue_cert"], pki["rogue_key"]),
        "client that does not trust the server": _creds(pki["rogue_ca"], pki["cert"], pki["key"]),
    }
    for what, creds in refused.items():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(_get_load(address, stub_cls, creds))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (what, e.value)
    good = _creds(pki["ca"], pki["cert"], pki["key"])
    with pytest.raises(grpc.aio.AioRpcError) as e:  # up --api-key: the key is the service token on top of mTLS
        asyncio.run(_get_load(address, stub_cls, good))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    load = asyncio.run(_get_load(address, stub_cls, good, (("authorization", f"Bearer {API_KEY}"),)))
    assert load.role == role.partition("-")[0]


def test_tls_config_says_what_is_missing(tmp_path, pki):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TLSConfig(cert=pki["cert"])
    with pytest.raises(ValueError, match="do not load as a PEM certificate and its private key"):
        TLSConfig(cert=pki["cert"], key=pki["rogue_key"])
    with pytest.raises(ValueError, match="does not load as a PEM CA bundle"):
        TLSConfig(cert=pki["cert"], key=pki["key"], ca=pki["key"])
    with pytest.raises(ValueError, match="--tls-cert without --tls-ca accepts any client"):
        TLSConfig(cert=pki["cert"], key=pki["key"]).check_server()
    TLSConfig(cert=pki["cert"], key=pki["key"], service_token="t").check_server()  # the token authenticates
    TLSConfig(cert=pki["cert"], key=pki["key"], any_client=True).check_server()  # said on purpose
    with pytest.raises(ValueError, match="need --tls-cert and --tls-key"):
        TLSConfig(ca=pki["ca"])
    with pytest.raises(ValueError, match="is not a readable file"):
        TLSConfig(cert=str(tmp_path / "nope.pem"), key=pki["key"])
    tls = TLSConfig(cert=pki["cert"], key=pki["key"], ca=pki["ca"])
    assert tls.enabled and tls.mutual and tls.describe() == "mutual TLS (client certificates required)"
    assert TLSConfig().describe() == "plaintext" and tls_argv(TLSConfig()) == []
    assert tls_argv(tls) == ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]


@pytest.mark.parametrize("what, flags, message", [
    ("CA that did not sign the certificates", ("--tls-ca", "rogue_ca"), "TLS check failed: .*local issuer"),
    ("server checking no client", (), "--tls-cert without --tls-ca accepts any client"),
    ("key of another certificate", ("--tls-key", "rogue_key"), "do not load as a PEM certificate"),
])
def test_a_tls_misconfiguration_stops_up_at_once_with_the_reason(tiny_model_dir, pki, what, flags, message):
    argv = {"--tls-cert": pki["cert"], "--tls-key": pki["key"]}
    argv.update({flag: pki[name] for flag, name in zip(flags[::2], flags[1::2], strict=True)})
    r = subprocess.run([sys.executable, "-m", "nvfp4_serve.cli", "up", "--model", tiny_model_dir, "--device", "cpu",
                        "--port", "0", *[x for kv in argv.items() for x in kv]], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=False)  # before any child starts, not after the start-up timeout
    assert r.returncode != 0 and re.search(message, r.stderr), (what, r.stderr)
    assert "[router]" not in r.stdout and "[decode-0]" not in r.stdout


# -- API key, binding ---------------------------------------------------------------------------------------------

def test_api_key_guards_the_api_and_metrics_but_not_health(deployment):
    with httpx.Client(base_url=deployment.url, timeout=30) as c:
        body = {"model": "model", "prompt": "hi", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer sk-test-4f1c9a"}, {"Authorization": API_KEY}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 401  # it names the gRPC addresses: open only with --metrics-open
        assert c.get("/metrics", headers=_auth()).status_code == 200
        assert c.get("/v1/models", headers=_auth()).status_code == 200


def test_the_key_is_compared_in_constant_time(monkeypatch):
    from router import middleware

    seen = []
    real = middleware.hmac.compare_digest
    monkeypatch.setattr(middleware.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))

    async def app(scope, receive, send):
        raise AssertionError("must not be reached with a wrong key")

    sent = []

    async def send(message):
        sent.append(message)

    mw = middleware.ApiKeyMiddleware(app, api_key="k3y", open_paths={"/health"})
    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer k3z")]}
    asyncio.run(mw(scope, None, send))
    assert seen == [(b"k3z", b"k3y")] and sent[0]["status"] == 401


def test_every_service_binds_to_loopback_by_default_and_says_so(deployment):
    from decode_svc.config import DecodeConfig
    from nvfp4_serve.launcher import build_arg_parser
    from prefill_svc.config import PrefillConfig
    from router.config import RouterConfig

    assert PrefillConfig.host == DecodeConfig.host == RouterConfig.host == "127.0.0.1"
    assert build_arg_parser().parse_args([]).host == "127.0.0.1"
    out = deployment.output
    for role in ("prefill", "decode-0"):
        assert re.search(rf"\[{role}\] .*gRPC on 127\.0\.0\.1:\d+ .*loopback only", out), role
    assert "[router] " in out and "router binds to 127.0.0.1 only" in out


# -- logs ---------------------------------------------------------------------------------------------------------

def test_no_prompt_or_generated_text_in_the_logs_at_info_level(deployment):
    prompt = f"Remember the code {MARKER} and repeat it:"
    with httpx.Client(base_url=deployment.url, timeout=60, headers=_auth()) as c:
        r = c.post("/v1/completions", json={"model": "model", "prompt": prompt, "max_tokens": 24, "ignore_eos": True})
        generated = r.json()["choices"][0]["text"]
        chat = {"model": "model", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
        assert c.post("/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
        assert c.post("/v1/chat/completions", json={**chat, "logprobs": True}).status_code == 200
        assert c.post("/v1/chat/completions", json={**chat, "functions": [{"name": MARKER}]}).status_code == 400
        assert c.post("/v1/completions", json={"model": MARKER, "prompt": prompt}).status_code == 404
        assert c.post("/v1/completions", json={"model": "model", "prompt": prompt, "stop": [MARKER],
                                               "max_tokens": 200_000}).status_code == 400
    out = deployment.output
    assert re.search(r"\[router\] .*cmpl-\w+ completion: 1 choice\(s\), prompt_tokens=\d+ completion_tokens=24", out)
    assert MARKER not in out
    assert MARKER[5:] not in out and "Remember the code" not in out
    if len(generated.strip()) >= 12:
        assert generated not in out
