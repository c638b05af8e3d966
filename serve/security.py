"""Transport security of the serving ports: TLS credentials, bearer tokens, binding.

- :class:`TlsConfig` + :func:`server_credentials`: TLS from PEM files, with an optional client CA
  that makes it mutual TLS (every client must present a certificate signed by that CA). The
  files are checked with :mod:`ssl` first (a PEM that does not parse, a key that does not match
  its certificate), so a bad file is an error naming it, not gRPC's "Failed to bind".
- :func:`read_token` + :class:`BearerTokenInterceptor`: a shared secret sent by clients as the
  call metadata ``authorization: Bearer <token>``, compared in constant time
  (:func:`hmac.compare_digest`); a call without it or with another token is UNAUTHENTICATED
  before any handler runs. The health service is exempt (probes carry no secret and it only
  says SERVING / NOT_SERVING); reflection is not.
- :func:`bind`: ``host:port`` (TLS when configured) or ``unix:/path`` (a Unix socket, made
  ``0600``: only the server's user, and root, can connect; put it in a directory of its own).
- :func:`is_local`: whether an address is reachable only from this host (a Unix socket or a
  loopback address): what the admin service accepts without a token (:mod:`serve.admin`).

Example::

    tls = TlsConfig(cert=Path("tls/server.pem"), key=Path("tls/server.key"))
    server = grpc.server(pool, interceptors=[BearerTokenInterceptor(read_token(Path("tok")))])
    port = bind(server, "0.0.0.0:8501", tls)
    # client: grpc.secure_channel(target, grpc.ssl_channel_credentials(ca_pem)) and
    #         metadata=(("authorization", "Bearer " + token),) on each call
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
MIN_TOKEN_CHARS = 16
UNIX_PREFIX = "unix:"


@dataclass(frozen=True)
class TlsConfig:
    """PEM files of a TLS server; ``client_ca`` set: require and verify client certificates."""

    cert: Path  # PEM certificate chain, the server's certificate first
    key: Path  # PEM private key of that certificate (unencrypted)
    client_ca: Path | None = None  # PEM CA bundle: mutual TLS


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read it ({err.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def _no_password() -> bytes:
    raise ValueError("encrypted")


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """gRPC server credentials of ``tls``; ValueError naming the file that is missing, not
    PEM, or does not fit (a key of another certificate, an encrypted key, a bad CA bundle)."""
    cert = _read_pem(tls.cert, "TLS certificate")
    key = _read_pem(tls.key, "TLS private key")
    try:
        ssl.create_default_context().load_cert_chain(tls.cert, tls.key, password=_no_password)
    except (ssl.SSLError, ValueError) as err:
        raise ValueError(
            f"TLS certificate {tls.cert} / private key {tls.key}: do not load together ({err}); "
            "give the PEM certificate chain and its unencrypted private key"
        ) from None
    ca = None
    if tls.client_ca is not None:
        ca = _read_pem(tls.client_ca, "TLS client CA")
        try:
            ssl.create_default_context().load_verify_locations(cafile=tls.client_ca)
        except ssl.SSLError as err:
            raise ValueError(
                f"TLS client CA {tls.client_ca}: not a PEM certificate bundle ({err})"
            ) from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (one line; surrounding whitespace stripped).

    ValueError naming the file if it cannot be read, is empty, holds whitespace or non-ASCII
    inside the token, or a token shorter than 16 characters (too easy to guess). A file that
    other users can read is accepted with a warning (``chmod 600`` it).
    """
    try:
        token = path.read_text(encoding="ascii").strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not ASCII"
        raise ValueError(f"token file {path}: cannot read it ({why})") from None
    if not token:
        raise ValueError(f"token file {path}: empty; write one token (e.g. `openssl rand -hex 32`)")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"token file {path}: one token without spaces or control characters")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"token file {path}: {len(token)} characters, at least {MIN_TOKEN_CHARS} needed "
            "(e.g. `openssl rand -hex 32`)"
        )
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("token file %s is readable by other users; chmod 600 it", path)
    return token


