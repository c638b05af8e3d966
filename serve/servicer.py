"""The PredictionService servicer: protos ↔ the pure functions of serve/, nothing else.

Predict: validate (:mod:`serve.validation`; candidates as rows or as columns) → feature generation
(:func:`shared.fg.request_columns_to_batch`) → the batcher (lookups + dense program of the model
version current when the request arrived) → probabilities. Every failure becomes a status code,
never a crash:

    RequestError, FeatureError  INVALID_ARGUMENT (the message starts with the field)
    QueueFullError              RESOURCE_EXHAUSTED
    deadline passed             DEADLINE_EXCEEDED
    no model loaded / closing   UNAVAILABLE
    anything else               INTERNAL (logged with its traceback)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from protos import predict_pb2, predict_pb2_grpc
from serve.batcher import Batcher, BatcherClosedError, DeadlineExpiredError, QueueFullError
from serve.metrics import ServingMetrics
from serve.model import LoadedModel
from serve.validation import Limits, RequestError, request_field, request_inputs, value_type
from shared.fg import FeatureError, request_columns_to_batch

log = logging.getLogger(__name__)

SERVICE_NAME = predict_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name


class RpcError(Exception):
    """An expected failure with its status code (aborts the RPC with ``code`` and ``details``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _status(err: BaseException) -> RpcError:
    if isinstance(err, RpcError):
        return err
    if isinstance(err, RequestError | FeatureError):
        return RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    if isinstance(err, QueueFullError):
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
    if isinstance(err, DeadlineExpiredError | FutureTimeout):
        return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded: {err}")
    if isinstance(err, BatcherClosedError):
        return RpcError(grpc.StatusCode.UNAVAILABLE, str(err))
    if isinstance(err, CancelledError):
        return RpcError(grpc.StatusCode.CANCELLED, "cancelled by the client")
    log.error("internal error", exc_info=err)
    return RpcError(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")


class PredictionServicer(predict_pb2_grpc.PredictionServiceServicer):
    def __init__(
        self,
        current_model: Callable[[], LoadedModel | None],
        batcher: Batcher,
        limits: Limits,
        metrics: ServingMetrics,
    ) -> None:
        self._current = current_model
        self._batcher = batcher
        self._limits = limits
        self._metrics = metrics

    def _model(self) -> LoadedModel:
        model = self._current()
        if model is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "no model loaded yet; retry when SERVING")
        return model

    def _call(self, method: str, context: grpc.ServicerContext, fn: Callable[[], object]) -> object:
        """Run ``fn`` with metrics; expected failures abort the RPC with their status code."""
        self._metrics.requests.labels(method).inc()
        start = time.perf_counter()
        try:
            return fn()
        except Exception as err:
            status = _status(err)
            self._metrics.errors.labels(method, status.code.name).inc()
            context.abort(status.code, status.details)
            raise  # not reached: abort raises
        finally:
            self._metrics.latency.labels(method).observe(time.perf_counter() - start)

    def Predict(
        self, request: predict_pb2.PredictRequest, context: grpc.ServicerContext
    ) -> predict_pb2.PredictResponse:
        def run() -> predict_pb2.PredictResponse:
            model = self._model()
            t0, c0 = time.perf_counter(), time.thread_time()
            inputs = request_inputs(request, model.fs, self._limits)
            t1, c1 = time.perf_counter(), time.thread_time()
            try:
                batch = request_columns_to_batch(model.fs, **vars(inputs))
            except FeatureError as err:
                columnar = request.HasField("candidate_columns")
                field = request_field(model.fs, err.field, columnar=columnar)
                raise RequestError(field, err.message) from err
            t2, c2 = time.perf_counter(), time.thread_time()
            remaining = context.time_remaining()  # None without a client deadline
            deadline = None if remaining is None else time.monotonic() + remaining
            future = self._batcher.submit(model, batch, deadline=deadline)
            context.add_callback(future.cancel)  # client gone: drop it if not started
            probs = future.result(timeout=remaining)
            t3, c3 = time.perf_counter(), time.thread_time()
            response = predict_pb2.PredictResponse(
                probabilities=probs.tolist(),
                model_version=model.version,
                request_id=request.request_id,
            )
            t4, c4 = time.perf_counter(), time.thread_time()
            self._metrics.on_request(
                {
                    "validate": (t1 - t0, c1 - c0),
                    "fg": (t2 - t1, c2 - c1),
                    "wait": (t3 - t2, None),
                    "respond": (t4 - t3, c4 - c3),
                }
            )
            return response

        return self._call("Predict", context, run)  # type: ignore[return-value]

    def GetModelMetadata(
        self, request: predict_pb2.ModelMetadataRequest, context: grpc.ServicerContext
    ) -> predict_pb2.ModelMetadata:
        return self._call(  # type: ignore[return-value]
            "GetModelMetadata", context, lambda: model_metadata(self._model(), self._limits)
        )


def model_metadata(model: LoadedModel, limits: Limits) -> predict_pb2.ModelMetadata:
    fs = model.fs
    return predict_pb2.ModelMetadata(
        model_version=model.version,
        config_digest=model.bundle.config_digest,
        features=[
            predict_pb2.FeatureInfo(
                name=f.name,
                side=f.side.value,
                kind=f.kind.value,
                table=f.table,
                value_type=value_type(f),
            )
            for f in fs.features.values()
        ],
        tables=[
            predict_pb2.TableInfo(
                name=s.name,
                is_hashmap=s.is_hashmap,
                dim=s.dim,
                rows=s.rows,
                capacity=s.capacity,
                load_factor=s.rows / s.capacity if s.capacity else 0.0,
            )
            for s in model.table_stats()
        ],
        loaded_at_unix=model.loaded_at,
        startup_seconds=model.startup.as_dict(),
        device=str(model.device),
        max_candidates=limits.max_candidates,
        max_sequence_length=limits.max_sequence_length,
        base_version=model.base_bundle.version,
        deltas=list(model.deltas),
    )
