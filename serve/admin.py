"""ModelAdminService on a gRPC server of its own: table inspection and delta updates.

The admin RPCs are off unless the server is started with an admin address (``python -m serve
--admin-address ...``, :class:`AdminConfig`); they are never served on the public port. When on:

- **Where**: ``host:port`` or ``unix:/path`` (a socket of mode 0600: only the server's user
  connects). With a token file, every call needs the metadata ``authorization: Bearer <token>``
  (:class:`serve.security.BearerTokenInterceptor`, constant-time compare; UNAUTHENTICATED
  otherwise). Without one, only a Unix socket or a loopback address is accepted: an admin
  service that other hosts can reach always needs a token (and should have TLS; the server's
  ``--tls-cert``/``--tls-key`` apply to a TCP admin address as well, plaintext is logged as a
  warning there).
- **Health and reflection** on the admin server too: health (no token needed) is NOT_SERVING
  for ``""`` and ``dynrec.serving.ModelAdminService`` until :meth:`AdminServer.set_serving`
  (the server calls it when a model is loaded); reflection lists the admin service.
- ``InspectTables``: per table the live serving facts (rows, hash-table capacity and load
  factor, hits and misses since the version was loaded) and the training-side summary the bundle
  or the last delta carries (score histogram, top keys by score, admission backlog; see
  :mod:`shared.hashtable.summary`).
- ``ApplyDelta``: the request's ``path`` is a delta directory relative to the delta root
  (``--delta-root``); the server reads it there (:func:`serve.delta.resolve_delta`) and
  replaces the serving model by base + delta (:mod:`serve.delta`, built off the request path by
  :meth:`serve.versions.ModelManager.replace`): written into the live tables between batches
  where they have room, else rebuilt; which path ran is logged and counted
  (``delta_applies_total{path}``; the response has no field for it yet).

Status codes, every one deliberate: writes off (``--no-admin-writes``) or no delta root →
PERMISSION_DENIED; no model yet → UNAVAILABLE; a path that is no delta under the root (absolute,
``..``, a symlink out, nothing there, no manifest: one text for all) → INVALID_ARGUMENT; a
malformed delta (its JSON, field types, files, tensors, a dense program that does not load or
run) → INVALID_ARGUMENT naming the file and field; a delta for another base →
FAILED_PRECONDITION; a bundle whose table summaries are malformed → FAILED_PRECONDITION;
INTERNAL only for a bug (details in the log, not in the answer). Example::

    admin = AdminServer(
        AdminConfig(address="unix:/run/dynrec/admin.sock", delta_root=Path("/srv/deltas")),
        manager, metrics, tls=None, verify_checksums=True, warmup_candidates=100,
    ).start()
    admin.set_serving(True)       # once a model serves
    # python -m train.tools delta-apply --server unix:/run/dynrec/admin.sock --delta step-2000
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health

from protos import predict_pb2
from serve.delta import Applied, DeltaError, DeltaMismatchError, apply_delta, resolve_delta
from serve.health import NOT_SERVING, SERVING, add_health
from serve.limits import Limits
from serve.metrics import ServingMetrics
from serve.model import LoadedModel
from serve.reflection import enable_reflection
from serve.rpc import Method, RpcError, unary_service
from serve.security import (
    UNIX_PREFIX,
    BearerTokenInterceptor,
    TlsConfig,
    bind,
    check_address,
    is_local,
    read_token,
)
from serve.versions import ModelManager
from shared.bundle import BundleError
from shared.delta import Delta
from shared.delta_reader import check_summaries

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = predict_pb2.DESCRIPTOR.services_by_name["ModelAdminService"].full_name
DEFAULT_TOP_K = 10
ADMIN_THREADS = 4  # inspection and delta applies are rare; applies run one at a time anyway
MAX_ADMIN_RPCS = 16  # beyond this many in flight: RESOURCE_EXHAUSTED (answered by gRPC)
MAX_ADMIN_REQUEST_BYTES = 64 << 10  # a path or a top_k
ADMIN_LIMITS = Limits(max_request_bytes=MAX_ADMIN_REQUEST_BYTES)


@dataclass(frozen=True)
class AdminConfig:
    """Where ModelAdminService listens and what it may do (see the module doc)."""

    address: str = "127.0.0.1:0"  # host:port or unix:/path; its own gRPC server
    token_file: Path | None = None  # None: no token; then only a unix socket or loopback
    delta_root: Path | None = None  # ApplyDelta reads only under it; None: refused
    allow_writes: bool = True  # False: ApplyDelta refused (InspectTables still answers)

    def __post_init__(self) -> None:
        check_address(self.address)
        if self.token_file is None and not is_local(self.address):
            raise ValueError(
                f"admin address {self.address!r} can be reached from other hosts: give a bearer "
                "token (--admin-token-file), or bind the admin service to a unix:/path socket "
                "or a loopback address (127.0.0.1:PORT)"
            )


class NoModelError(RuntimeError):
    """No model serves yet (the first load is still running or failed)."""


class RefusedError(RuntimeError):
    """The server is configured not to do this (PERMISSION_DENIED)."""


class ServingStateError(RuntimeError):
    """What the server serves cannot be reported (FAILED_PRECONDITION)."""


def inspect_response(model: LoadedModel, top_k: int) -> predict_pb2.InspectResponse:
    """The InspectTables answer for ``model``."""
    try:
        raw = model.bundle.manifest.get("extra", {}).get("table_summaries", {})
        summaries: dict[str, Any] = check_summaries(raw, "extra.table_summaries")
    except (DeltaError, AttributeError) as err:
        why = str(err).removesuffix("; re-export the delta")
        raise ServingStateError(
            f"model {model.version}: the bundle manifest's {why}; re-export the bundle"
        ) from None
    k = top_k or DEFAULT_TOP_K
    tables = []
    for s in model.table_stats():
        info = summaries.get(s.name, {})
        adm = info.get("admission") or {}
        tables.append(
            predict_pb2.TableInspection(
                name=s.name,
                is_hashmap=s.is_hashmap,
                dim=s.dim,
                size=s.rows,
                capacity=s.capacity,
                load_factor=s.rows / s.capacity if s.capacity else 0.0,
                hits=s.hits,
                misses=s.misses,
                score_strategy=info.get("score_strategy", ""),
                score_histogram=[
                    predict_pb2.ScoreBin(lower=b["lower"], upper=b["upper"], count=b["count"])
                    for b in info.get("score_histogram", [])
                ],
                top_keys=[
                    predict_pb2.KeyScore(key=t["key"], score=t["score"])
                    for t in info.get("top_keys", [])[:k]
                ],
                admission_threshold=adm.get("threshold", 0),
                admission_pending=adm.get("pending", 0),
                admission_pending_by_count=adm.get("pending_by_count", {}),
            )
        )
    return predict_pb2.InspectResponse(
        model_version=model.version,
        base_version=model.base_bundle.version,
        deltas=list(model.deltas),
        tables=tables,
    )


def apply_response(
    model: LoadedModel, delta: Delta, seconds: float
) -> predict_pb2.ApplyDeltaResponse:
    """The ApplyDelta answer: the new model and the delta's per-table counts."""
    return predict_pb2.ApplyDeltaResponse(
        model_version=model.version,
        base_version=model.base_bundle.version,
        deltas=list(model.deltas),
        tables={
            n: predict_pb2.DeltaTableCounts(
                new=t.new,
                updated=t.updated,
                evicted=t.evicted,
                rows=t.changed_rows,
                is_hashmap=t.is_hashmap,
            )
            for n, t in delta.tables.items()
        },
        dense_program=delta.dense_program_path is not None,
        apply_seconds=seconds,
    )