DENIED = (
    "missing or wrong bearer token: send the call metadata 'authorization: Bearer <token>' "
    "with the token of the server's --admin-token-file (train.tools: --token-file)"
)


def _deny_unary(_request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _deny_stream(_requests: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED for every call without ``authorization: Bearer <token>`` (the scheme is
    case-insensitive), except to ``exempt_services``; ``on_denied(method)`` counts refusals."""

    def __init__(
        self,
        token: str,
        *,
        exempt_services: Collection[str] = (HEALTH_SERVICE,),
        on_denied: Callable[[str], None] | None = None,
    ) -> None:
        if not token:
            raise ValueError("BearerTokenInterceptor: empty token")
        self._token = token.encode()
        self._exempt = tuple(f"/{s}/" for s in exempt_services)
        self._on_denied = on_denied

    def _authorized(self, metadata: Any) -> bool:
        ok = False
        for key, value in metadata or ():
            if key != "authorization" or not isinstance(value, str):
                continue
            scheme, _, presented = value.partition(" ")
            # compare every value (no early exit): the time does not depend on the token
            match = hmac.compare_digest(presented.encode(), self._token)
            ok |= scheme.lower() == "bearer" and match
        return ok

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(self._exempt):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        if self._on_denied is not None:
            self._on_denied(method.rsplit("/", 1)[-1])
        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny_stream, **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny_stream, **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny_unary, **kw)
        return grpc.unary_unary_rpc_method_handler(_deny_unary, **kw)


def check_address(address: str) -> None:
    """ValueError unless ``address`` is ``host:port`` (``[v6]:port``) or ``unix:/path``."""
    if address.startswith("unix-abstract:"):
        raise ValueError(
            f"address {address!r}: abstract Unix sockets have no file permissions (any local "
            "user could connect); use unix:/path in a directory of the server's user"
        )
    if address.startswith(UNIX_PREFIX):
        if not address[len(UNIX_PREFIX) :].lstrip("/"):
            raise ValueError(f"address {address!r}: give the socket path, e.g. unix:/run/x.sock")
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"address {address!r}: expected HOST:PORT (e.g. 127.0.0.1:8501, [::1]:8501; port 0: "
            "any free port) or unix:/path/to.sock"
        )


def is_local(address: str) -> bool:
    """True for a Unix socket or a loopback host (``localhost``, 127.0.0.0/8, ``::1``)."""
    if address.startswith(UNIX_PREFIX):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind(server: grpc.Server, address: str, tls: TlsConfig | None) -> int:
    """Add ``address`` to ``server`` (secure with ``tls``); the port bound, 0 for a Unix socket.

    A Unix socket is plaintext whatever ``tls`` says (it never leaves the host; its file mode
    0600 is the access control). ValueError for a malformed address or TLS file, OSError naming
    the address when it cannot be bound (in use, no such directory, no permission).
    """
    check_address(address)
    unix = address.startswith(UNIX_PREFIX)
    creds = None if tls is None or unix else server_credentials(tls)
    try:
        if creds is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, creds)
    except RuntimeError:
        port = 0
        if unix:
            raise OSError(
                f"cannot bind {address}: does its directory exist and is it writable, or is a "
                "file (not a socket) in the way?"
            ) from None
    if unix:
        path = address[len(UNIX_PREFIX) :]
        path = path[2:] if path.startswith("//") else path  # unix:///abs → /abs
        os.chmod(path, 0o600)
        return 0
    if port == 0:
        raise OSError(f"cannot bind {address}: is the port in use or the host not this machine's?")
    return port


__all__ = [
    "BearerTokenInterceptor",
    "TlsConfig",
    "bind",
    "check_address",
    "is_local",
    "read_token",
    "server_credentials",
]
