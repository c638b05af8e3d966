"""The Open Inference Protocol's tensors ↔ Predict's request: the one translation both OIP
transports (gRPC :mod:`serve.oip_servicer`, HTTP/JSON :mod:`serve.oip_http`) go through.

The contract (``ModelMetadata`` lists it; one request = one user with N candidates, as Predict):

    tensor                                   datatype                      shape
    user and context features (user_id, pid)  INT64 or BYTES (as accepted)  [1]
    candidate features (adgroup_id, price)    INT64, FP64/FP32 or BYTES     [N]
    each sequence (click_50_seq__brand)       INT64 ids, oldest first       [L]
    <feature>.missing (optional)              BOOL, the feature's shape     true = missing value
    output probabilities                      FP32                          [N]

A feature takes the datatypes of the Value kinds Predict takes for it
(:func:`serve.validation.accepted_kinds`: int64 → INT64, double → FP64 or FP32, string → BYTES);
metadata names the first. Missing values mirror Predict's ``candidate_columns``: every feature
tensor is required (an absent one is an error, as an absent feature is in Predict: a typo must not
pass as "missing"), and an optional BOOL tensor ``<feature>.missing`` of the same shape marks the
elements that are missing (their placeholders are ignored). v2 tensors have no null, and no
sentinel value is free: any int64 is an id of a dynamic table, and "" is a string id.

:func:`fg_inputs` turns the tensors straight into the inputs of feature generation: it checks
what only this protocol has (names, datatypes, shapes, element counts, masks, UTF-8), and the
values with the functions of Predict's own validation (:mod:`serve.validation`), so the limits
and messages are Predict's; then Predict's path runs unchanged (feature generation, deadlines,
batching, versions: :meth:`serve.servicer.PredictionServicer.score`), so the same features give
the same scores. No PredictRequest is built on the way, and nothing is parsed twice. Errors are
:class:`~serve.validation.RequestError` named by tensor (``price: ...``, ``price: ... (candidate
3)``, ``request:`` for the request as a whole).

gRPC answers ``probabilities`` as its request came: in ``raw_output_contents`` for a request
in ``raw_input_contents`` (what tritonclient sends and reads), in typed ``contents`` for a
request in typed contents (KServe's model server does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from protos import grpc_predict_v2_pb2 as v2
from serve.limits import Limits
from serve.validation import (
    TENSORS,
    FgInputs,
    RequestError,
    accepted_kinds,
    check_candidate_count,
    item_column,
    scalar_value,
    sequence_ids,
)
from shared.features import FeatureSet, FeatureSpec, Side
from shared.fg_plan import per_feature_set

OUTPUT = "probabilities"
MISSING = ".missing"  # suffix of a feature's optional BOOL missing-value mask
# numeric datatypes: their little-endian dtype on the wire
DTYPES = {"INT64": "<i8", "FP64": "<f8", "FP32": "<f4", "BOOL": "|b1"}
DATATYPES = (*DTYPES, "BYTES")
_ITEMSIZE = {d: np.dtype(t).itemsize for d, t in DTYPES.items()}
# the datatypes standing for each Value kind of Predict
_DATATYPES_OF_KIND = {
    "int64_value": ("INT64",),
    "double_value": ("FP64", "FP32"),
    "string_value": ("BYTES",),
}
_KIND_OF_DATATYPE = {d: k for k, ds in _DATATYPES_OF_KIND.items() for d in ds}
_MAX_RANK = 8


@dataclass(slots=True)  # one per input of every request: not frozen, its __init__ is cheaper
class Tensor:
    """An input as sent: ``values`` is a numpy array for numbers and BOOL, a list of bytes for
    BYTES (as many as the shape holds, checked by :func:`decode_raw` / :func:`decode_list`)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: np.ndarray | list[bytes]


@dataclass(frozen=True)
class InferCall:
    """One inference request of either transport."""

    model_name: str
    model_version: str
    id: str
    tensors: list[Tensor]
    outputs: list[str] = field(default_factory=list)  # requested ([]: all)
    binary_output: bool = False  # answer the outputs as raw bytes (gRPC raw, HTTP binary)


@dataclass(frozen=True)
class InferResult:
    model_name: str
    model_version: str
    id: str
    probabilities: np.ndarray  # float32 [N]
    binary_output: bool = False


# --------------------------------------------------------------------------- contract