def status_of(err: BaseException) -> RpcError | None:
    """This service's expected failures as status codes (None: a bug, INTERNAL)."""
    if isinstance(err, DeltaMismatchError | ServingStateError):
        return RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(err))
    if isinstance(err, DeltaError | BundleError):
        return RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    if isinstance(err, NoModelError):
        return RpcError(grpc.StatusCode.UNAVAILABLE, str(err))
    if isinstance(err, RefusedError):
        return RpcError(grpc.StatusCode.PERMISSION_DENIED, str(err))
    return None


class AdminServicer:
    """Thin: each RPC checks what the config allows, calls one function, formats the answer;
    served from raw bytes by :func:`serve.rpc.unary_service` (:meth:`handler`)."""

    def __init__(
        self,
        manager: ModelManager,
        metrics: ServingMetrics,
        *,
        delta_root: Path | None = None,
        allow_writes: bool = True,
        verify_checksums: bool = True,
        warmup_candidates: int = 100,
    ) -> None:
        self._manager = manager
        self._metrics = metrics
        self._root = delta_root
        self._allow_writes = allow_writes
        self._verify = verify_checksums
        self._warmup = warmup_candidates

    def handler(self) -> grpc.GenericRpcHandler:
        return unary_service(
            ADMIN_SERVICE_NAME,
            [
                Method("InspectTables", predict_pb2.InspectRequest, self.inspect_tables),
                Method("ApplyDelta", predict_pb2.ApplyDeltaRequest, self.apply_delta),
            ],
            metrics=self._metrics,
            status_of=status_of,
            limits=ADMIN_LIMITS,
        )

    def _model(self) -> LoadedModel:
        model = self._manager.current
        if model is None:
            raise NoModelError("no model loaded yet; retry when SERVING")
        return model

    def inspect_tables(
        self, request: predict_pb2.InspectRequest, context: grpc.ServicerContext
    ) -> predict_pb2.InspectResponse:
        return inspect_response(self._model(), request.top_k)

    def apply_delta(
        self, request: predict_pb2.ApplyDeltaRequest, context: grpc.ServicerContext
    ) -> predict_pb2.ApplyDeltaResponse:
        if not self._allow_writes:
            raise RefusedError("ApplyDelta is switched off on this server (--no-admin-writes)")
        if self._root is None:
            raise RefusedError(
                "ApplyDelta needs a delta root: start the server with --delta-root DIR"
            )
        self._model()  # UNAVAILABLE before any model serves
        path = resolve_delta(self._root, request.path)
        start = time.perf_counter()
        applied: list[Applied] = []

        def build(current: LoadedModel) -> LoadedModel:
            result = apply_delta(
                current,
                path,
                verify_checksums=self._verify,
                warmup_candidates=self._warmup,
                label=f"delta {request.path!r}",
            )
            applied.append(result)
            return result.model

        model = self._manager.replace(build)
        self._metrics.on_delta(applied[0].path.value)
        return apply_response(model, applied[0].delta, time.perf_counter() - start)


