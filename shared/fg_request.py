"""Feature generation of a serving request: one user with N candidates → a Batch (U = 1, B = N).

:func:`request_to_batch` takes the candidates row by row, :func:`request_columns_to_batch`
column by column (what ``serve/validation.py`` builds). The values go through the column
functions of :mod:`shared.fg` (the ones training uses), so a request gives the ids its row gets
in training; transforms, missing values and errors are documented there. A request's null-free
number columns, integer/float user and context values and integer sequences skip Arrow (numpy
straight into those functions, with a plan of the FeatureSet built once, see
:func:`~shared.fg_plan.per_feature_set`); everything else is first turned into small Arrow
columns. For a column that mixes kinds, one Python loop runs over its values once.

Serving values (:func:`request_columns_to_batch`) are Python lists (None = missing), numpy or
Arrow arrays. A list may mix kinds, as the protocol allows (a DYNAMIC id as int64 or string, a
HASH value as string or int64, a price as double or int64): each value gets exactly the ids it
would get in a column of its own kind (the list becomes an Arrow union, one child per kind, and
each child goes through the column functions on its own). Integers beyond int64 become uint64
(a price gets its bucket, an id is refused).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch
from shared.features import FeatureSet, FeatureSpec, IdTransform
from shared.fg import (
    FeatureError,
    FgStats,
    IntIds,
    bucket_ids,
    int_ids,
    plain_array,
    scalar_ids,
    sequence_ids,
    values_ignoring_nulls,
)
from shared.fg_plan import (
    FeaturePlan,
    Ids,
    feature_plan,
    flat_kjt,
    kjt,
    per_feature_set,
    sequence_kjt,
)
from shared.fg_text import INT64_MAX

__all__ = ["request_columns_to_batch", "request_to_batch"]

_STRING_CACHE = 4096  # distinct USER/CONTEXT strings whose ids a plan keeps, per feature
_CACHED_CHARS = 256  # longer strings are hashed every time


@dataclass(frozen=True)
class _RequestPlan:
    """What every request of a FeatureSet needs, worked out once (:func:`_plan`).

    ``strings`` holds, per USER/CONTEXT feature, the ids of string values seen (a request's
    ``pid`` is hashed once, not once per request); ids depend on the value and the spec alone.
    """

    layout: FeaturePlan  # where each feature goes in the Batch
    ints: dict[str, IntIds]  # every feature's integer transform
    strings: dict[str, dict[str, np.ndarray]]

    @classmethod
    def of(cls, fs: FeatureSet) -> _RequestPlan:
        layout = feature_plan(fs)
        return cls(
            layout=layout,
            ints={s.name: int_ids(s) for s in fs.features.values()},
            strings={s.name: {} for s in (*layout.user, *layout.context)},
        )


_plan = per_feature_set(_RequestPlan.of)


_SHORT_REPR = reprlib.Repr()  # quotes request values in messages: 3 items, 40 characters
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = 3
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 40


_KINDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("missing", type(None)),
    ("bool", (bool, np.bool_)),  # before int: bool is an int
    ("int", (int, np.integer)),
    ("float", (float, np.floating)),
    ("str", str),
    ("bytes", bytes),
)


def _kind(t: type) -> str:
    """The kind of a request value's Python type (numpy scalars are their Python kind)."""
    for kind, types in _KINDS:
        if issubclass(t, types):
            return kind
    return "other"


def _arrow(name: str, values: list[object] | np.ndarray) -> pa.Array:
    """``pa.array(values)``; ints beyond int64 give uint64 (refused as ids, bucketized as
    prices); anything pyarrow cannot convert is a :class:`FeatureError`."""
    try:
        return pa.array(values)
    except OverflowError:
        pass
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise FeatureError(name, f"cannot convert {_SHORT_REPR.repr(values)}: {e}") from None
    try:
        return pa.array(values, pa.uint64())
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        raise FeatureError(
            name, f"an integer of {_SHORT_REPR.repr(values)} is outside int64 and uint64"
        ) from None