@dataclass(frozen=True)
class _Contract:
    """Every input of a FeatureSet by name: the feature, where its tensor goes, its datatypes."""

    features: dict[str, FeatureSpec]
    datatypes: dict[str, tuple[str, ...]]
    sequences: dict[str, FeatureSpec]

    @classmethod
    def of(cls, fs: FeatureSet) -> _Contract:
        features = dict(fs.features)
        datatypes: dict[str, tuple[str, ...]] = {}
        for name, spec in features.items():
            if spec.is_sequence:
                datatypes[name] = ("INT64",)
            else:
                kinds = accepted_kinds(spec)
                datatypes[name] = tuple(d for k in kinds for d in _DATATYPES_OF_KIND[k])
        sequences = {name: spec for name, spec in features.items() if spec.is_sequence}
        return cls(features, datatypes, sequences)


_contract = per_feature_set(_Contract.of)


def _where(spec: FeatureSpec) -> str:
    return "sequence" if spec.is_sequence else spec.side.value


def input_metadata(fs: FeatureSet) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of every input, in feature order: user and context [1],
    candidates and sequences [-1]."""
    c = _contract(fs)
    out = []
    for name, spec in c.features.items():
        one = not spec.is_sequence and spec.side is not Side.ITEM
        out.append((name, c.datatypes[name][0], [1] if one else [-1]))
    return out


def output_metadata() -> list[tuple[str, str, list[int]]]:
    return [(OUTPUT, "FP32", [-1])]


# --------------------------------------------------------------------------- tensor contents


def element_count(name: str, shape: Sequence[int]) -> int:
    """The elements of ``shape`` (dims >= 0, rank within reason)."""
    if len(shape) == 1 and shape[0] >= 0:  # the common case
        return shape[0]
    if len(shape) > _MAX_RANK:
        raise RequestError(name, f"shape of rank {len(shape)}; inputs are 1-D ([1] or [N])")
    count = 1
    for d in shape:
        if d < 0:
            raise RequestError(name, f"shape {list(shape)} has a negative dimension")
        count *= d
    return count


def _check_datatype(name: str, datatype: str) -> None:
    if datatype not in DATATYPES:
        raise RequestError(
            name, f"datatype {datatype[:32]!r} not supported; send one of {list(DATATYPES)}"
        )


def decode_raw(name: str, datatype: str, shape: Sequence[int], raw: bytes) -> Tensor:
    """A tensor from its raw little-endian bytes (BYTES: each element a 4-byte little-endian
    length, then that many bytes), as gRPC's ``raw_input_contents`` and HTTP's binary extension
    carry it."""
    _check_datatype(name, datatype)
    shape = tuple(shape)
    n = element_count(name, shape)
    if datatype == "BYTES":
        return Tensor(name, datatype, shape, _split_bytes(name, n, raw))
    size = _ITEMSIZE[datatype]
    if len(raw) != n * size:
        raise RequestError(
            name,
            f"{len(raw)} raw bytes, expected {n * size} ({n} {datatype} of shape {list(shape)})",
        )
    if datatype == "BOOL" and len(raw) and max(raw) > 1:
        raise RequestError(name, "BOOL bytes must be 0 or 1")
    values = np.frombuffer(raw, DTYPES[datatype]).copy()  # writable, as a parsed message's
    return Tensor(name, datatype, shape, values)


def _split_bytes(name: str, n: int, raw: bytes) -> list[bytes]:
    if 4 * n > len(raw):
        raise RequestError(name, f"{len(raw)} raw bytes cannot hold {n} BYTES elements")
    out, pos, view = [], 0, memoryview(raw)
    for i in range(n):
        if pos + 4 > len(raw):
            raise RequestError(name, f"raw BYTES end inside the length of element {i}")
        size = int.from_bytes(view[pos : pos + 4], "little")
        pos += 4
        if pos + size > len(raw):
            raise RequestError(name, f"raw BYTES element {i} of {size} bytes runs past the end")
        out.append(bytes(view[pos : pos + size]))
        pos += size
    if pos != len(raw):
        raise RequestError(name, f"{len(raw) - pos} raw bytes after the {n} BYTES elements")
    return out


def decode_list(name: str, datatype: str, shape: Sequence[int], values: Sequence[object]) -> Tensor:
    """A tensor from a flat list of its values (gRPC's typed ``contents``, HTTP JSON's
    ``data``): numbers of the datatype's kind, bytes for BYTES."""
    _check_datatype(name, datatype)
    n = element_count(name, shape)
    if len(values) != n:
        raise RequestError(name, f"{len(values)} values, expected {n} (shape {list(shape)})")
    if datatype == "BYTES":
        if not all(isinstance(v, bytes) for v in values):
            raise RequestError(name, "BYTES data must be strings")
        return Tensor(name, datatype, tuple(shape), list(values))  # type: ignore[arg-type]
    want = bool if datatype == "BOOL" else int if datatype == "INT64" else (int, float)
    if not all(
        isinstance(v, want) and (datatype == "BOOL" or not isinstance(v, bool)) for v in values
    ):
        raise RequestError(name, f"{datatype} data must be {_kind_word(datatype)}")
    try:
        arr = np.array(values, dtype=DTYPES[datatype])
    except OverflowError:
        raise RequestError(name, "an INT64 value out of the int64 range") from None
    return Tensor(name, datatype, tuple(shape), arr)


