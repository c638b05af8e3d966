"""TLS on the public port and the admin port: certificates made here with ``cryptography``.

A self-signed server certificate as the client's root → OK, a plaintext client → fails; with a
client CA (mutual TLS) a client without a certificate, or with one of another CA, is refused
and one signed by the CA gets through. Bad PEM files are errors naming the file.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import predict_pb2, predict_pb2_grpc
from serve.admin import AdminConfig
from serve.security import TlsConfig, server_credentials
from serve.server import PredictionServer, ServerConfig
from train.tools.__main__ import main

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _issue(
    out: Path,
    name: str,
    *,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    ca: bool = False,
    server: bool = False,
) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``name`` signed by ``issuer`` (None: self-signed), as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    signer_cert, signer_key = issuer if issuer is not None else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_cert.subject if signer_cert is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    pem = Pem(out / f"{name}.pem", out / f"{name}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pem, cert, key


@dataclass(frozen=True)
class Certs:
    self_signed: Pem  # server certificate, its own root
    ca: Pem
    server: Pem  # signed by ca
    client: Pem  # signed by ca
    stranger: Pem  # a client certificate of another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    out = tmp_path_factory.mktemp("certs")
    self_signed = _issue(out, "self", issuer=None, server=True)[0]
    ca, ca_cert, ca_key = _issue(out, "ca", issuer=None, ca=True)
    other = _issue(out, "other-ca", issuer=None, ca=True)
    return Certs(
        self_signed=self_signed,
        ca=ca,
        server=_issue(out, "server", issuer=(ca_cert, ca_key), server=True)[0],
        client=_issue(out, "client", issuer=(ca_cert, ca_key))[0],
        stranger=_issue(out, "stranger", issuer=(other[1], other[2]))[0],
    )


def _secure(target: str, root: Path, client: Pem | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=root.read_bytes(),
        private_key=None if client is None else client.key.read_bytes(),
        certificate_chain=None if client is None else client.cert.read_bytes(),
    )
    return grpc.secure_channel(target, creds)


def _health(channel: grpc.Channel) -> int:
    req = health_pb2.HealthCheckRequest(service="")
    return health_pb2_grpc.HealthStub(channel).Check(req, timeout=10).status


def _refused(channel: grpc.Channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as info:
        _health(channel)
    return info.value.code()


@pytest.fixture(scope="module")
def tls_server(bundle_v1: Path, certs: Certs) -> Iterator[PredictionServer]:
    tls = TlsConfig(cert=certs.self_signed.cert, key=certs.self_signed.key)
    srv = PredictionServer(ServerConfig(bundle=bundle_v1, device="cpu", tls=tls)).start()
    assert srv.wait_ready(60), srv.load_error
    yield srv
    srv.stop(grace=0)


def test_public_port_with_tls(tls_server: PredictionServer, certs: Certs) -> None:
    target = f"127.0.0.1:{tls_server.port}"
    with _secure(target, certs.self_signed.cert) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        md = predict_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
            predict_pb2.ModelMetadataRequest(), timeout=10
        )
        assert md.model_version == "1"
    assert _refused(grpc.insecure_channel(target)) == grpc.StatusCode.UNAVAILABLE
    # a client that trusts another root does not accept the server's certificate
    assert _refused(_secure(target, certs.ca.cert)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(bundle_v1: Path, certs: Certs) -> None:
    tls = TlsConfig(cert=certs.server.cert, key=certs.server.key, client_ca=certs.ca.cert)
    srv = PredictionServer(ServerConfig(bundle=bundle_v1, device="cpu", tls=tls)).start()
    try:
        assert srv.wait_ready(60), srv.load_error
        target = f"127.0.0.1:{srv.port}"
        with _secure(target, certs.ca.cert, certs.client) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert _refused(_secure(target, certs.ca.cert)) == grpc.StatusCode.UNAVAILABLE
        assert _refused(_secure(target, certs.ca.cert, certs.stranger)) in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNAUTHENTICATED,
        )
        assert _refused(grpc.insecure_channel(target)) == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace=0)


def test_admin_port_with_tls_and_token(
    bundle_v1: Path, certs: Certs, tmp_path: Path, capsys
) -> None:
    token = tmp_path / "token"
    token.write_text("tls-admin-token-0123456789\n")
    token.chmod(0o600)
    tls = TlsConfig(cert=certs.server.cert, key=certs.server.key)
    admin = AdminConfig(address="127.0.0.1:0", token_file=token)
    srv = PredictionServer(ServerConfig(bundle=bundle_v1, device="cpu", tls=tls, admin=admin))
    srv.start()
    try:
        assert srv.wait_ready(60), srv.load_error
        target = f"127.0.0.1:{srv.admin_port}"
        access = ["--server", target, "--token-file", str(token), "--json"]
        assert main(["inspect", *access, "--tls-ca", str(certs.ca.cert)]) == 0
        assert '"model_version": "1"' in capsys.readouterr().out
        assert main(["inspect", *access]) == 2  # plaintext client
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        srv.stop(grace=0)


def test_bad_pem_files_are_named(certs: Certs, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=f"TLS certificate {missing}: cannot read it"):
        server_credentials(TlsConfig(cert=missing, key=certs.server.key))
    text = tmp_path / "text.pem"
    text.write_text("hello\n")
    with pytest.raises(ValueError, match=f"TLS private key {text}: not a PEM file"):
        server_credentials(TlsConfig(cert=certs.server.cert, key=text))
    with pytest.raises(ValueError, match="do not load together"):  # another certificate's key
        server_credentials(TlsConfig(cert=certs.server.cert, key=certs.client.key))
    bad_ca = tmp_path / "bad-ca.pem"
    bad_ca.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match=f"TLS client CA {bad_ca}"):
        server_credentials(
            TlsConfig(cert=certs.server.cert, key=certs.server.key, client_ca=bad_ca)
        )
    assert server_credentials(TlsConfig(cert=certs.server.cert, key=certs.server.key))