def _request_array(name: str, values: list[object] | np.ndarray) -> pa.Array:
    """Request values (a list, None = missing, or a numpy array) → one Arrow array.

    Values of one kind (ints, floats, strings...) give a plain array. Several kinds in one list
    (a DYNAMIC id sent as 7 by one candidate and as "ad-3" by another, or a price as 3 and 2.5)
    give a dense union with one child per kind (and one for the missing values):
    :func:`scalar_ids` turns each child into ids on its own, so every value gets exactly the
    ids it would get in a column of its own kind.
    """
    if isinstance(values, np.ndarray) and values.dtype != object:
        return _arrow(name, values)
    kind_of = {t: _kind(t) for t in set(map(type, values))}
    kinds = sorted(set(kind_of.values()) - {"missing"})
    if len(kinds) <= 1:
        return _arrow(name, values)
    code = {kind: i for i, kind in enumerate([*kinds, "missing"])}
    codes = np.array([code[kind_of[type(v)]] for v in values], np.int8)
    slots = np.zeros(len(codes), np.int32)
    children = []
    for kind, i in code.items():
        rows = np.flatnonzero(codes == i)
        slots[rows] = np.arange(len(rows))
        members = [values[r] for r in rows.tolist()]
        children.append(pa.nulls(len(rows)) if kind == "missing" else _arrow(name, members))
    return pa.UnionArray.from_dense(
        pa.array(codes, pa.int8()), pa.array(slots, pa.int32()), children, [*kinds, "missing"]
    )


# A request column before its ids: a null-free int64/float64 ndarray (the numeric fast path,
# no Arrow), an Arrow array (through scalar_ids), the ids already known (a cached string), or
# the id of a USER integer.
_Column: TypeAlias = np.ndarray | pa.Array | Ids | int
_NUMERIC = (np.dtype(np.int64), np.dtype(np.float64))
_INT64, _FLOAT64 = pa.int64(), pa.float64()
_INT64_MIN = -INT64_MAX - 1


def _numeric(arr: pa.Array) -> np.ndarray | pa.Array:
    """A null-free int64/float64 Arrow array as a zero-copy ndarray; any other as it is."""
    if arr.null_count == 0 and (arr.type == _INT64 or arr.type == _FLOAT64):
        return values_ignoring_nulls(arr)
    return arr


def _numeric_ids(plan: _RequestPlan, spec: FeatureSpec, values: np.ndarray) -> np.ndarray | None:
    """What :func:`scalar_ids` gives a null-free int64/float64 column (the same functions, no
    Arrow); None where the column needs :func:`scalar_ids` (float ids, a bad price)."""
    if spec.transform is IdTransform.BUCKETIZE:  # ints: their nearest double, as Arrow casts
        return bucket_ids(spec, values.astype(np.float64, copy=False))
    if values.dtype == np.int64:
        return plan.ints[spec.name].array(values)
    return None


_ONES = np.ones(0, np.int32)


def _ones(n: int) -> np.ndarray:
    """[n] int32 ones, a read-only view of one shared array (the lengths of a column with one id
    a row; the KJT copies them), grown to the next power of two when a request needs more."""
    global _ONES
    if len(_ONES) < n:
        ones = np.ones(1 << (n - 1).bit_length(), np.int32)
        ones.setflags(write=False)
        _ONES = ones
    return _ONES[:n]


def _column_ids(plan: _RequestPlan, spec: FeatureSpec, col: _Column, stats: FgStats | None) -> Ids:
    """:func:`scalar_ids` of a request column (numeric columns without Arrow)."""
    if isinstance(col, int):
        return np.array([col], np.int64), _ones(1)
    if isinstance(col, tuple):
        return col
    if isinstance(col, np.ndarray):
        ids = _numeric_ids(plan, spec, col)
        if ids is not None:
            return ids, _ones(len(col))
        col = pa.array(col)  # its error, as scalar_ids raises it
    return scalar_ids(spec, col, stats)