def _kind_word(datatype: str) -> str:
    return {"BOOL": "true/false", "INT64": "integers"}.get(datatype, "numbers")


# --------------------------------------------------------------------------- → feature generation


def fg_inputs(tensors: Sequence[Tensor], fs: FeatureSet, limits: Limits) -> FgInputs:
    """The inputs of feature generation that ``tensors`` stand for, checked; raises
    :class:`RequestError` naming the tensor.

    What only this protocol has is checked here: names (every feature's tensor present, each
    once, nothing unknown), datatypes, shapes, masks, UTF-8. The values are then checked by the
    functions Predict's validation uses (:mod:`serve.validation`: :func:`check_candidate_count`,
    :func:`item_column`, :func:`scalar_value`, :func:`sequence_ids`), straight from the tensors'
    arrays: the same limits and messages, no PredictRequest in between.
    """
    c = _contract(fs)
    by_name = _by_name(tensors, c)
    masks = {
        name[: -len(MISSING)]: by_name.pop(name) for name in list(by_name) if name.endswith(MISSING)
    }
    for feature in c.features:
        if feature not in by_name:
            dtype = c.datatypes[feature][0]
            raise RequestError(
                feature,
                f"missing input; send it ({dtype}; ModelMetadata lists every input), with "
                f"{feature}{MISSING} (BOOL) marking missing values",
            )
    user: dict[str, object] = {}
    context: dict[str, object] = {}
    items: dict[str, list[object] | pa.Array | np.ndarray] = {}
    sequences: dict[str, list[int] | np.ndarray] = {}
    n_from: str | None = None
    n = 0
    for name, spec in c.features.items():
        t = by_name[name]
        if t.datatype not in c.datatypes[name]:
            raise RequestError(
                name,
                f"datatype {t.datatype} not accepted; send {' or '.join(c.datatypes[name])} "
                "(see ModelMetadata)",
            )
        if len(t.shape) != 1:
            raise RequestError(name, f"shape {list(t.shape)}; expected {_shape_word(spec)}")
        missing = _mask(masks.get(name), t)
        kind = _KIND_OF_DATATYPE[t.datatype]
        if spec.is_sequence:
            sequences[name] = t.values  # type: ignore[assignment]  # INT64: an int64 array
        elif spec.side is Side.ITEM:
            if n_from is None:
                n_from, n = name, t.shape[0]
                check_candidate_count(name, n, limits)
            elif t.shape[0] != n:
                raise RequestError(
                    name, f"shape [{t.shape[0]}], but {n_from} has [{n}]: one per candidate"
                )
            items[name] = item_column(spec, kind, _column(t, missing), missing, name, limits)
        else:
            if t.shape != (1,):
                raise RequestError(
                    name, f"shape {list(t.shape)}; expected [1] (one {spec.side.value} value)"
                )
            side = user if spec.side is Side.USER else context
            side[name] = None if missing is not None else scalar_value(
                spec, kind, _scalar(t), name, limits
            )  # fmt: skip
    sequences = sequence_ids(sequences, c.sequences, TENSORS, limits)
    return FgInputs(user, sequences, context, items, n)


def _shape_word(spec: FeatureSpec) -> str:
    if spec.is_sequence:
        return "[L] (the click ids, oldest first)"
    return "[N] (one per candidate)" if spec.side is Side.ITEM else "[1]"


def _by_name(tensors: Sequence[Tensor], c: _Contract) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for t in tensors:
        name = t.name
        base = name[: -len(MISSING)] if name.endswith(MISSING) else name
        spec = c.features.get(base)
        if spec is None or (base != name and spec.is_sequence):
            raise RequestError(
                short_name(name),
                f"unknown input; expected one of {sorted(c.features)} (see ModelMetadata)",
            )
        if name in out:
            raise RequestError(name, "sent twice; send each input once")
        out[name] = t
    return out


def short_name(name: str) -> str:
    """A client-chosen name, cut short for echoing."""
    return name if len(name) <= 64 else f"{name[:48]}...({len(name)} chars)"


def _mask(mask: Tensor | None, t: Tensor) -> np.ndarray | None:
    if mask is None:
        return None
    if mask.datatype != "BOOL":
        raise RequestError(mask.name, f"datatype {mask.datatype}; a missing-value mask is BOOL")
    if mask.shape != t.shape:
        raise RequestError(
            mask.name, f"shape {list(mask.shape)}, expected {t.name}'s {list(t.shape)}"
        )
    m = np.asarray(mask.values, dtype=bool)
    return m if m.any() else None


