"""Feature generation: raw column values → the id tensors of a :class:`~shared.batch.Batch`.

One set of column functions serves training (:func:`table_to_batch`, a Parquet record batch of B
rows) and serving (:func:`request_to_batch`, one user with N candidates): the request's columns
go through the same transform functions, so a row gives bit-identical ids on both sides. A
request's null-free number columns, integer/float user and context values and integer sequences
skip Arrow (numpy straight into those functions, with a plan of the FeatureSet built once,
:func:`per_feature_set`); everything else is first turned into small Arrow columns. Everything is vectorized over rows (pyarrow / numpy); the only
Python loops run over features, over the distinct lengths of long tokens, over the byte positions
of distinct hashed strings (and the rest of a few long ones, see :func:`~shared.fg_text.hash64`),
or, for a serving column that mixes kinds, over its values once.

Transforms (``FeatureSpec.transform``), with the hash functions of the feature's id mode
(``FeatureSpec.id_mode``, :class:`~shared.features.IdMode`; chosen once, in :data:`_ID_HASHES`):

- ``MOD``: non-negative integer id → ``id % num_buckets``. Integer strings are parsed.
- ``HASH``: the mode's string hash of the value's string form (integers: their decimal digits, so
  the string ``"7"`` and the integer ``7`` agree) → ``% hash_bucket_size``. DYNREC:
  :func:`~shared.fg_text.hash64` (FNV-1a + SplitMix64); TZREC: :func:`~shared.fg_text.std_hash`
  (libstdc++'s ``std::hash<std::string>``, as pyfg). Hashing runs on the distinct values only,
  mapped back by index.
- ``DYNAMIC``: DYNREC: the raw non-negative int64 id; strings → ``hash64(s) & (2**63 - 1)``.
  TZREC: every id as pyfg keys dynamic tables, ``std_hash(str(id)) % (2**63 - 1)`` (integers
  hashed by their decimal digits, negative ones too).
- ``BUCKETIZE``: float → number of boundaries ``<= x`` (``searchsorted(..., side="right")``), i.e.
  bucket ``i`` holds ``[boundaries[i-1], boundaries[i])``; a value equal to a boundary goes to the
  bucket above it. Boundaries are compared as written in the config (the proto's float32 1.1 is
  read back as the decimal 1.1). Integer and numeric-string columns are accepted; an integer
  (any int64 or uint64) is compared as its nearest double.

Serving values (:func:`request_columns_to_batch`) are Python lists (None = missing), numpy or
Arrow arrays. A list may mix kinds, as the protocol allows (a DYNAMIC id as int64 or string, a
HASH value as string or int64, a price as double or int64): each value gets exactly the ids it
would get in a column of its own kind (the list becomes an Arrow union, one child per kind, and
each child goes through the column functions on its own). Integers beyond int64 become uint64
(a price gets its bucket, an id is refused).

Missing values and bad data (every default is counted in :class:`FgStats`):

- A null scalar → an empty bag (length 0: the model sees a zero embedding). Counted per feature.
- Sequences: a string column holds tokens joined by ``sequence_delim`` (most recent last); list
  columns (``list<int>``) are taken as they are. A row whose sub-sequence strings are all empty
  (or null) is an empty sequence. Otherwise an empty token (e.g. ``"12||7"``, or ``""`` beside a
  one-element sibling: a clicked ad without brand) or a null list element is the *missing* token
  and gets id 0 whatever the transform; counted per feature. Sub-sequences of one sequence must
  have equal lengths per row (else :class:`FeatureError`).
- A sequence longer than ``sequence_length``: training keeps the last ``sequence_length``
  elements (counted per sequence); serving raises :class:`FeatureError`.
- :class:`FeatureError` (naming the column) for: a missing column/key, a wrong type (float or bool
  ids, an unparsable string, bytes, anything pyarrow cannot convert), a negative MOD/DYNAMIC id,
  an id outside int64 (an integer outside uint64 anywhere), a malformed sequence token, a
  sequence list mixing kinds, a NaN/infinite/negative price, a null label. It is the only
  exception bad values raise; its message is at most about 1,000 characters.
"""

