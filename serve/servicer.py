"""The PredictionService servicer: protos ↔ the pure functions of serve/, nothing else.

Predict: validate (:mod:`serve.validation`; candidates as rows or as columns) → feature
generation (:func:`shared.fg_request.request_columns_to_batch`) → the batcher (lookups + dense
program of the model version current when the request arrived) → probabilities. The methods are served from raw
bytes by :func:`serve.rpc.unary_service` (parsing, admission, limits, metrics, INTERNAL with a
request id); :func:`status_of` maps this service's expected failures:

    RequestError, FeatureError  INVALID_ARGUMENT (the message starts with the field)
    deadline passed             DEADLINE_EXCEEDED (checked between stages and while waiting)
    cancelled by the client     CANCELLED
    no model loaded / closing   UNAVAILABLE

No client deadline means no deadline: the request waits for its batch however long it takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import grpc
import numpy as np

from protos import predict_pb2
from serve.admission import Admission
from serve.batcher import Batcher, BatcherClosedError, DeadlineExpiredError
from serve.freshness import event_time, model_age
from serve.limits import Limits
from serve.metrics import ServingMetrics
from serve.model import LoadedModel
from serve.rpc import Method, RpcError, check_deadline, deadline_of, unary_service
from serve.validation import (
    FgInputs,
    Fields,
    RequestError,
    feature_error,
    fields_of,
    request_inputs,
    value_type,
)
from serve.versions import Refusal
from shared.features import FeatureSet, FeatureSpec
from shared.fg import FeatureError
from shared.fg_request import request_columns_to_batch

SERVICE_NAME = predict_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name
M = TypeVar("M")


def status_of(err: BaseException) -> RpcError | None:
    """This service's expected failures as status codes (None: a bug, INTERNAL)."""
    if isinstance(err, RequestError | FeatureError):
        return RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    if isinstance(err, DeadlineExpiredError | FutureTimeout):
        return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded: {err}")
    if isinstance(err, BatcherClosedError):
        return RpcError(grpc.StatusCode.UNAVAILABLE, str(err))
    if isinstance(err, CancelledError):
        return RpcError(grpc.StatusCode.CANCELLED, "cancelled by the client")
    return None


class PredictionServicer:
    def __init__(
        self,
        current_model: Callable[[], LoadedModel | None],
        batcher: Batcher,
        limits: Limits,
        metrics: ServingMetrics,
        admission: Admission,
        last_refusal: Callable[[], Refusal | None] = lambda: None,
    ) -> None:
        self._current = current_model
        self._last_refusal = last_refusal
        self._batcher = batcher
        self._limits = limits
        self._metrics = metrics
        self._admission = admission

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def metrics(self) -> ServingMetrics:
        return self._metrics

    @property
    def admission(self) -> Admission:
        return self._admission

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, served from raw bytes (see :mod:`serve.rpc`)."""
        return unary_service(
            SERVICE_NAME,
            [
                Method("Predict", predict_pb2.PredictRequest, self.predict, self._admission),
                Method("GetModelMetadata", predict_pb2.ModelMetadataRequest, self.metadata),
            ],
            metrics=self._metrics,
            status_of=status_of,
            limits=self._limits,
        )

    def _model(self) -> LoadedModel:
        model = self._current()
        if model is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "no model loaded yet; retry when SERVING")
        return model

    def predict(
        self, request: predict_pb2.PredictRequest, context: grpc.ServicerContext
    ) -> predict_pb2.PredictResponse:
        def respond(probs: np.ndarray, model: LoadedModel) -> predict_pb2.PredictResponse:
            return predict_pb2.PredictResponse(
                probabilities=probs.tolist(),
                model_version=model.version,
                request_id=request.request_id,
            )

        limits = self._limits
        return self.score(
            lambda fs: request_inputs(request, fs, limits), fields_of(request), context, respond
        )

    def score(
        self,
        check: Callable[[FeatureSet], FgInputs],
        fields: Fields,
        context: grpc.ServicerContext,
        respond: Callable[[np.ndarray, LoadedModel], M],
    ) -> M:
        """Predict's path from the request's content to the scores, for every protocol:
        ``check(the served version's features)`` is the request's validation (raises
        :class:`RequestError`; Predict's :func:`~serve.validation.request_inputs`, the Open
        Inference Protocol's :func:`serve.oip.fg_inputs`, both over the checks of
        :mod:`serve.validation`), ``fields`` how the request names its values in errors; then
        feature generation, deadlines, batching, and ``respond(probabilities float32 [N], the
        model version that scored them)``."""
        deadline = deadline_of(context)
        model = self._model()
        t0, c0 = time.perf_counter(), time.thread_time()
        inputs = check(model.fs)
        t1, c1 = time.perf_counter(), time.thread_time()
        try:
            batch = request_columns_to_batch(model.fs, **vars(inputs))
        except FeatureError as err:
            raise feature_error(model.fs, inputs, err, fields) from err
        t2, c2 = time.perf_counter(), time.thread_time()
        check_deadline(deadline, "before batching (validation and feature generation)")
        future = self._batcher.submit(model, batch, deadline=deadline)

        def drop() -> None:  # client gone: drop it if not started
            future.cancel()

        context.add_callback(drop)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        probs = future.result(timeout=timeout)
        t3, c3 = time.perf_counter(), time.thread_time()
        response = respond(probs, model)
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

    def metadata(
        self, request: predict_pb2.ModelMetadataRequest, context: grpc.ServicerContext
    ) -> predict_pb2.ModelMetadata:
        return model_metadata(self._model(), self._limits, self._last_refusal())


def _side(spec: FeatureSpec) -> str:
    return "sequence" if spec.is_sequence else spec.side.value


def model_metadata(
    model: LoadedModel, limits: Limits, refusal: Refusal | None = None
) -> predict_pb2.ModelMetadata:
    fs = model.fs
    groups: dict[str, list[FeatureSpec]] = {}
    for f in fs.features.values():
        if f.is_sequence:
            groups.setdefault(f.sequence_name or f.name, []).append(f)
    sequences = [
        predict_pb2.SequenceInfo(
            name=name,
            features=[f.name for f in specs],
            max_length=limits.sequence_cap(specs[0].sequence_length),
            delimiter=specs[0].sequence_delim or "",
        )
        for name, specs in groups.items()
    ]
    md = predict_pb2.ModelMetadata(
        model_version=model.version,
        config_digest=model.bundle.config_digest,
        features=[
            predict_pb2.FeatureInfo(
                name=f.name,
                side=_side(f),
                kind=f.kind.value,
                table=f.table,
                value_type=value_type(f),
                max_length=limits.sequence_cap(f.sequence_length) if f.is_sequence else 0,
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
        max_sequence_length=min((s.max_length for s in sequences), default=0),
        base_version=model.base_bundle.version,
        deltas=list(model.deltas),
        limits=predict_pb2.ServingLimits(
            max_candidates=limits.max_candidates,
            max_string_bytes=limits.max_string_bytes,
            max_request_bytes=limits.max_request_bytes,
            max_message_bytes=limits.transport_bytes,
            max_detail_bytes=limits.max_detail_bytes,
            max_pending=limits.max_pending,
        ),
        sequences=sequences,
        event_time_unix=event_time(model) or 0.0,
        freshness_seconds=model_age(model) or 0.0,
    )
    if refusal is not None:
        md.last_refusal.CopyFrom(
            predict_pb2.ModelRefusal(
                version=refusal.version, reason=refusal.reason, at_unix=refusal.at_unix
            )
        )
    return md
