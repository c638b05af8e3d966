"""The client side of the server's admin service (``inspect --server``, ``delta-apply``).

The admin service listens on the server's admin address (``serve --admin-address``), a
``host:port`` or a ``unix:/path`` socket, never on the public port; it may want a bearer token
(``serve --admin-token-file``: give the same file as ``--token-file``) and, on a TCP address of
a server with ``--tls-cert``, TLS (``--tls-ca``: the PEM roots that signed the server's
certificate; ``--tls-cert``/``--tls-key`` too when the server asks for client certificates).
Example::

    target = AdminTarget("unix:/run/dynrec/admin.sock", token_file=Path("/etc/dynrec/token"))
    with target.channel() as channel:
        stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
        stub.InspectTables(predict_pb2.InspectRequest(), metadata=target.metadata(), timeout=10)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read it ({err.strerror})") from None


@dataclass(frozen=True)
class AdminTarget:
    """Where the admin service listens and what the client shows it (see the module doc)."""

    address: str  # host:port or unix:/path
    token_file: Path | None = None  # bearer token, as the server's --admin-token-file
    tls_ca: Path | None = None  # PEM roots: a TLS channel verifying the server
    tls_cert: Path | None = None  # PEM client certificate chain (mTLS), with tls_key
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a client certificate needs both --tls-cert and --tls-key")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ValueError("--tls-cert/--tls-key need --tls-ca (the roots of the server)")

    def channel(self) -> grpc.Channel:
        if self.tls_ca is None:
            return grpc.insecure_channel(self.address)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "TLS CA"),
            private_key=None if self.tls_key is None else _read(self.tls_key, "TLS key"),
            certificate_chain=None if self.tls_cert is None else _read(self.tls_cert, "TLS cert"),
        )
        return grpc.secure_channel(self.address, creds)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata: ``authorization: Bearer <token>`` with a token file, else none."""
        if self.token_file is None:
            return ()
        from serve.security import read_token

        return (("authorization", f"Bearer {read_token(self.token_file)}"),)