from __future__ import annotations

import functools
import itertools
import reprlib
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch
from shared.features import FeatureKind, FeatureSet, FeatureSpec, IdMode, IdTransform, Side
from shared.fg_text import (
    INT64_MAX,
    TokenError,
    Tokens,
    hash64,
    hash_strings,
    split_int_tokens,
    std_hash,
    string_buffers,
)

ORACLE_COLUMN = "_oracle_p"
__all__ = [
    "ORACLE_COLUMN",
    "FeatureError",
    "FgStats",
    "hash64",
    "per_feature_set",
    "request_columns_to_batch",
    "request_to_batch",
    "scalar_ids",
    "sequence_ids",
    "table_to_batch",
]


_MAX_MESSAGE = 1000  # characters: a hostile value quoted in a message stays short


class FeatureError(ValueError):
    """A raw value that feature generation cannot turn into ids; ``field`` names the column.

    The message is cut to ``_MAX_MESSAGE`` characters (it may quote a client's multi-megabyte
    string, and the server returns it in a gRPC status).
    """

    def __init__(self, field: str, message: str) -> None:
        if len(message) > _MAX_MESSAGE:
            message = f"{message[:_MAX_MESSAGE]}... ({len(message) - _MAX_MESSAGE} more characters)"
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class FgStats:
    """Counts of the documented defaults applied to bad or missing data (see module doc)."""

    rows: int = 0
    missing: Counter[str] = field(default_factory=Counter)  # null scalar → empty bag
    missing_tokens: Counter[str] = field(default_factory=Counter)  # empty sequence token → id 0
    truncated: Counter[str] = field(default_factory=Counter)  # rows whose sequence was cut

    def merge(self, other: FgStats) -> None:
        self.rows += other.rows
        self.missing.update(other.missing)
        self.missing_tokens.update(other.missing_tokens)
        self.truncated.update(other.truncated)

    def as_dict(self) -> dict[str, object]:
        return {
            "rows": self.rows,
            "missing": dict(self.missing),
            "missing_tokens": dict(self.missing_tokens),
            "truncated": dict(self.truncated),
        }

    def report(self) -> str:
        lines = [f"feature generation: {self.rows} rows"]
        for what, counter in (
            ("null value -> empty bag", self.missing),
            ("empty sequence token -> id 0", self.missing_tokens),
            ("sequence longer than sequence_length -> kept the last", self.truncated),
        ):
            for name, n in sorted(counter.items()):
                lines.append(f"  {name}: {n} x {what} ({n / max(self.rows, 1):.2%} of rows)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- column helpers


def _combine(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous plain array: chunks combined, dictionaries decoded, views made plain."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_string_view(col.type):
        col = col.cast(pa.large_string())
    if pa.types.is_null(col.type):  # all-missing (e.g. a serving value None)
        col = pa.nulls(len(col), pa.int64())
    return col


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _valid_mask(arr: pa.Array) -> np.ndarray | None:
    """Bool mask of non-null rows (from the validity bitmap), or None when there are no nulls."""
    if arr.null_count == 0:
        return None
    first, n = arr.offset, len(arr)
    bits = np.frombuffer(arr.buffers()[0], dtype=np.uint8)[first // 8 : (first + n + 7) // 8]
    return np.unpackbits(bits, bitorder="little")[first % 8 : first % 8 + n].view(bool)


def _values_ignoring_nulls(arr: pa.Array) -> np.ndarray:
    """The value buffer of a fixed-width numeric array, zero-copy (null slots hold garbage)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + len(arr)]


def _to_int64(name: str, arr: pa.Array) -> np.ndarray:
    """Integer (or integer-string) array without nulls → int64 ndarray, range-checked."""
    t = arr.type
    if _is_string(t):
        try:
            return np.asarray(pc.cast(arr, pa.int64()))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise FeatureError(name, f"not an integer id, or outside int64: {e}") from None
    top = pc.max(arr).as_py() if pa.types.is_uint64(t) and len(arr) else 0
    if top > INT64_MAX:
        raise FeatureError(name, f"id {top} is outside int64")
    if not pa.types.is_integer(t):
        raise FeatureError(
            name, f"has type {t}; ids must be integers or strings (floats and bools are refused)"
        )
    return np.asarray(arr).astype(np.int64, copy=False)


def _hash_size(spec: FeatureSpec) -> np.ndarray:
    if not spec.hash_bucket_size:
        raise FeatureError(spec.name, "HASH transform without hash_bucket_size")
    return np.asarray(spec.hash_bucket_size, np.uint64)


@dataclass(frozen=True)
class _IdHashes:
    """The hash functions of one :class:`~shared.features.IdMode` (see :data:`_ID_HASHES`)."""

    string_hash: Callable[[pa.Array], np.ndarray]  # distinct strings → uint64
    dynamic_key: Callable[[np.ndarray], np.ndarray]  # uint64 string hash → int64 key < 2**63
    hash_dynamic_ints: bool  # DYNAMIC integer ids: hashed as their digits (else kept raw, >= 0)


_INT64_MAX_U = np.uint64(INT64_MAX)
# each mode's functions, picked once per column by the feature's id_mode: the transforms below
# never ask which mode they run in
_ID_HASHES: dict[IdMode, _IdHashes] = {
    IdMode.DYNREC: _IdHashes(hash64, lambda h: (h & _INT64_MAX_U).astype(np.int64), False),
    # pyfg: hash_bucket_size = 2**63 - 1 on dynamicemb features (tzrec id_feature.py _fg_json)
    IdMode.TZREC: _IdHashes(std_hash, lambda h: (h % _INT64_MAX_U).astype(np.int64), True),
}


def _int_hashes(ints: np.ndarray, hashes: _IdHashes) -> np.ndarray:
    """The string hash of each integer's decimal digits (uint64), computed per distinct value."""
    uniq, inv = np.unique(ints, return_inverse=True)
    return hashes.string_hash(pc.cast(pa.array(uniq), pa.string()))[inv]


@dataclass(frozen=True)
class _IntIds:
    """How the integer ids of one feature become ids, decided once (:func:`_int_ids`).

    ``array``: int64 ndarray → ids (raises on negative MOD/raw DYNAMIC ids); ``one``: the same
    for one Python int in ``[0, 2**63)``, without numpy, or None where the ids are hashed.
    """

    array: Callable[[np.ndarray], np.ndarray]
    one: Callable[[int], int] | None = None


def _int_ids(spec: FeatureSpec) -> _IntIds:
    hashes = _ID_HASHES[spec.id_mode]
    if spec.transform is IdTransform.HASH:
        return _IntIds(lambda ints: (_int_hashes(ints, hashes) % _hash_size(spec)).astype(np.int64))
    if spec.transform is IdTransform.DYNAMIC and hashes.hash_dynamic_ints:
        return _IntIds(lambda ints: hashes.dynamic_key(_int_hashes(ints, hashes)))
    if spec.transform is IdTransform.MOD:
        size = spec.num_buckets
        one = (lambda v: v % size) if size else None
        return _IntIds(lambda ints: _non_negative(spec, ints) % size, one)
    if spec.transform is IdTransform.DYNAMIC:
        return _IntIds(lambda ints: _non_negative(spec, ints), lambda v: v)

    def refuse(ints: np.ndarray) -> np.ndarray:
        _non_negative(spec, ints)
        raise FeatureError(spec.name, f"transform {spec.transform.value} does not apply to ids")

    return _IntIds(refuse)


def _non_negative(spec: FeatureSpec, ints: np.ndarray) -> np.ndarray:
    if len(ints) and int(ints.min()) < 0:
        raise FeatureError(spec.name, f"negative id {int(ints.min())}; ids must be >= 0")
    return ints


def _ints_to_ids(spec: FeatureSpec, ints: np.ndarray) -> np.ndarray:
    """Transform integer ids (int64 ndarray) of ``spec``; raises on negative MOD/raw DYNAMIC ids."""
    return _int_ids(spec).array(ints)


def _strings_to_ids(spec: FeatureSpec, strings: pa.Array) -> np.ndarray:
    hashes = _ID_HASHES[spec.id_mode]
    if spec.transform is IdTransform.HASH:
        return (hash_strings(strings, hashes.string_hash) % _hash_size(spec)).astype(np.int64)
    if spec.transform is IdTransform.DYNAMIC:
        return hashes.dynamic_key(hash_strings(strings, hashes.string_hash))
    return _ints_to_ids(spec, _to_int64(spec.name, strings))


def _bucketize(spec: FeatureSpec, arr: pa.Array) -> np.ndarray:
    t = arr.type
    if _is_string(t):
        try:
            floats = pc.cast(arr, pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise FeatureError(spec.name, f"not a number: {e}") from None
    elif pa.types.is_integer(t):  # any int64/uint64: the nearest double (beyond 2**53, too)
        floats = arr.cast(pa.float64(), safe=False)
    elif pa.types.is_floating(t):
        floats = arr.cast(pa.float64())
    else:
        raise FeatureError(spec.name, f"has type {t}; expected a number")
    x = np.asarray(floats)
    ids = _bucket_ids(spec, x)
    if ids is None:
        value = arr[int(np.argmax(~(np.isfinite(x) & (x >= 0))))].as_py()
        raise FeatureError(spec.name, f"value {value!r} is NaN, infinite or negative")
    return ids


def _bucket_ids(spec: FeatureSpec, x: np.ndarray) -> np.ndarray | None:
    """The buckets of float64 prices ``x``; None if one is NaN, infinite or negative."""
    if not (np.isfinite(x) & (x >= 0)).all():
        return None
    return np.searchsorted(_decimal_boundaries(spec.boundaries), x, side="right").astype(np.int64)


@functools.lru_cache(maxsize=64)
def _decimal_boundaries(boundaries: tuple[float, ...]) -> np.ndarray:
    """The config's boundaries as written: the proto stores float32 (1.1 → 1.100000023841858);
    the shortest decimal that round-trips each float32 gives back 1.1, so that a price equal to
    a written boundary lands in the bucket above it."""
    return np.array(
        [float(np.format_float_positional(np.float32(b), unique=True)) for b in boundaries]
    )


def scalar_ids(
    spec: FeatureSpec, col: pa.Array | pa.ChunkedArray, stats: FgStats | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One scalar column → (ids int64 [present rows], lengths int32 [rows]); null → length 0.

    A union column (values of several kinds, see :func:`_request_array`) gives each value the
    ids of its own kind: every child goes through this function on its own.
    """
    arr = _combine(col)
    if pa.types.is_union(arr.type):
        return _union_ids(spec, arr, stats)
    n = len(arr)
    valid = _valid_mask(arr)
    if valid is not None and stats is not None:
        stats.missing[spec.name] += arr.null_count
    if valid is not None and (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        arr = pa.array(_values_ignoring_nulls(arr)[valid])  # cheaper than Array.filter
    elif valid is not None:
        arr = arr.filter(pa.array(valid))
    if spec.transform is IdTransform.BUCKETIZE:
        ids = _bucketize(spec, arr)
    elif _is_string(arr.type):
        ids = _strings_to_ids(spec, arr)
    else:
        ids = _ints_to_ids(spec, _to_int64(spec.name, arr))
    lengths = np.ones(n, np.int32) if valid is None else valid.astype(np.int32)
    return ids, lengths


def _union_ids(
    spec: FeatureSpec, arr: pa.UnionArray, stats: FgStats | None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`scalar_ids` of a union column: each child's ids, put back in row order."""
    rows_at = slice(arr.offset, arr.offset + len(arr))  # the buffers (type_codes ignores slices)
    codes = np.frombuffer(arr.buffers()[1], np.int8)[rows_at]
    slots: np.ndarray  # row → slot in its child
    if arr.type.mode == "dense":
        slots = np.frombuffer(arr.buffers()[2], np.int32)[rows_at]
    else:  # a sparse union's children are sliced with it
        slots = np.arange(len(arr))
    ids = np.zeros(len(arr), np.int64)
    lengths = np.zeros(len(arr), np.int32)
    for child, code in enumerate(arr.type.type_codes):
        rows = np.flatnonzero(codes == code)
        if not len(rows):
            continue
        child_ids, child_lengths = scalar_ids(spec, arr.field(child))
        by_slot = np.zeros(len(child_lengths), np.int64)
        by_slot[child_lengths == 1] = child_ids
        ids[rows], lengths[rows] = by_slot[slots[rows]], child_lengths[slots[rows]]
    if stats is not None and not lengths.all():
        stats.missing[spec.name] += int((lengths == 0).sum())
    return ids[lengths == 1], lengths


# --------------------------------------------------------------------------- sequences


def _split(spec: FeatureSpec, arr: pa.Array, delim: int, one_empty: np.ndarray) -> Tokens:
    try:
        return split_int_tokens(arr, delim, one_empty)
    except TokenError as e:
        raise FeatureError(spec.name, str(e)) from None


def _list_tokens(name: str, arr: pa.Array) -> Tokens:
    """A list<int> column (serving requests, or list-typed Parquet) → tokens; null → missing."""
    if arr.null_count:
        arr = pc.fill_null(arr, pa.scalar([], arr.type))
    lengths = np.diff(np.asarray(arr.offsets)).astype(np.int64)
    vals = arr.flatten()
    if pa.types.is_null(vals.type):
        vals = pa.nulls(len(vals), pa.int64())
    valid = _valid_mask(vals)
    missing = np.zeros(len(vals), bool) if valid is None else ~valid
    if _is_string(vals.type):
        missing |= np.asarray(pc.equal(pc.fill_null(vals, ""), ""))
    ints = np.zeros(len(vals), np.int64)
    if (~missing).any():
        ints[~missing] = _to_int64(name, vals.filter(pa.array(~missing)))
        if int(ints.min()) < 0:
            raise FeatureError(name, f"negative id {int(ints.min())} in a sequence")
    return Tokens(lengths, ints, missing)


def _tokens_to_ids(spec: FeatureSpec, tok: Tokens) -> np.ndarray:
    ids = _ints_to_ids(spec, tok.ints)
    ids[tok.missing] = 0
    return ids


def _sequence_tokens(specs: Sequence[FeatureSpec], arrs: list[pa.Array]) -> list[Tokens]:
    """Split/parse each sub-feature column; their lengths must agree row by row."""
    # a row whose sub-sequence strings are all empty is an empty sequence; elsewhere an empty
    # string is one missing token (a one-element sequence whose e.g. brand is missing)
    all_empty = np.ones(len(arrs[0]), bool)
    for a in arrs:
        all_empty &= np.diff(string_buffers(a)[0]) == 0 if _is_string(a.type) else False
    tokens: list[Tokens] = []
    for spec, a in zip(specs, arrs, strict=True):
        if _is_string(a.type):
            delim = (spec.sequence_delim or "|").encode()
            if len(delim) != 1:
                raise FeatureError(
                    spec.name, f"sequence_delim {spec.sequence_delim!r} must be one byte"
                )
            one_empty = (np.diff(string_buffers(a)[0]) == 0) & ~all_empty
            tokens.append(_split(spec, a, delim[0], one_empty))
        elif pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
            tokens.append(_list_tokens(spec.name, a))
        else:
            raise FeatureError(
                spec.name, f"has type {a.type}; expected a delimited string or a list"
            )
    for spec, tok in zip(specs[1:], tokens[1:], strict=True):
        if not np.array_equal(tok.lengths, tokens[0].lengths):
            row = int(np.flatnonzero(tok.lengths != tokens[0].lengths)[0])
            raise FeatureError(
                spec.name,
                f"row {row} has {tok.lengths[row]} elements but {specs[0].name} has "
                f"{tokens[0].lengths[row]}; the sub-sequences of one sequence must be aligned",
            )
    return tokens


def sequence_ids(
    specs: Sequence[FeatureSpec],
    cols: Sequence[pa.Array | pa.ChunkedArray],
    *,
    truncate: bool,
    stats: FgStats | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The aligned sub-features of one sequence → per sub-feature (ids int64, lengths int32).

    ``truncate``: keep the last ``sequence_length`` elements (training) instead of raising.
    """
    arrs = [_combine(c) for c in cols]
    arrs = [pc.fill_null(a, "") if _is_string(a.type) and a.null_count else a for a in arrs]
    tokens = _sequence_tokens(specs, arrs)
    lengths = tokens[0].lengths
    cap = int(specs[0].sequence_length or 0)
    keep: np.ndarray | None = None
    if cap and len(lengths) and int(lengths.max()) > cap:
        long_rows = lengths > cap
        if not truncate:
            row = int(np.flatnonzero(long_rows)[0])
            raise FeatureError(
                specs[0].name,
                f"{lengths[row]} elements exceed sequence_length {cap}; send the last {cap}",
            )
        ends = np.repeat(np.cumsum(lengths), lengths)
        keep = (ends - np.arange(len(ends))) <= cap  # position from the end < cap
        lengths = np.minimum(lengths, cap)
        if stats is not None:
            stats.truncated[specs[0].sequence_name or specs[0].name] += int(long_rows.sum())
    out = []
    for spec, tok in zip(specs, tokens, strict=True):
        ids, missing = _tokens_to_ids(spec, tok), tok.missing
        if keep is not None:
            ids, missing = ids[keep], missing[keep]
        if stats is not None and missing.any():
            stats.missing_tokens[spec.name] += int(missing.sum())
        out.append((ids, lengths.astype(np.int32)))
    return out


# --------------------------------------------------------------------------- batches


def _kjt(
    keys: list[str], parts: list[tuple[np.ndarray, np.ndarray]], stride: int
) -> KeyedJaggedTensor:
    """KJT from per-key (values, lengths [stride]); values key-major, as torchrec expects."""
    values = np.concatenate([v for v, _ in parts]) if parts else np.zeros(0, np.int64)
    lengths = np.concatenate([ln for _, ln in parts]) if parts else np.zeros(0, np.int32)
    per_key = [len(v) for v, _ in parts]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
        lengths=torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int32)),
        stride=stride,
        length_per_key=per_key,
        offset_per_key=list(itertools.accumulate(per_key, initial=0)),
    )


_Ids: TypeAlias = tuple[np.ndarray, np.ndarray]  # (ids int64 [present rows], lengths [rows])
_STRING_CACHE = 4096  # distinct USER/CONTEXT strings whose ids a plan keeps, per feature
_CACHED_CHARS = 256  # longer strings are hashed every time


@dataclass(frozen=True)
class _Plan:
    """Where each feature of a FeatureSet goes in a Batch, worked out once (:func:`_plan`).

    ``strings`` holds, per USER/CONTEXT feature, the ids of string values seen (a request's
    ``pid`` is hashed once, not once per request); ids depend on the value and the spec alone.
    """

    user: tuple[FeatureSpec, ...]  # USER scalars in config order: the keys of Batch.user
    context: tuple[FeatureSpec, ...]
    items: tuple[FeatureSpec, ...]  # ITEM scalars
    item_kjt: tuple[FeatureSpec, ...]  # ITEM and CONTEXT scalars in config order: Batch.item
    sequences: tuple[tuple[FeatureSpec, ...], ...]  # sub-features of each sequence
    sequence_keys: tuple[str, ...]  # the keys of Batch.sequence (config order)
    sequence_order: tuple[int, ...]  # position in the flattened groups of each key
    ints: dict[str, _IntIds]  # every feature's integer transform
    strings: dict[str, dict[str, np.ndarray]]

    @classmethod
    def of(cls, fs: FeatureSet) -> _Plan:
        groups: dict[str, list[FeatureSpec]] = {}
        for spec in fs.features.values():
            if spec.kind is FeatureKind.SEQUENCE_ID:
                groups.setdefault(spec.sequence_name or spec.name, []).append(spec)
        flat = [s.name for specs in groups.values() for s in specs]
        position = {name: i for i, name in enumerate(fs.features)}
        order = sorted(range(len(flat)), key=lambda i: position[flat[i]])
        scalars = [s for s in fs.features.values() if not s.is_sequence]

        def side(*sides: Side) -> tuple[FeatureSpec, ...]:
            return tuple(s for s in scalars if s.side in sides)

        return cls(
            user=side(Side.USER),
            context=side(Side.CONTEXT),
            items=side(Side.ITEM),
            item_kjt=side(Side.ITEM, Side.CONTEXT),
            sequences=tuple(tuple(specs) for specs in groups.values()),
            sequence_keys=tuple(flat[i] for i in order),
            sequence_order=tuple(order),
            ints={s.name: _int_ids(s) for s in fs.features.values()},
            strings={s.name: {} for s in side(Side.USER, Side.CONTEXT)},
        )


_T = TypeVar("_T")


def per_feature_set(build: Callable[[FeatureSet], _T]) -> Callable[[FeatureSet], _T]:
    """``build(fs)`` once per FeatureSet object (a bundle's: at its first request), for what
    every request needs of ``fs``: a FeatureSet is not changed once built.

    A FeatureSet holds dicts (not hashable), so entries are kept by ``id(fs)`` and dropped when
    their FeatureSet is collected. Example: ``_plan = per_feature_set(_Plan.of)``.
    """
    cache: dict[int, tuple[weakref.ref[FeatureSet], _T]] = {}

    def cached(fs: FeatureSet) -> _T:
        key = id(fs)
        entry = cache.get(key)
        if entry is not None and entry[0]() is fs:
            return entry[1]
        value = build(fs)
        cache[key] = (weakref.ref(fs, lambda _: cache.pop(key, None)), value)
        return value

    return cached


_plan = per_feature_set(_Plan.of)


def _sequence_kjt(
    plan: _Plan, ids_of: Callable[[tuple[FeatureSpec, ...]], list[_Ids]], stride: int
) -> KeyedJaggedTensor:
    """Batch.sequence from ``ids_of(sub-features)`` of each sequence."""
    parts = [part for specs in plan.sequences for part in ids_of(specs)]
    return _kjt(list(plan.sequence_keys), [parts[i] for i in plan.sequence_order], stride)


def _scalar_kjt(
    specs: tuple[FeatureSpec, ...], get: dict[str, pa.Array], stride: int, stats: FgStats | None
) -> KeyedJaggedTensor:
    return _kjt([s.name for s in specs], [scalar_ids(s, get[s.name], stats) for s in specs], stride)


def _column(table: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    if name not in table.schema.names:
        raise FeatureError(
            name, f"column missing from the input (it has: {', '.join(table.schema.names)})"
        )
    return _combine(table.column(name))


def _float_column(table: pa.Table | pa.RecordBatch, name: str) -> torch.Tensor:
    col = _column(table, name)
    if col.null_count:
        raise FeatureError(name, f"{col.null_count} null values; labels must be present")
    if not (
        pa.types.is_integer(col.type)
        or pa.types.is_floating(col.type)
        or pa.types.is_boolean(col.type)
    ):
        raise FeatureError(name, f"has type {col.type}; expected a number")
    return torch.from_numpy(np.asarray(col.cast(pa.float32())).copy())


def table_to_batch(
    fs: FeatureSet, table: pa.Table | pa.RecordBatch, *, stats: FgStats | None = None
) -> Batch:
    """Training rows → Batch (U == B: one user row per sample, ``user_index = arange(B)``).

    Needs one column per feature (named as the feature) and the label fields; ``_oracle_p``
    becomes ``Batch.oracle`` when present. Example::

        batch = table_to_batch(fs, pq.read_table("samples/train/part-00000.parquet"))
    """
    n = table.num_rows
    cols = {name: _column(table, name) for name in fs.features}
    if len(fs.label_fields) != 1:
        raise FeatureError(",".join(fs.label_fields), "exactly one label field is supported")
    labels = _float_column(table, fs.label_fields[0])
    oracle = _float_column(table, ORACLE_COLUMN) if ORACLE_COLUMN in table.schema.names else None
    plan = _plan(fs)

    def seq_ids(specs: tuple[FeatureSpec, ...]) -> list[_Ids]:
        return sequence_ids(specs, [cols[s.name] for s in specs], truncate=True, stats=stats)

    batch = Batch(
        user=_scalar_kjt(plan.user, cols, n, stats),
        item=_scalar_kjt(plan.item_kjt, cols, n, stats),
        sequence=_sequence_kjt(plan, seq_ids, n),
        user_index=torch.arange(n, dtype=torch.int64),
        labels=labels,
        oracle=oracle,
        rows_are_users=True,
    )
    if stats is not None:
        stats.rows += n
    return batch


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
_Column: TypeAlias = np.ndarray | pa.Array | _Ids | int
_NUMERIC = (np.dtype(np.int64), np.dtype(np.float64))
_INT64, _FLOAT64 = pa.int64(), pa.float64()
_INT64_MIN = -INT64_MAX - 1


def _numeric(arr: pa.Array) -> np.ndarray | pa.Array:
    """A null-free int64/float64 Arrow array as a zero-copy ndarray; any other as it is."""
    if arr.null_count == 0 and (arr.type == _INT64 or arr.type == _FLOAT64):
        return _values_ignoring_nulls(arr)
    return arr


def _numeric_ids(plan: _Plan, spec: FeatureSpec, values: np.ndarray) -> np.ndarray | None:
    """What :func:`scalar_ids` gives a null-free int64/float64 column (the same functions, no
    Arrow); None where the column needs :func:`scalar_ids` (float ids, a bad price)."""
    if spec.transform is IdTransform.BUCKETIZE:  # ints: their nearest double, as Arrow casts
        return _bucket_ids(spec, values.astype(np.float64, copy=False))
    if values.dtype == np.int64:
        return plan.ints[spec.name].array(values)
    return None


def _column_ids(plan: _Plan, spec: FeatureSpec, col: _Column, stats: FgStats | None) -> _Ids:
    """:func:`scalar_ids` of a request column (numeric columns without Arrow)."""
    if isinstance(col, int):
        return np.array([col], np.int64), np.ones(1, np.int32)
    if isinstance(col, tuple):
        return col
    if isinstance(col, np.ndarray):
        ids = _numeric_ids(plan, spec, col)
        if ids is not None:
            return ids, np.ones(len(col), np.int32)
        col = pa.array(col)  # its error, as scalar_ids raises it
    return scalar_ids(spec, col, stats)


def _scalar_column(plan: _Plan, spec: FeatureSpec, value: object, rows: int) -> _Column:
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
    return np.full(rows, ids[0], np.int64), np.ones(rows, np.int32)


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
        return _numeric(_combine(column))  # used as it is
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
    plan: _Plan,
    specs: tuple[FeatureSpec, ...],
    cols: list[np.ndarray | pa.Array],
    stats: FgStats | None,
) -> list[_Ids]:
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
        for spec in _plan(fs).items
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
    for spec in plan.user:
        cols[spec.name] = _scalar_column(plan, spec, _need(user, spec.name, "user"), 1)
    for spec in plan.context:
        cols[spec.name] = _scalar_column(plan, spec, _need(context, spec.name, "context"), n)
    for spec in plan.items:
        cols[spec.name] = _item_column(spec.name, items.get(spec.name), n)
    seqs = {
        spec.name: _sequence_column(spec.name, _need(sequences, spec.name, "sequences"))
        for specs in plan.sequences
        for spec in specs
    }

    def seq_ids(specs: tuple[FeatureSpec, ...]) -> list[_Ids]:
        return _request_sequence_ids(plan, specs, [seqs[s.name] for s in specs], stats)

    def kjt(specs: tuple[FeatureSpec, ...], stride: int) -> KeyedJaggedTensor:
        parts = [_column_ids(plan, s, cols[s.name], stats) for s in specs]
        return _kjt([s.name for s in specs], parts, stride)

    batch = Batch(
        user=kjt(plan.user, 1),
        item=kjt(plan.item_kjt, n),
        sequence=_sequence_kjt(plan, seq_ids, 1),
        user_index=torch.zeros(n, dtype=torch.int64),
    )
    if stats is not None:
        stats.rows += n
    return batch