def _scalar_column(plan: _RequestPlan, spec: FeatureSpec, value: object, rows: int) -> _Column:
    """A USER (``rows`` 1) or CONTEXT (``rows`` N) value as the column of ``rows`` copies."""
    if type(value) is int and _INT64_MIN <= value <= INT64_MAX:
        one = plan.ints[spec.name].one
        if rows == 1 and one is not None and value >= 0:
            return one(value)
        return np.full(rows, value, np.int64)
    if type(value) is float:
        return np.full(rows, value, np.float64)
    if type(value) is not str:
        return _arrow(spec.name, [value] * rows)
    cache = plan.strings[spec.name]
    if (ids := cache.get(value)) is None:
        try:
            ids, _ = scalar_ids(spec, _arrow(spec.name, [value]))
        except FeatureError:  # raised again in its turn, by the column of ``rows`` copies
            return _arrow(spec.name, [value] * rows)
        if len(value) <= _CACHED_CHARS:
            if len(cache) >= _STRING_CACHE:
                cache.clear()
            cache[value] = ids
    return np.full(rows, ids[0], np.int64), _ones(rows)


def _item_column(name: str, values: object, n: int) -> _Column:
    """The ITEM-side column ``values`` of :func:`request_columns_to_batch`."""
    if values is None:
        raise FeatureError(name, "missing from the request's candidates")
    column: pa.Array | pa.ChunkedArray | np.ndarray | list[object]
    if isinstance(values, pa.Array | pa.ChunkedArray) or (
        isinstance(values, np.ndarray) and values.ndim == 1
    ):
        column = values
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes):
        column = list(values)
    else:
        raise FeatureError(
            name,
            f"expected a list or array of {n} values (one per candidate), got "
            f"{type(values).__name__} {_SHORT_REPR.repr(values)}",
        )
    if len(column) != n:
        raise FeatureError(name, f"{len(column)} values for {n} candidates")
    if isinstance(column, np.ndarray) and column.dtype in _NUMERIC:
        return column
    if isinstance(column, pa.Array | pa.ChunkedArray):
        return _numeric(plain_array(column))  # used as it is
    return _numeric(_request_array(name, column))


def _need(mapping: Mapping[str, object], name: str, where: str) -> object:
    if name not in mapping:
        raise FeatureError(
            name, f"missing from the request's {where} (send None for a missing value)"
        )
    return mapping[name]


def _sequence_column(name: str, seq: object) -> np.ndarray | pa.Array:
    """One sequence sub-feature (a list of ids) → int64 ndarray, or a one-row list array."""
    if isinstance(seq, str | bytes) or not isinstance(seq, Sequence | np.ndarray):
        raise FeatureError(name, f"expected a list of ids, got {type(seq).__name__}")
    if isinstance(seq, np.ndarray) and seq.dtype == np.int64 and seq.ndim == 1:
        return seq
    if isinstance(seq, list | tuple) and set(map(type, seq)) <= {int}:
        try:
            return np.array(seq, np.int64)
        except OverflowError:
            pass  # refused below, as an id outside int64
    vals = _request_array(name, list(seq))
    if pa.types.is_union(vals.type):
        kinds = [vals.type.field(i).name for i in range(vals.type.num_fields)]
        raise FeatureError(
            name,
            f"values of several kinds ({', '.join(k for k in kinds if k != 'missing')}); "
            "send a list of integer ids",
        )
    return pa.ListArray.from_arrays(pa.array([0, len(vals)], pa.int32()), vals)


def _request_sequence_ids(
    plan: _RequestPlan,
    specs: tuple[FeatureSpec, ...],
    cols: list[np.ndarray | pa.Array],
    stats: FgStats | None,
) -> list[Ids]:
    """:func:`sequence_ids` of one request sequence (``truncate`` off); int64 ndarrays of equal
    lengths within ``sequence_length`` and without negative ids go without Arrow."""
    size = len(cols[0])
    cap = specs[0].sequence_length or 0
    if all(
        isinstance(c, np.ndarray) and len(c) == size and not (size and c.min() < 0) for c in cols
    ) and not (cap and size > cap):
        lengths = np.array([size], np.int32)
        ints = [plan.ints[spec.name].array for spec in specs]
        return [(f(c), lengths) for f, c in zip(ints, cols, strict=True)]
    lists = [
        pa.ListArray.from_arrays(pa.array([0, len(c)], pa.int32()), pa.array(c))
        if isinstance(c, np.ndarray)
        else c
        for c in cols
    ]
    return sequence_ids(specs, lists, truncate=False, stats=stats)


