"""PredictRequest → the plain inputs of feature generation, or a :class:`RequestError` naming the field.

This is the protocol-level check: every feature the model needs is present on the right side,
values have the wire type the feature expects (see :func:`value_type`), the candidate list is
non-empty and within ``max_candidates``, the sub-sequences of one sequence have equal lengths
within ``max_sequence_length``, and nothing unknown is sent. Value semantics that feature
generation owns (negative price, ids out of range) are reported by :mod:`shared.fg` as
``FeatureError`` and mapped the same way by the servicer. Field names in errors::

    candidates                      empty or too many
    candidates[3].price             a candidate's feature
    user.user_id, context.pid       a user / context feature
    sequences.click_50_seq__brand   a sequence sub-feature
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protos import predict_pb2
from shared.features import FeatureSet, FeatureSpec, IdTransform, Side


class RequestError(ValueError):
    """Bad request content; ``field`` names where (``candidates[3].price``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    max_candidates: int = 1000
    max_sequence_length: int = 100  # further capped per sequence by its configured length

    def __post_init__(self) -> None:
        if self.max_candidates < 1 or self.max_sequence_length < 0:
            raise ValueError(f"limits must be positive, got {self}")


@dataclass(frozen=True)
class FgInputs:
    """Keyword arguments of ``shared.fg.request_columns_to_batch`` (None = explicit missing value).

    ``items`` holds one column per ITEM-side feature (the value of each candidate, in order).
    """

    user: dict[str, object]
    sequences: dict[str, list[int]]
    context: dict[str, object]
    items: dict[str, list[object]]
    num_candidates: int


def value_type(spec: FeatureSpec) -> str:
    """The wire type a feature expects: ``int64``, ``double`` or ``string`` (model metadata)."""
    if spec.transform is IdTransform.BUCKETIZE:
        return "double"
    if spec.transform is IdTransform.HASH:
        return "string"
    return "int64"


# accepted Value kinds per expected type (ints are numbers; hashed ids may be ints or strings)
_ACCEPTED = {
    "int64": ("int64_value",),
    "double": ("double_value", "int64_value"),
    "string": ("string_value", "int64_value"),
}


def _accepted(spec: FeatureSpec) -> tuple[str, ...]:
    if spec.transform is IdTransform.DYNAMIC:
        return ("int64_value", "string_value")  # string ids are hashed to int64
    return _ACCEPTED[value_type(spec)]


def _value(v: predict_pb2.Value, spec: FeatureSpec, field: str) -> object:
    kind = v.WhichOneof("kind")
    if kind is None:
        return None  # explicit missing value → zero embedding
    expected = value_type(spec)
    accepted = _accepted(spec)
    raw = getattr(v, kind)
    if kind not in accepted:
        if expected == "double":
            raise RequestError(field, f"expected a number (double_value), got {kind} {raw!r}")
        raise RequestError(field, f"expected {' or '.join(accepted)}, got {kind} {raw!r}")
    if kind == "double_value" and not math.isfinite(raw):
        raise RequestError(field, f"expected a finite number, got {raw}")
    return raw


def _features(
    msg: predict_pb2.Features,
    specs: Mapping[str, FeatureSpec],
    prefix: str,
    where: str,
) -> dict[str, object]:
    values = msg.values
    for name in values:
        if name not in specs:
            raise RequestError(
                f"{prefix}.{name}",
                f"unknown feature for {where}; expected {sorted(specs)} (see GetModelMetadata)",
            )
    out: dict[str, object] = {}
    for name, spec in specs.items():
        if name not in values:
            raise RequestError(
                f"{prefix}.{name}",
                "missing required feature; send an empty Value to mark it missing",
            )
        out[name] = _value(values[name], spec, f"{prefix}.{name}")
    return out


_KIND = operator.methodcaller("WhichOneof", "kind")


def _item_columns(
    candidates: Sequence[predict_pb2.Features], specs: Mapping[str, FeatureSpec]
) -> dict[str, list[object]] | None:
    """The candidates' values column by column, when every candidate has exactly the features
    of ``specs`` with values of accepted kinds (finite, for doubles).

    This is the common case, checked in bulk, a column at a time; None sends the request
    through the per-candidate checks of :func:`_features`, which name the first bad candidate.
    Either way the values are the same (an empty Value is None).
    """
    maps = [c.values for c in candidates]
    if any(len(m) != len(specs) for m in maps):
        return None  # a feature missing or unknown somewhere
    columns: dict[str, list[object]] = {}
    for name, spec in specs.items():
        col = [m.get(name) for m in maps]
        if None in col:  # ``len`` matched, so some other key is unknown
            return None
        kinds = list(map(_KIND, col))
        present = set(kinds) - {None}
        if not present <= set(_accepted(spec)):
            return None
        raw: list[Any]
        if len(present) == 1 and None not in kinds:
            raw = list(map(operator.attrgetter(next(iter(present))), col))
        else:  # explicit missing values (None) or mixed kinds
            raw = [None if k is None else getattr(v, k) for v, k in zip(col, kinds, strict=True)]
        if "double_value" in present and not all(math.isfinite(x) for x in raw if x is not None):
            return None
        columns[name] = raw
    return columns


def _sequences(
    request: predict_pb2.PredictRequest, fs: FeatureSet, limits: Limits
) -> dict[str, list[int]]:
    specs = {f.name: f for f in fs.features.values() if f.is_sequence}
    for name in request.sequences:
        if name not in specs:
            raise RequestError(
                f"sequences.{name}", f"unknown sequence feature; expected {sorted(specs)}"
            )
    out: dict[str, list[int]] = {}
    first_of: dict[str, str] = {}  # sequence_name → first sub-feature seen
    for name, spec in specs.items():
        field = f"sequences.{name}"
        if name not in request.sequences:
            raise RequestError(field, "missing required sequence; send an empty list if none")
        ids = list(request.sequences[name].ids)
        cap = min(limits.max_sequence_length, spec.sequence_length or limits.max_sequence_length)
        if len(ids) > cap:
            raise RequestError(field, f"{len(ids)} elements, more than the limit {cap}")
        group = spec.sequence_name or name
        if group in first_of and len(ids) != len(out[first_of[group]]):
            other = first_of[group]
            raise RequestError(
                field,
                f"{len(ids)} elements but sequences.{other} has {len(out[other])}; the "
                f"sub-sequences of {group} must have equal lengths (element i is one click)",
            )
        first_of.setdefault(group, name)
        out[name] = ids
    return out


def request_inputs(request: predict_pb2.PredictRequest, fs: FeatureSet, limits: Limits) -> FgInputs:
    """Check ``request`` against the model's features and the limits; raises :class:`RequestError`."""
    n = len(request.candidates)
    if n == 0:
        raise RequestError("candidates", "empty; send at least one candidate ad")
    if n > limits.max_candidates:
        raise RequestError(
            "candidates", f"{n} candidates, more than the limit {limits.max_candidates}"
        )
    scalar = [f for f in fs.features.values() if not f.is_sequence]
    by_side = {
        side: {f.name: f for f in scalar if f.side is side}
        for side in (Side.USER, Side.ITEM, Side.CONTEXT)
    }
    user = _features(request.user, by_side[Side.USER], "user", "the user")
    sequences = _sequences(request, fs, limits)
    context = _features(request.context, by_side[Side.CONTEXT], "context", "the context")
    items = _item_columns(request.candidates, by_side[Side.ITEM])
    if items is None:
        rows = [
            _features(c, by_side[Side.ITEM], f"candidates[{i}]", "a candidate")
            for i, c in enumerate(request.candidates)
        ]
        items = {name: [row[name] for row in rows] for name in by_side[Side.ITEM]}
    return FgInputs(user, sequences, context, items, n)


def request_field(fs: FeatureSet, feature: str) -> str:
    """Where feature ``feature`` lives in a request (for errors raised by feature generation)."""
    spec = fs.features.get(feature)
    if spec is None:
        return feature
    if spec.is_sequence:
        return f"sequences.{feature}"
    return {Side.USER: "user", Side.CONTEXT: "context", Side.ITEM: "candidates[*]"}[
        spec.side
    ] + f".{feature}"
