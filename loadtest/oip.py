"""A PredictRequest as the Open Inference Protocol's tensors: the client side of ``serve.oip``.

One tensor per feature, named as the feature (user and context [1], candidates [N], each
sequence INT64 [L]); a Value's kind gives the datatype (int64 → INT64, double → FP64, string →
BYTES), and missing values travel as a BOOL ``<feature>.missing`` tensor beside the feature.
The same features give the same scores over both protocols. Example::

    tensors = tensors_of_predict(request)                 # [OipTensor(name, datatype, values)]
    msg = infer_request(request, "dynrec", raw=True)      # a ModelInferRequest (gRPC)
    stub.ModelInfer(msg)
    pool = oip_pool(predict_pool, "dynrec")               # python -m loadtest --protocol oip
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.pool import RequestPool
from protos import grpc_predict_v2_pb2 as v2
from protos import predict_pb2

MISSING = ".missing"
_DATATYPE_OF_KIND = {
    "int64_value": "INT64",
    "double_value": "FP64",
    "string_value": "BYTES",
    "int64s": "INT64",
    "doubles": "FP64",
    "strings": "BYTES",
}
_PLACEHOLDER = {"INT64": 0, "FP64": 0.0, "BYTES": ""}
_CONTENTS = {
    "INT64": "int64_contents",
    "FP64": "fp64_contents",
    "BOOL": "bool_contents",
    "BYTES": "bytes_contents",
}
_DTYPES = {"INT64": "<i8", "FP64": "<f8", "BOOL": "|b1"}


@dataclass(frozen=True)
class OipTensor:
    """A 1-D tensor: ``values`` a numpy array, or a list of bytes for BYTES."""

    name: str
    datatype: str
    values: np.ndarray | list[bytes]

    @property
    def shape(self) -> list[int]:
        return [len(self.values)]

    def as_numpy(self) -> np.ndarray:
        """For tritonclient's ``set_data_from_numpy`` (BYTES as an object array)."""
        if self.datatype == "BYTES":
            return np.array(self.values, dtype=np.object_)
        return np.asarray(self.values)

    def raw(self) -> bytes:
        """The raw little-endian bytes (BYTES: 4-byte length, then the bytes, per element)."""
        if self.datatype != "BYTES":
            return np.ascontiguousarray(self.values, _DTYPES[self.datatype]).tobytes()
        return b"".join(len(b).to_bytes(4, "little") + b for b in self.values)


def _column(
    name: str, kind: str | None, values: Sequence[object], missing: Sequence[bool]
) -> list[OipTensor]:
    datatype = _DATATYPE_OF_KIND.get(kind or "", "INT64")  # all missing, no kind: any will do
    filled = [_PLACEHOLDER[datatype] if m else v for v, m in zip(values, missing, strict=True)]
    if datatype == "BYTES":
        data: np.ndarray | list[bytes] = [str(v).encode() for v in filled]
    else:
        data = np.array(filled, _DTYPES[datatype])
    out = [OipTensor(name, datatype, data)]
    if any(missing):
        out.append(OipTensor(name + MISSING, "BOOL", np.array(missing, bool)))
    return out


def _values(features: predict_pb2.Features) -> list[OipTensor]:
    out = []
    for name, v in features.values.items():
        kind = v.WhichOneof("kind")
        out += _column(name, kind, [None if kind is None else getattr(v, kind)], [kind is None])
    return out


def _rows(candidates: Sequence[predict_pb2.Features]) -> list[OipTensor]:
    out = []
    for name in candidates[0].values:
        col = [c.values[name] for c in candidates]
        kinds = [v.WhichOneof("kind") for v in col]
        present = {k for k in kinds if k is not None}
        if len(present) > 1:  # mixed kinds (ints among doubles): the widest
            present = {"double_value"} if "double_value" in present else {"string_value"}
        kind = next(iter(present), None)
        values = [None if k is None else getattr(v, k) for v, k in zip(col, kinds, strict=True)]
        if kind == "double_value":
            values = [None if x is None else float(x) for x in values]
        elif kind == "string_value":
            values = [None if x is None else str(x) for x in values]
        out += _column(name, kind, values, [k is None for k in kinds])
    return out


def tensors_of_predict(request: predict_pb2.PredictRequest) -> list[OipTensor]:
    """The OIP inputs of ``request`` (candidates as rows or as columns)."""
    out = _values(request.user) + _values(request.context)
    for name, seq in request.sequences.items():
        out.append(OipTensor(name, "INT64", np.array(seq.ids, np.int64)))
    if request.HasField("candidate_columns"):
        for name, col in request.candidate_columns.columns.items():
            kind = col.WhichOneof("kind")
            values = list(getattr(col, kind).values) if kind else []
            n = request.candidate_columns.num_candidates
            missing = list(col.missing) or [False] * n
            out += _column(name, kind, values or [None] * n, missing)
    else:
        out += _rows(request.candidates)
    return out


def infer_request(
    request: predict_pb2.PredictRequest, model_name: str, *, raw: bool = True
) -> v2.ModelInferRequest:
    """The ModelInferRequest of ``request``: tensors in ``raw_input_contents`` (``raw``) or in
    each input's typed ``contents``."""
    msg = v2.ModelInferRequest(model_name=model_name, id=request.request_id)
    for t in tensors_of_predict(request):
        tensor = msg.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        if raw:
            msg.raw_input_contents.append(t.raw())
        else:
            values = t.values if t.datatype == "BYTES" else t.values.tolist()  # type: ignore[union-attr]
            getattr(tensor.contents, _CONTENTS[t.datatype]).extend(values)
    return msg


def oip_pool(pool: RequestPool, model_name: str) -> RequestPool:
    """``pool``'s requests (serialized PredictRequests) as the ModelInferRequests of the same
    features for model ``model_name``, tensors in ``raw_input_contents`` (as tritonclient
    sends them); the header says ``"protocol": "oip"`` and the model's name."""
    payloads = [
        infer_request(predict_pb2.PredictRequest.FromString(p), model_name).SerializeToString()
        for p in pool.payloads
    ]
    info = {**pool.info, "protocol": "oip", "model_name": model_name}
    return RequestPool(payloads, pool.num_candidates, info)