def request_to_batch(
    fs: FeatureSet,
    *,
    user: Mapping[str, object],
    sequences: Mapping[str, Sequence[int | None]],
    context: Mapping[str, object],
    candidates: Sequence[Mapping[str, object]],
    stats: FgStats | None = None,
) -> Batch:
    """One serving request (one user, N candidate ads) → Batch with U = 1, B = N.

    ``user``: the USER-side features; ``sequences``: each sequence sub-feature as a list of ids
    (most recent last, None = missing element); ``context``: CONTEXT-side features (shared by
    all candidates); ``candidates``: per ad, the ITEM-side features. Keys are feature names, None
    is a missing value. Goes through the same column functions as :func:`table_to_batch`.
    """
    n = len(candidates)
    if n == 0:
        raise FeatureError("candidates", "at least one candidate is needed")
    items = {
        spec.name: [_need(c, spec.name, f"candidate {i}") for i, c in enumerate(candidates)]
        for spec in _plan(fs).layout.items
    }
    return request_columns_to_batch(
        fs,
        user=user,
        sequences=sequences,
        context=context,
        items=items,
        num_candidates=n,
        stats=stats,
    )


def request_columns_to_batch(
    fs: FeatureSet,
    *,
    user: Mapping[str, object],
    sequences: Mapping[str, Sequence[int | None]],
    context: Mapping[str, object],
    items: Mapping[str, Sequence[object] | pa.Array | np.ndarray],
    num_candidates: int,
    stats: FgStats | None = None,
) -> Batch:
    """:func:`request_to_batch` with the candidates given column by column (what the server's
    validation builds): ``items[name]`` holds ITEM-side feature ``name`` of every candidate, as
    a list (None = missing), or as an Arrow array (null = missing) or numpy array, which are
    used as they are (no per-value conversion; the server's columnar requests come this way).

    Example: two candidates ``items={"adgroup_id": [7, 9], "price": [1.5, None], ...}``,
    ``num_candidates=2``; ``items={"adgroup_id": pa.array([7, 9]), ...}`` gives the same batch.

    Null-free int64/float64 columns (numpy, or Arrow viewed as numpy), integer and float user
    and context values, and integer sequences skip Arrow: they go straight to the functions
    :func:`scalar_ids` and :func:`sequence_ids` would call, so the ids are the same; every
    other column, and every value that would raise, goes through those two as before. Values
    are converted first and turned into ids second (USER, then ITEM and CONTEXT in config
    order, then sequences), so the first bad value raises, whichever path it takes.
    """
    n = num_candidates
    if n < 1:
        raise FeatureError("candidates", "at least one candidate is needed")
    plan = _plan(fs)
    cols: dict[str, _Column] = {}
    for spec in plan.layout.user:
        cols[spec.name] = _scalar_column(plan, spec, _need(user, spec.name, "user"), 1)
    for spec in plan.layout.context:
        cols[spec.name] = _scalar_column(plan, spec, _need(context, spec.name, "context"), n)
    for spec in plan.layout.items:
        cols[spec.name] = _item_column(spec.name, items.get(spec.name), n)
    seqs = {
        spec.name: _sequence_column(spec.name, _need(sequences, spec.name, "sequences"))
        for specs in plan.layout.sequences
        for spec in specs
    }

    def seq_ids(specs: tuple[FeatureSpec, ...]) -> list[Ids]:
        return _request_sequence_ids(plan, specs, [seqs[s.name] for s in specs], stats)

    def ids_kjt(specs: tuple[FeatureSpec, ...], stride: int) -> KeyedJaggedTensor:
        names = [s.name for s in specs]
        ints = [cols[n] for n in names]
        if stride == 1 and all(type(v) is int for v in ints):  # the user's ids, already made
            k = len(ints)  # (lengths of its own: a KJT's tensors share the arrays given)
            return flat_kjt(names, np.array(ints, np.int64), np.ones(k, np.int32), [1] * k, 1)
        return kjt(names, [_column_ids(plan, s, cols[s.name], stats) for s in specs], stride)

    batch = Batch(
        user=ids_kjt(plan.layout.user, 1),
        item=ids_kjt(plan.layout.item_kjt, n),
        sequence=sequence_kjt(plan.layout, seq_ids, 1),
        user_index=torch.zeros(n, dtype=torch.int64),
    )
    if stats is not None:
        stats.rows += n
    return batch
