"""ModelAdminService: table inspection and delta updates of the serving model (thin servicer).

- ``InspectTables``: per table the live serving facts (rows, hash-table capacity and load
  factor, hits and misses since the version was loaded) and the training-side summary the bundle
  or the last delta carries (score histogram, top keys by score, admission backlog; see
  :mod:`shared.hashtable.summary`).
- ``ApplyDelta``: the server reads a delta directory from its own filesystem and replaces the
  serving model by base + delta (:mod:`serve.delta`, built off the request path by
  :meth:`serve.versions.ModelManager.replace`). Status codes: a delta for another base →
  FAILED_PRECONDITION; an unreadable or inconsistent delta → INVALID_ARGUMENT; writes switched
  off (``serve --no-admin-writes``) → PERMISSION_DENIED; no model yet → UNAVAILABLE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from protos import predict_pb2, predict_pb2_grpc
from serve.delta import DeltaError, DeltaMismatchError, build_with_delta
from serve.metrics import ServingMetrics
from serve.model import LoadedModel
from serve.versions import ModelManager
from shared.bundle import BundleError

log = logging.getLogger(__name__)

ADMIN_SERVICE_NAME = predict_pb2.DESCRIPTOR.services_by_name["ModelAdminService"].full_name
DEFAULT_TOP_K = 10


def inspect_response(model: LoadedModel, top_k: int) -> predict_pb2.InspectResponse:
    """The InspectTables answer for ``model``."""
    summaries: dict[str, Any] = model.bundle.manifest.get("extra", {}).get("table_summaries", {})
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
                    predict_pb2.ScoreBin(**b) for b in info.get("score_histogram", [])
                ],
                top_keys=[predict_pb2.KeyScore(**t) for t in info.get("top_keys", [])[:k]],
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


class NoModelError(RuntimeError):
    """No model serves yet (the first load is still running or failed)."""


def _status(err: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(err, DeltaMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(err)
    if isinstance(err, DeltaError | BundleError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, NoModelError):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    if isinstance(err, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED, str(err)
    log.error("admin RPC failed", exc_info=err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


class AdminServicer(predict_pb2_grpc.ModelAdminServiceServicer):
    def __init__(
        self,
        manager: ModelManager,
        metrics: ServingMetrics,
        *,
        allow_writes: bool = True,
        verify_checksums: bool = True,
        warmup_candidates: int = 100,
    ) -> None:
        self._manager = manager
        self._metrics = metrics
        self._allow_writes = allow_writes
        self._verify = verify_checksums
        self._warmup = warmup_candidates

    def _call(self, method: str, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        self._metrics.requests.labels(method).inc()
        start = time.perf_counter()
        try:
            return fn()
        except Exception as err:
            code, details = _status(err)
            self._metrics.errors.labels(method, code.name).inc()
            context.abort(code, details)
            raise  # not reached: abort raises
        finally:
            self._metrics.latency.labels(method).observe(time.perf_counter() - start)

    def _model(self) -> LoadedModel:
        model = self._manager.current
        if model is None:
            raise NoModelError("no model loaded yet; retry when SERVING")
        return model

    def InspectTables(
        self, request: predict_pb2.InspectRequest, context: grpc.ServicerContext
    ) -> predict_pb2.InspectResponse:
        return self._call(
            "InspectTables", context, lambda: inspect_response(self._model(), request.top_k)
        )

    def ApplyDelta(
        self, request: predict_pb2.ApplyDeltaRequest, context: grpc.ServicerContext
    ) -> predict_pb2.ApplyDeltaResponse:
        def run() -> predict_pb2.ApplyDeltaResponse:
            if not self._allow_writes:
                raise PermissionError(
                    "ApplyDelta is switched off on this server (started with --no-admin-writes)"
                )
            self._model()  # UNAVAILABLE before any model serves
            if not request.path:
                raise DeltaError("path: empty; give the delta directory as the server sees it")
            start = time.perf_counter()
            applied: list[Any] = []

            def build(current: LoadedModel) -> LoadedModel:
                model, delta = build_with_delta(
                    current,
                    request.path,
                    verify_checksums=self._verify,
                    warmup_candidates=self._warmup,
                )
                applied.append(delta)
                return model

            model = self._manager.replace(build)
            delta = applied[0]
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
                apply_seconds=time.perf_counter() - start,
            )

        return self._call("ApplyDelta", context, run)