def _strings(t: Tensor, missing: np.ndarray | None = None) -> list[str]:
    """BYTES elements as text; those ``missing`` marks are "" (not even decoded)."""
    skip = [False] * len(t.values) if missing is None else missing.tolist()
    out = []
    for i, (raw, m) in enumerate(zip(t.values, skip, strict=True)):
        try:
            out.append("" if m else raw.decode("utf-8"))
        except UnicodeDecodeError:
            at = f" (element {i})" if len(t.values) > 1 else ""
            raise RequestError(t.name, f"BYTES not valid UTF-8{at}") from None
    return out


def _column(t: Tensor, missing: np.ndarray | None) -> np.ndarray | list[str]:
    """A candidate tensor's values as :func:`~serve.validation.item_column` takes them."""
    if t.datatype == "BYTES":
        return _strings(t, missing)
    values = t.values
    assert isinstance(values, np.ndarray)
    return values if t.datatype == "INT64" else values.astype(np.float64)


def _scalar(t: Tensor) -> object:
    """The one value of a [1] tensor as Predict's Value holds it (int, float or str)."""
    if t.datatype == "BYTES":
        return _strings(t)[0]
    x = t.values[0]
    return int(x) if t.datatype == "INT64" else float(x)


# --------------------------------------------------------------------------- gRPC messages

# the typed contents field of each datatype
_CONTENTS = {
    "INT64": "int64_contents",
    "FP64": "fp64_contents",
    "FP32": "fp32_contents",
    "BOOL": "bool_contents",
    "BYTES": "bytes_contents",
}
_CONTENT_FIELDS = (*_CONTENTS.values(), "int_contents", "uint_contents", "uint64_contents")


def _typed(t: v2.ModelInferRequest.InferInputTensor) -> Tensor:
    """A tensor from its typed ``contents`` (the "row" encoding of gRPC)."""
    name, shape = t.name, tuple(t.shape[:])
    _check_datatype(name, t.datatype)
    n = element_count(name, shape)
    wanted = _CONTENTS[t.datatype]
    for f in _CONTENT_FIELDS:
        if f != wanted and len(getattr(t.contents, f)):
            raise RequestError(name, f"contents.{f} set for datatype {t.datatype}; use {wanted}")
    values = getattr(t.contents, wanted)
    if len(values) != n:
        raise RequestError(
            name, f"{len(values)} values in contents.{wanted}, expected {n} (shape {list(shape)})"
        )
    if t.datatype == "BYTES":
        return Tensor(name, t.datatype, shape, list(values))
    return Tensor(name, t.datatype, shape, np.array(values, DTYPES[t.datatype]))


def call_of_grpc(request: v2.ModelInferRequest) -> InferCall:
    """A gRPC ModelInferRequest as an InferCall: tensors from ``raw_input_contents`` (one per
    input, in order; the answer raw too) or from each input's typed ``contents``."""
    raw = request.raw_input_contents
    inputs = request.inputs
    if len(raw):
        if len(raw) != len(inputs):
            raise RequestError(
                "request",
                f"{len(raw)} raw_input_contents for {len(inputs)} inputs; send one per input, in order",
            )
        tensors = []
        for t, r in zip(inputs, raw, strict=True):
            name = short_name(t.name)
            if t.HasField("contents"):
                raise RequestError(name, "contents set beside raw_input_contents; send one of them")
            tensors.append(decode_raw(name, t.datatype, t.shape[:], r))  # [:]: a list, fast
    else:
        tensors = [_typed(t) for t in inputs]
    return InferCall(
        request.model_name,
        request.model_version,
        request.id,
        tensors,
        [o.name for o in request.outputs],
        binary_output=bool(len(raw)),
    )


def grpc_response(result: InferResult) -> v2.ModelInferResponse:
    """The answer: ``probabilities`` FP32 [N], in ``raw_output_contents`` when the request's
    inputs were raw (what Triton sends and tritonclient reads), else in typed
    ``contents.fp32_contents``."""
    probs = np.ascontiguousarray(result.probabilities, dtype="<f4")
    output = v2.ModelInferResponse.InferOutputTensor(
        name=OUTPUT, datatype="FP32", shape=[len(probs)]
    )
    response = v2.ModelInferResponse(
        model_name=result.model_name,
        model_version=result.model_version,
        id=result.id,
        outputs=[output],
    )
    if result.binary_output:
        response.raw_output_contents.append(probs.tobytes())
    else:
        response.outputs[0].contents.fp32_contents.extend(probs.tolist())
    return response
