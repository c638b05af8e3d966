"""``inference.GRPCInferenceService`` (the Open Inference Protocol, KServe v2) beside Predict.

Thin: each RPC parses, calls one function and formats the answer. ``ModelInfer`` scores its
tensors on Predict's own path (:meth:`serve.servicer.PredictionServicer.score`), the tensors
checked and turned into feature generation's inputs by :func:`serve.oip.fg_inputs` with
Predict's validation functions (limits, messages), then feature generation, deadlines,
batching, model versions as Predict; it shares Predict's admission bound, and its RPCs are
counted under their own method names (``ModelInfer``...; the HTTP form's as ``http/...``).
Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer; the
protocol's other RPCs (streaming, repository, shared memory) answer UNIMPLEMENTED. Statuses:

    malformed tensors (name, datatype, shape, counts, values)  INVALID_ARGUMENT "<tensor>: ..."
    another model name or version                              NOT_FOUND
    no model loaded yet                                        UNAVAILABLE (ModelReady: false)
    size, admission, deadlines                                 as Predict

The same :class:`InferenceService` answers the HTTP/JSON form (:mod:`serve.oip_http`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata as _pkg
from typing import Any, Protocol

import grpc
import numpy as np

from protos import grpc_predict_v2_pb2 as v2
from serve import oip
from serve.admission import Admission
from serve.limits import Limits
from serve.metrics import ServingMetrics
from serve.rpc import Method, RpcError, unary_service
from serve.servicer import PredictionServicer, status_of
from serve.validation import TENSORS, RequestError
from shared.features import FeatureSet

SERVICE_NAME = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# the pool the protocol's descriptors live in (not the default one: tritonclient registers the
# same names there); server reflection looks the service up in it
DESCRIPTOR_POOL = v2.DESCRIPTOR.pool
DEFAULT_MODEL_NAME = "dynrec"
PLATFORM = "dynrec_multitower_din"
EXTENSIONS = ["binary_tensor_data"]  # HTTP: tensors as raw bytes after the JSON


class ServedModel(Protocol):
    """What is read of the serving model (a LoadedModel, or a frontend's FrontendModel)."""

    @property
    def version(self) -> str: ...

    @property
    def fs(self) -> FeatureSet: ...


def server_version() -> str:
    try:
        return _pkg.version("dynrec")
    except _pkg.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ModelInfo:
    """ModelMetadata's content, whichever transport formats it."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[tuple[str, str, list[int]]]
    outputs: list[tuple[str, str, list[int]]]


class InferenceService:
    """The protocol's answers over the serving model, for both transports."""

    def __init__(
        self,
        predictor: PredictionServicer,
        current: Callable[[], ServedModel | None],
        model_name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        if not model_name:
            raise ValueError("model_name must not be empty (serve --model-name)")
        self.predictor = predictor
        self._current = current
        self.model_name = model_name

    def ready(self) -> bool:
        return self._current() is not None

    def model(self, name: str, version: str = "") -> ServedModel:
        """The serving model if ``name`` (and ``version``, if given) is it; else NOT_FOUND, or
        UNAVAILABLE while none is loaded."""
        if name != self.model_name:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"model {oip.short_name(name)!r} not found; this server serves {self.model_name!r}",
            )
        model = self._current()
        if model is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "no model loaded yet; retry when ready")
        if version and version != model.version:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"model {self.model_name!r} version {oip.short_name(version)!r} not found; serving "
                f"version {model.version!r} (leave the version empty for the current one)",
            )
        return model

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.model(name, version)
        except RpcError as err:
            if err.code is grpc.StatusCode.UNAVAILABLE:
                return False
            raise
        return True

    def model_info(self, name: str, version: str = "") -> ModelInfo:
        model = self.model(name, version)
        return ModelInfo(
            self.model_name,
            [model.version],
            PLATFORM,
            oip.input_metadata(model.fs),
            oip.output_metadata(),
        )

    def infer(self, call: oip.InferCall, context: grpc.ServicerContext) -> oip.InferResult:
        """Score ``call`` on Predict's path (its tensors checked by :func:`serve.oip.fg_inputs`);
        errors name the tensor."""
        self.model(call.model_name, call.model_version)
        for name in call.outputs:
            if name != oip.OUTPUT:
                raise RequestError(
                    oip.short_name(name), f"unknown output; this model has one, {oip.OUTPUT!r}"
                )
        limits = self.predictor.limits

        def respond(probs: np.ndarray, served: Any) -> oip.InferResult:
            return oip.InferResult(
                self.model_name, served.version, call.id, probs, call.binary_output
            )

        return self.predictor.score(
            lambda fs: oip.fg_inputs(call.tensors, fs, limits), TENSORS, context, respond
        )


class InferenceServicer:
    """The gRPC form of :class:`InferenceService`."""

    def __init__(self, service: InferenceService, admission: Admission) -> None:
        self.service = service
        self._admission = admission

    def handler(self, metrics: ServingMetrics, limits: Limits) -> grpc.GenericRpcHandler:
        s = self.service

        def live(_r: v2.ServerLiveRequest, _c: Any) -> v2.ServerLiveResponse:
            return v2.ServerLiveResponse(live=True)

        def ready(_r: v2.ServerReadyRequest, _c: Any) -> v2.ServerReadyResponse:
            return v2.ServerReadyResponse(ready=s.ready())

        def model_ready(r: v2.ModelReadyRequest, _c: Any) -> v2.ModelReadyResponse:
            return v2.ModelReadyResponse(ready=s.model_ready(r.name, r.version))

        def server_metadata(_r: v2.ServerMetadataRequest, _c: Any) -> v2.ServerMetadataResponse:
            return v2.ServerMetadataResponse(
                name="dynrec", version=server_version(), extensions=EXTENSIONS
            )

        def infer(r: v2.ModelInferRequest, c: grpc.ServicerContext) -> v2.ModelInferResponse:
            return oip.grpc_response(s.infer(oip.call_of_grpc(r), c))

        methods = [
            Method("ServerLive", v2.ServerLiveRequest, live),
            Method("ServerReady", v2.ServerReadyRequest, ready),
            Method("ModelReady", v2.ModelReadyRequest, model_ready),
            Method("ServerMetadata", v2.ServerMetadataRequest, server_metadata),
            Method("ModelMetadata", v2.ModelMetadataRequest, self.model_metadata),
            Method("ModelInfer", v2.ModelInferRequest, infer, self._admission),
        ]
        return unary_service(
            SERVICE_NAME, methods, metrics=metrics, status_of=status_of, limits=limits
        )

    def model_metadata(self, r: v2.ModelMetadataRequest, _c: Any) -> v2.ModelMetadataResponse:
        info = self.service.model_info(r.name, r.version)
        tensor = v2.ModelMetadataResponse.TensorMetadata
        return v2.ModelMetadataResponse(
            name=info.name,
            versions=info.versions,
            platform=info.platform,
            inputs=[tensor(name=n, datatype=d, shape=s) for n, d, s in info.inputs],
            outputs=[tensor(name=n, datatype=d, shape=s) for n, d, s in info.outputs],
        )
