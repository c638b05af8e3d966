"""PredictRequest → the plain inputs of feature generation, or a :class:`RequestError` naming the field.

This is the protocol-level check: every feature the model needs is present on the right side,
values have the wire type the feature expects (see :func:`value_type`), the candidate list is
non-empty and within ``max_candidates``, the sub-sequences of one sequence have equal lengths
within ``max_sequence_length``, and nothing unknown is sent. Value semantics that feature
generation owns (negative price, ids out of range) are reported by :mod:`shared.fg` as
``FeatureError`` and mapped the same way by the servicer (:func:`request_field`).

The checks of values are functions over plain values, shared by every protocol: the Open
Inference Protocol (:func:`serve.oip.fg_inputs`) calls :func:`check_candidate_count`,
:func:`item_column`, :func:`scalar_value` and :func:`sequence_ids` with its tensors' arrays, so
the limits and messages are one implementation; :class:`Fields` says how each encoding names a
value in errors (Predict's field paths, or the tensor's name).

Candidates come in one of two encodings, checked by the same column checks (:func:`_check_names`,
:func:`_check_kind`, :func:`_check_finite`) and giving the same feature-generation inputs:
``candidates`` (one ``Features`` map per candidate; the common case is checked a column at a time
by :func:`_item_columns`) and ``candidate_columns`` (one typed, packed column per feature,
converted with one call per column by :func:`_candidate_columns`: to numpy for numbers without
missing values, which feature generation takes without Arrow, else to Arrow). Field names in
errors::

    candidates                                  empty or too many
    candidates[3].price                         a candidate's feature
    candidate_columns                           sent together with candidates
    candidate_columns.num_candidates            0 or too many
    candidate_columns.columns["price"]          a column: unknown, absent, kind, length, values
    user.user_id, context.pid                   a user / context feature
    sequences.click_50_seq__brand               a sequence sub-feature
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from protos import predict_pb2
from serve.limits import Limits, shown
from shared.features import FeatureSet, FeatureSpec, IdTransform, Side
from shared.fg import FeatureError, scalar_ids
from shared.fg_plan import per_feature_set


class RequestError(ValueError):
    """Bad request content; ``field`` names where (``candidates[3].price``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class FgInputs:
    """Keyword arguments of ``shared.fg_request.request_columns_to_batch`` (None = explicit missing value).

    ``items`` holds one column per ITEM-side feature (the value of each candidate, in order): a
    list (None = missing) from ``candidates``; from ``candidate_columns``, a numpy array
    (int64, float64) for a number column without missing values, else an Arrow array (null =
    missing).
    """

    user: dict[str, object]
    sequences: dict[str, list[int] | np.ndarray]  # int64 ids, oldest first
    context: dict[str, object]
    items: dict[str, list[object] | pa.Array | np.ndarray]
    num_candidates: int


@dataclass(frozen=True)
class _Specs:
    """The features a request carries, by where it carries them (worked out once per
    FeatureSet, :data:`_specs`)."""

    user: dict[str, FeatureSpec]
    context: dict[str, FeatureSpec]
    items: dict[str, FeatureSpec]
    sequences: dict[str, FeatureSpec]

    @classmethod
    def of(cls, fs: FeatureSet) -> _Specs:
        def side(side: Side) -> dict[str, FeatureSpec]:
            return {f.name: f for f in fs.features.values() if not f.is_sequence and f.side is side}

        sequences = {f.name: f for f in fs.features.values() if f.is_sequence}
        return cls(side(Side.USER), side(Side.CONTEXT), side(Side.ITEM), sequences)


_specs = per_feature_set(_Specs.of)


@dataclass(frozen=True)
class Fields:
    """How one request encoding names where a feature's value is, in errors: Predict's
    (:data:`PREDICT_COLUMNS`, :data:`PREDICT_ROWS`) or the Open Inference Protocol's (every
    feature a tensor of its own name, :data:`TENSORS`). ``candidate`` names one candidate's
    value (rows); None: the column's name, its problem ending in ``(candidate i)``."""

    user: Callable[[str], str]
    context: Callable[[str], str]
    sequence: Callable[[str], str]
    column: Callable[[str], str]
    candidate: Callable[[int, str], str] | None = None

    def side(self, side: Side) -> Callable[[str], str]:
        return self.context if side is Side.CONTEXT else self.user


def column_field(name: str) -> str:
    """How errors name the column of feature ``name`` in ``candidate_columns``."""
    return f'candidate_columns.columns["{name}"]'


PREDICT_COLUMNS = Fields(
    user="user.{}".format,
    context="context.{}".format,
    sequence="sequences.{}".format,
    column=column_field,
)
PREDICT_ROWS = Fields(
    user="user.{}".format,
    context="context.{}".format,
    sequence="sequences.{}".format,
    column="candidates.{}".format,
    candidate="candidates[{}].{}".format,
)
TENSORS = Fields(user=str, context=str, sequence=str, column=str)


def fields_of(request: predict_pb2.PredictRequest) -> Fields:
    """The names of ``request``'s encoding (columns or rows)."""
    return PREDICT_COLUMNS if request.HasField("candidate_columns") else PREDICT_ROWS


def value_type(spec: FeatureSpec) -> str:
    """The wire type a feature expects: ``int64``, ``double`` or ``string`` (model metadata)."""
    return _wire_type(spec.transform)


def _wire_type(transform: IdTransform) -> str:
    if transform is IdTransform.BUCKETIZE:
        return "double"
    if transform is IdTransform.HASH:
        return "string"
    return "int64"


# accepted Value kinds per expected type (ints are numbers; hashed ids may be ints or strings)
_ACCEPTED = {
    "int64": ("int64_value",),
    "double": ("double_value", "int64_value"),
    "string": ("string_value", "int64_value"),
}
# the Column kinds of candidate_columns, by the Value kind they stand for
_COLUMN_KINDS = {"int64_value": "int64s", "double_value": "doubles", "string_value": "strings"}
_VALUE_KINDS = {c: v for v, c in _COLUMN_KINDS.items()}
_COLUMN_DTYPES = {"int64s": np.int64, "doubles": np.float64}


_ACCEPTED_BY_TRANSFORM = {  # string DYNAMIC ids are hashed to int64
    t: ("int64_value", "string_value") if t is IdTransform.DYNAMIC else _ACCEPTED[_wire_type(t)]
    for t in IdTransform
}


def _accepted(spec: FeatureSpec) -> tuple[str, ...]:
    return _ACCEPTED_BY_TRANSFORM[spec.transform]


def accepted_kinds(spec: FeatureSpec) -> tuple[str, ...]:
    """The Value kinds a feature takes (``int64_value``, ``double_value``, ``string_value``);
    the first is its :func:`value_type`'s, except for dynamic ids (int64 first, strings hashed)."""
    return _accepted(spec)


def check_candidate_count(field: str, n: int, limits: Limits) -> None:
    """``n`` candidates are at least one and within ``limits.max_candidates``."""
    if n == 0:
        raise RequestError(field, "empty; send at least one candidate ad")
    if n > limits.max_candidates:
        raise RequestError(field, f"{n} candidates, more than the limit {limits.max_candidates}")


# --------------------------------------------------------------------------- shared checks
# used by both candidate encodings (and by user / context features)


def _check_names(
    present: Collection[str],
    specs: Mapping[str, FeatureSpec],
    field: Callable[[str], str],
    where: str,
    mark_missing: str,
) -> None:
    """Every feature of ``specs`` is in ``present`` and nothing else is."""
    for name in present:
        if name not in specs:
            raise RequestError(
                field(_name(name)),
                f"unknown feature for {where}; expected {sorted(specs)} (see GetModelMetadata)",
            )
    for name in specs:
        if name not in present:
            raise RequestError(field(name), f"missing required feature; {mark_missing}")


def _check_kind(
    spec: FeatureSpec, kind: str, field: str, got: object, names: Mapping[str, str] | None = None
) -> None:
    """Values of Value kind ``kind`` (``int64_value``...) are accepted for ``spec``; ``names``
    says how the encoding calls the kinds in the message (``candidate_columns``: ``int64s``...)."""
    accepted = _accepted(spec)
    if kind in accepted:
        return
    name = (lambda k: k) if names is None else names.__getitem__
    if value_type(spec) == "double":
        wanted = f"a number ({name('double_value')})"
    else:
        wanted = " or ".join(map(name, accepted))
    raise RequestError(field, f"expected {wanted}, got {name(kind)} {shown(got)}")


def _check_finite(field: str, values: np.ndarray, skip: np.ndarray | None = None) -> None:
    """Double values are finite (``skip``: rows not checked, the missing ones); a column's error
    names the first bad candidate."""
    bad = ~np.isfinite(values)
    if skip is not None:
        bad &= ~skip
    if bad.any():
        i = int(np.argmax(bad))
        at = f" (candidate {i})" if len(values) > 1 else ""
        raise RequestError(field, f"expected a finite number, got {values[i]}{at}")


def _check_strings(field: str, values: Sequence[str], limit: int) -> None:
    """Every string has at most ``limit`` UTF-8 bytes (before any hashing touches a byte);
    a column's error names the first long candidate."""
    if not values or max(map(len, values)) * 4 <= limit:  # a character is at most 4 bytes
        return
    for i, v in enumerate(values):
        if len(v) * 4 > limit and (size := len(v.encode("utf-8", "surrogatepass"))) > limit:
            at = f" (candidate {i})" if len(values) > 1 else ""
            raise RequestError(
                field,
                f"string of {size} bytes{at}, more than the limit {limit} "
                "(serve --max-string-bytes)",
            )


def _name(name: str) -> str:
    """A client-chosen name, cut short for echoing in a field path."""
    return name if len(name) <= 64 else f"{name[:48]}...({len(name)} chars)"


# --------------------------------------------------------------------------- row format


def scalar_value(spec: FeatureSpec, kind: str, raw: object, field: str, limits: Limits) -> object:
    """One value of Value kind ``kind`` (``int64_value``...) for ``spec``, checked: an accepted
    kind, a finite number, a string within ``max_string_bytes``. Both protocols' one check of
    a user, context or (rows) candidate value."""
    _check_kind(spec, kind, field, raw)
    if kind == "double_value" and not math.isfinite(raw):  # type: ignore[arg-type]
        _check_finite(field, np.array((raw,)))
    elif kind == "string_value":
        _check_strings(field, (raw,), limits.max_string_bytes)  # type: ignore[arg-type]
    return raw


def _value(v: predict_pb2.Value, spec: FeatureSpec, field: str, limits: Limits) -> object:
    kind = v.WhichOneof("kind")
    if kind is None:
        return None  # explicit missing value → zero embedding
    return scalar_value(spec, kind, getattr(v, kind), field, limits)


def _features(
    msg: predict_pb2.Features,
    specs: Mapping[str, FeatureSpec],
    prefix: str,
    where: str,
    limits: Limits,
) -> dict[str, object]:
    values = msg.values
    _check_names(
        values,
        specs,
        lambda name: f"{prefix}.{name}",
        where,
        "send an empty Value to mark it missing",
    )
    return {
        name: _value(values[name], spec, f"{prefix}.{name}", limits) for name, spec in specs.items()
    }


_KIND = operator.methodcaller("WhichOneof", "kind")


def _item_columns(
    candidates: Sequence[predict_pb2.Features], specs: Mapping[str, FeatureSpec], limits: Limits
) -> dict[str, list[object]] | None:
    """The candidates' values column by column, when every candidate has exactly the features
    of ``specs`` with values of accepted kinds (finite, for doubles).

    This is the common case, checked in bulk, a column at a time (the column checks of
    ``candidate_columns``); None sends the request through the per-candidate checks of
    :func:`_features`, which name the first bad candidate. Either way the values are the same
    (an empty Value is None).
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
        raw: list[Any]
        if len(present) == 1 and None not in kinds:
            raw = list(map(operator.attrgetter(next(iter(present))), col))
        else:  # explicit missing values (None) or mixed kinds
            raw = [None if k is None else getattr(v, k) for v, k in zip(col, kinds, strict=True)]
        try:
            for kind in present:
                _check_kind(spec, kind, name, None)
            if "double_value" in present:  # numbers only, after the kind check
                _check_finite(name, np.array([x for x in raw if x is not None], np.float64))
            if "string_value" in present:
                _check_strings(
                    name, [x for x in raw if isinstance(x, str)], limits.max_string_bytes
                )
        except RequestError:
            return None
        columns[name] = raw
    return columns


# --------------------------------------------------------------------------- columnar format


def _column_array(
    col: predict_pb2.Column, spec: FeatureSpec, n: int, field: str, limits: Limits
) -> pa.Array | np.ndarray:
    """One column of ``candidate_columns`` → its ``n`` values with one conversion call
    (:func:`item_column`)."""
    kind = col.WhichOneof("kind")
    if kind is None:
        wanted = " or ".join(_COLUMN_KINDS[k] for k in _accepted(spec))
        raise RequestError(
            field, f"no values; set {wanted} (with `missing` marking the missing ones)"
        )
    values = getattr(col, kind).values
    _check_kind(spec, _VALUE_KINDS[kind], field, list(values[:3]), _COLUMN_KINDS)
    if len(values) != n:
        raise RequestError(field, f"{len(values)} values, expected num_candidates {n}")
    missing: np.ndarray | None = None
    if len(col.missing):
        if len(col.missing) != n:
            raise RequestError(
                field,
                f"missing has {len(col.missing)} entries, expected none or num_candidates {n}",
            )
        missing = np.array(col.missing, dtype=bool)
    if kind == "strings":
        return item_column(spec, "string_value", list(values), missing, field, limits)
    arr = np.array(values, dtype=_COLUMN_DTYPES[kind])
    return item_column(spec, _VALUE_KINDS[kind], arr, missing, field, limits)


def item_column(
    spec: FeatureSpec,
    kind: str,
    values: np.ndarray | list[str],
    missing: np.ndarray | None,
    field: str,
    limits: Limits,
) -> pa.Array | np.ndarray:
    """One ITEM-side feature's column (one value per candidate, counted by the caller) in
    the form feature generation takes: numbers without missing values as the numpy array
    they are (int64, float64), others as an Arrow array (null where ``missing``; the
    placeholders of missing values are ignored, whatever they hold). Checked: an accepted
    Value kind (``int64_value``...), finite numbers, strings within ``max_string_bytes``;
    an error names the first bad candidate. Both protocols' one check of a column."""
    _check_kind(spec, kind, field, None)
    if missing is not None and not missing.any():
        missing = None
    if isinstance(values, list):  # strings
        if missing is not None:
            values = ["" if m else v for v, m in zip(values, missing.tolist(), strict=True)]
        _check_strings(field, values, limits.max_string_bytes)
        return pa.array(values, pa.string(), mask=missing)
    if kind == "double_value":
        _check_finite(field, values, missing)
    return values if missing is None else pa.array(values, mask=missing)


def _candidate_columns(
    cc: predict_pb2.CandidateColumns, specs: Mapping[str, FeatureSpec], limits: Limits
) -> dict[str, pa.Array | np.ndarray]:
    """``candidate_columns`` → one column per ITEM-side feature (count checked before)."""
    n = cc.num_candidates
    columns = cc.columns
    _check_names(
        columns,
        specs,
        column_field,
        "a candidate",
        "send its column, with `missing` marking missing values",
    )
    return {
        name: _column_array(columns[name], spec, n, column_field(name), limits)
        for name, spec in specs.items()
    }


# --------------------------------------------------------------------------- request


def _num_candidates(request: predict_pb2.PredictRequest, limits: Limits) -> int:
    """The candidate count of whichever encoding ``request`` uses (exactly one, checked)."""
    if request.HasField("candidate_columns"):
        if len(request.candidates):
            raise RequestError(
                "candidate_columns",
                f"set together with candidates ({len(request.candidates)}); send either "
                "candidates (one Features per candidate) or candidate_columns (one column per "
                "feature), not both",
            )
        field, n = "candidate_columns.num_candidates", request.candidate_columns.num_candidates
    else:
        field, n = "candidates", len(request.candidates)
    check_candidate_count(field, n, limits)
    return n


def _sequences(
    request: predict_pb2.PredictRequest, specs: Mapping[str, FeatureSpec], limits: Limits
) -> dict[str, list[int] | np.ndarray]:
    for name in request.sequences:
        if name not in specs:
            raise RequestError(
                f"sequences.{_name(name)}", f"unknown sequence feature; expected {sorted(specs)}"
            )
    ids: dict[str, list[int] | np.ndarray] = {}
    for name in specs:
        if name not in request.sequences:
            raise RequestError(
                f"sequences.{name}", "missing required sequence; send an empty list if none"
            )
        ids[name] = list(request.sequences[name].ids)
    return sequence_ids(ids, specs, PREDICT_COLUMNS, limits)


def sequence_ids(
    ids: Mapping[str, list[int] | np.ndarray],
    specs: Mapping[str, FeatureSpec],
    fields: Fields,
    limits: Limits,
) -> dict[str, list[int] | np.ndarray]:
    """Every sequence sub-feature's ids (all present), checked: at most the limit of its
    sequence, and the sub-sequences of one sequence of equal lengths. Both protocols' one
    check of the sequences."""
    out: dict[str, list[int] | np.ndarray] = {}
    first_of: dict[str, str] = {}  # sequence_name → first sub-feature seen
    for name, spec in specs.items():
        field = fields.sequence(name)
        seq = ids[name]
        cap = limits.sequence_cap(spec.sequence_length)
        if len(seq) > cap:
            raise RequestError(
                field,
                f"{len(seq)} elements, more than the limit {cap}; send the most recent {cap} "
                "(GetModelMetadata lists each sequence's max_length)",
            )
        group = spec.sequence_name or name
        if group in first_of and len(seq) != len(out[first_of[group]]):
            other = first_of[group]
            raise RequestError(
                field,
                f"{len(seq)} elements but {fields.sequence(other)} has {len(out[other])}; the "
                f"sub-sequences of {group} must have equal lengths (element i is one click)",
            )
        first_of.setdefault(group, name)
        out[name] = seq
    return out


def request_inputs(request: predict_pb2.PredictRequest, fs: FeatureSet, limits: Limits) -> FgInputs:
    """Check ``request`` against the model's features and the limits; raises :class:`RequestError`."""
    n = _num_candidates(request, limits)
    specs = _specs(fs)
    user = _features(request.user, specs.user, "user", "the user", limits)
    sequences = _sequences(request, specs.sequences, limits)
    context = _features(request.context, specs.context, "context", "the context", limits)
    items: dict[str, list[object] | pa.Array | np.ndarray]
    if request.HasField("candidate_columns"):
        items = dict(_candidate_columns(request.candidate_columns, specs.items, limits))
    elif (columns := _item_columns(request.candidates, specs.items, limits)) is not None:
        items = dict(columns)
    else:
        rows = [
            _features(c, specs.items, f"candidates[{i}]", "a candidate", limits)
            for i, c in enumerate(request.candidates)
        ]
        items = {name: [row[name] for row in rows] for name in specs.items}
    return FgInputs(user, sequences, context, items, n)


def feature_error(
    fs: FeatureSet, inputs: FgInputs, err: FeatureError, fields: Fields
) -> RequestError:
    """A feature-generation error (a value semantics check, e.g. a negative id) as a
    :class:`RequestError` naming where the value is in the request (``fields``: how the
    request's encoding names it): for an ITEM-side feature the first bad candidate is found by
    running the feature's column one value at a time (an error path only; at most
    ``max_candidates`` values)."""
    spec = fs.features.get(err.field)
    if spec is None:
        return RequestError(err.field, err.message)
    if spec.is_sequence:
        return RequestError(fields.sequence(spec.name), err.message)
    if spec.side is not Side.ITEM:
        return RequestError(fields.side(spec.side)(spec.name), err.message)
    bad = _first_bad_value(spec, inputs.items[spec.name])
    if fields.candidate is None or bad is None:
        at = "" if bad is None else f" (candidate {bad})"
        return RequestError(fields.column(spec.name), err.message + at)
    return RequestError(fields.candidate(bad, spec.name), err.message)


def _first_bad_value(spec: FeatureSpec, values: list[object] | pa.Array | np.ndarray) -> int | None:
    for i in range(len(values)):
        try:
            one = values[i : i + 1]
            scalar_ids(spec, one if isinstance(one, pa.Array) else pa.array(one))
        except Exception:  # whatever this one value raises, it is the bad one
            return i
    return None
