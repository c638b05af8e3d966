"""Feature generation: raw column values → the id tensors of a :class:`~shared.batch.Batch`.

The column functions here (:func:`scalar_ids`, :func:`sequence_ids`) are the one place raw values
become ids: training (:func:`table_to_batch`, a Parquet record batch of B rows) calls them, and so
does serving (:func:`shared.fg_request.request_to_batch`, one user with N candidates), so a row
gives bit-identical ids on both sides. Where each feature goes in a Batch is :mod:`shared.fg_plan`.
Everything is vectorized over rows (pyarrow / numpy); the only Python loops run over features, over
the distinct lengths of long tokens, or over the byte positions of distinct hashed strings (and the
rest of a few long ones, see :func:`~shared.fg_text.hash64`).

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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch
from shared.features import FeatureSet, FeatureSpec, IdMode, IdTransform
from shared.fg_plan import Ids, feature_plan, kjt, sequence_kjt
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
    "IntIds",
    "bucket_ids",
    "hash64",
    "int_ids",
    "plain_array",
    "scalar_ids",
    "sequence_ids",
    "table_to_batch",
    "values_ignoring_nulls",
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


def plain_array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
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


def values_ignoring_nulls(arr: pa.Array) -> np.ndarray:
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
class IntIds:
    """How the integer ids of one feature become ids, decided once (:func:`_int_ids`).

    ``array``: int64 ndarray → ids (raises on negative MOD/raw DYNAMIC ids); ``one``: the same
    for one Python int in ``[0, 2**63)``, without numpy, or None where the ids are hashed.
    """

    array: Callable[[np.ndarray], np.ndarray]
    one: Callable[[int], int] | None = None


def int_ids(spec: FeatureSpec) -> IntIds:
    hashes = _ID_HASHES[spec.id_mode]
    if spec.transform is IdTransform.HASH:
        return IntIds(lambda ints: (_int_hashes(ints, hashes) % _hash_size(spec)).astype(np.int64))
    if spec.transform is IdTransform.DYNAMIC and hashes.hash_dynamic_ints:
        return IntIds(lambda ints: hashes.dynamic_key(_int_hashes(ints, hashes)))
    if spec.transform is IdTransform.MOD:
        size = spec.num_buckets
        one = (lambda v: v % size) if size else None
        return IntIds(lambda ints: _non_negative(spec, ints) % size, one)
    if spec.transform is IdTransform.DYNAMIC:
        return IntIds(lambda ints: _non_negative(spec, ints), lambda v: v)

    def refuse(ints: np.ndarray) -> np.ndarray:
        _non_negative(spec, ints)
        raise FeatureError(spec.name, f"transform {spec.transform.value} does not apply to ids")

    return IntIds(refuse)


def _non_negative(spec: FeatureSpec, ints: np.ndarray) -> np.ndarray:
    if len(ints) and int(ints.min()) < 0:
        raise FeatureError(spec.name, f"negative id {int(ints.min())}; ids must be >= 0")
    return ints


def _ints_to_ids(spec: FeatureSpec, ints: np.ndarray) -> np.ndarray:
    """Transform integer ids (int64 ndarray) of ``spec``; raises on negative MOD/raw DYNAMIC ids."""
    return int_ids(spec).array(ints)


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
    ids = bucket_ids(spec, x)
    if ids is None:
        value = arr[int(np.argmax(~(np.isfinite(x) & (x >= 0))))].as_py()
        raise FeatureError(spec.name, f"value {value!r} is NaN, infinite or negative")
    return ids


# the bits of +inf: those of every finite double >= 0 are below them (as uint64), those of a
# negative one (the sign bit), an infinity or a NaN (the exponent's bits all set) are not
_INF_BITS = np.uint64(0x7FF0000000000000)
# below this many prices one searchsorted beats the table's dozen numpy calls (a serving request:
# 500 prices 8.8 against 21.9 us; 8192: 133 against 59 us; 2026-12-02)
_TABLE_MIN = 2048


def bucket_ids(spec: FeatureSpec, x: np.ndarray) -> np.ndarray | None:
    """The buckets of float64 prices ``x``; None if one is NaN, infinite or negative."""
    bits = (x + 0.0).view(np.uint64)  # + 0.0: -0.0 is 0.0, a valid price
    if bits.size and bits.max() >= _INF_BITS:  # one pass for isfinite(x) & (x >= 0)
        return None
    table = _bucket_table(spec.boundaries) if x.ndim == 1 and x.size >= _TABLE_MIN else None
    if table is None:
        return np.searchsorted(_decimal_boundaries(spec.boundaries), x, side="right").astype(
            np.int64
        )
    return table.buckets(x)


@dataclass(frozen=True)
class _BucketTable:
    """``searchsorted(boundaries, x, side="right")`` for finite ``x >= 0`` by a table lookup.

    A non-negative double's bit pattern (int64) grows with its value, so its top bits name a
    *cell* of values (``bits >> shift``), and ``low``/``high`` count the boundaries below ``x``'s
    cell and below the next one. Where they agree (no boundary in the cell) that count is the
    answer; the few others are searched. The same buckets as the search, at a fraction of its
    cost (its branches mispredict on every level for random prices).
    """

    boundaries: np.ndarray  # float64, ascending, finite, >= 0
    shift: int
    first: int  # cell of the first boundary
    low: np.ndarray  # int64 [cells + 2]: boundaries below cell ``first + j - 1``
    high: np.ndarray  # int64 [cells + 2]: boundaries below the cell after it

    def buckets(self, x: np.ndarray) -> np.ndarray:
        j = ((x + 0.0).view(np.int64) >> self.shift) - (self.first - 1)  # + 0.0: -0.0 is 0.0
        np.clip(j, 0, len(self.low) - 1, out=j)  # 0: below the first cell, last: above all
        lo, hi = self.low[j], self.high[j]
        todo = np.flatnonzero(lo != hi)  # a boundary in the cell
        if len(todo):
            lo[todo] = np.searchsorted(self.boundaries, x[todo], side="right")
        return lo


@functools.lru_cache(maxsize=64)
def _bucket_table(boundaries: tuple[float, ...]) -> _BucketTable | None:
    """The lookup of :func:`bucket_ids` for ``boundaries``; None where they do not suit it
    (a negative or unsorted boundary: the bits would not order them)."""
    b = _decimal_boundaries(boundaries)
    if not len(b) or not (np.isfinite(b).all() and b[0] >= 0 and (np.diff(b) >= 0).all()):
        return None
    bits = (b + 0.0).view(np.int64)
    shift = 44  # cells of 2**-8 of an octave
    while (bits[-1] >> shift) - (bits[0] >> shift) >= 1 << 16:
        shift += 1
    first, last = int(bits[0] >> shift), int(bits[-1] >> shift)
    starts = np.arange(first, last + 2, dtype=np.int64) << np.int64(shift)
    below = np.searchsorted(bits, starts, side="left").astype(np.int64)  # [cells + 1]
    n = np.array([len(b)])
    low = np.concatenate([[0], below[:-1], n])
    high = np.concatenate([[0], below[1:], n])
    return _BucketTable(b, shift, first, low, high)


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

    A union column (a serving column of values of several kinds, see :mod:`shared.fg_request`)
    gives each value the ids of its own kind: every child goes through this function on its own.
    """
    arr = plain_array(col)
    if pa.types.is_union(arr.type):
        return _union_ids(spec, arr, stats)
    n = len(arr)
    valid = _valid_mask(arr)
    if valid is not None and stats is not None:
        stats.missing[spec.name] += arr.null_count
    lengths = np.ones(n, np.int32) if valid is None else valid.astype(np.int32)
    if spec.transform is not IdTransform.BUCKETIZE and pa.types.is_signed_integer(arr.type):
        ints = values_ignoring_nulls(arr)  # numpy throughout: no Arrow array of the present ids
        ints = ints[valid] if valid is not None else ints
        return _ints_to_ids(spec, ints.astype(np.int64, copy=False)), lengths
    if valid is not None and (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        arr = pa.array(values_ignoring_nulls(arr)[valid])  # cheaper than Array.filter
    elif valid is not None:
        arr = arr.filter(pa.array(valid))
    if spec.transform is IdTransform.BUCKETIZE:
        ids = _bucketize(spec, arr)
    elif _is_string(arr.type):
        ids = _strings_to_ids(spec, arr)
    else:
        ids = _ints_to_ids(spec, _to_int64(spec.name, arr))
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
    arrs = [plain_array(c) for c in cols]
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


def _scalar_kjt(
    specs: tuple[FeatureSpec, ...], get: dict[str, pa.Array], stride: int, stats: FgStats | None
) -> KeyedJaggedTensor:
    return kjt([s.name for s in specs], [scalar_ids(s, get[s.name], stats) for s in specs], stride)


def _column(table: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    if name not in table.schema.names:
        raise FeatureError(
            name, f"column missing from the input (it has: {', '.join(table.schema.names)})"
        )
    return plain_array(table.column(name))


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
    plan = feature_plan(fs)

    def seq_ids(specs: tuple[FeatureSpec, ...]) -> list[Ids]:
        return sequence_ids(specs, [cols[s.name] for s in specs], truncate=True, stats=stats)

    batch = Batch(
        user=_scalar_kjt(plan.user, cols, n, stats),
        item=_scalar_kjt(plan.item_kjt, cols, n, stats),
        sequence=sequence_kjt(plan, seq_ids, n),
        user_index=torch.arange(n, dtype=torch.int64),
        labels=labels,
        oracle=oracle,
        rows_are_users=True,
    )
    if stats is not None:
        stats.rows += n
    return batch