class AdminServer:
    """ModelAdminService + health + reflection on a gRPC server of its own (module doc).

    ``start()`` reads the token file and checks the delta root and TLS files (ValueError naming
    the file), binds (OSError naming the address) and starts; health stays NOT_SERVING until
    ``set_serving(True)``, which may be called before ``start()``.
    """

    def __init__(
        self,
        config: AdminConfig,
        manager: ModelManager,
        metrics: ServingMetrics,
        *,
        tls: TlsConfig | None,
        verify_checksums: bool,
        warmup_candidates: int,
    ) -> None:
        self.config = config
        self.port = 0  # after start(): the TCP port bound, 0 for a unix socket
        self.health = health.HealthServicer()
        self._manager = manager
        self._metrics = metrics
        self._tls = tls
        self._verify = verify_checksums
        self._warmup = warmup_candidates
        self._grpc: grpc.Server | None = None
        self.set_serving(False)

    @property
    def target(self) -> str:
        """The address clients dial (``host:port`` with the port bound, or ``unix:/path``)."""
        address = self.config.address
        if address.startswith(UNIX_PREFIX):
            return address
        return f"{address.rpartition(':')[0]}:{self.port}"

    def _delta_root(self) -> Path | None:
        root = self.config.delta_root
        if root is None:
            return None
        if not root.is_dir():
            raise ValueError(f"admin delta root {root}: not a directory; create it or fix the path")
        return root.resolve()

    def _denied(self, method: str) -> None:
        self._metrics.requests.labels(method).inc()
        self._metrics.errors.labels(method, grpc.StatusCode.UNAUTHENTICATED.name).inc()

    def start(self) -> AdminServer:
        cfg = self.config
        interceptors: list[grpc.ServerInterceptor] = []
        if cfg.token_file is not None:
            token = read_token(cfg.token_file)
            interceptors.append(BearerTokenInterceptor(token, on_denied=self._denied))
        servicer = AdminServicer(
            self._manager,
            self._metrics,
            delta_root=self._delta_root(),
            allow_writes=cfg.allow_writes,
            verify_checksums=self._verify,
            warmup_candidates=self._warmup,
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(ADMIN_THREADS, thread_name_prefix="admin"),
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),  # a port already taken (the public one) is an error
                ("grpc.max_receive_message_length", ADMIN_LIMITS.transport_bytes),
            ],
            maximum_concurrent_rpcs=MAX_ADMIN_RPCS,
        )
        server.add_generic_rpc_handlers((servicer.handler(),))
        add_health(server, self.health)
        enable_reflection(server, (ADMIN_SERVICE_NAME, health.SERVICE_NAME))
        unix = cfg.address.startswith(UNIX_PREFIX)
        self.port = bind(server, cfg.address, self._tls)
        server.start()
        self._grpc = server
        if self._tls is None and not unix and not is_local(cfg.address):
            log.warning(
                "admin service on %s without TLS: its bearer token crosses the network in "
                "plaintext; give --tls-cert/--tls-key or bind it to a unix socket",
                self.target,
            )
        log.info(
            "admin service on %s (token: %s, TLS: %s, delta root: %s, writes: %s)",
            self.target,
            "yes" if cfg.token_file else "no",
            "yes" if self._tls is not None and not unix else "no",
            cfg.delta_root,
            cfg.allow_writes,
        )
        return self

    def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", ADMIN_SERVICE_NAME):
            self.health.set(name, status)

    def stop(self, grace: float | None = 1.0) -> None:
        self.set_serving(False)
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
            self._grpc = None
