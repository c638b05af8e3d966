"""PredictRequests from real eval rows, laid out the way the served model says.

Which column goes to ``user``, ``context``, ``sequences`` or the ``candidates`` comes from the
server's ``GetModelMetadata`` (:func:`sides_from_metadata`), never from a list in this file. One
request = one eval row's user features, click sequences and context, plus ``num_candidates`` ads:
the row's own ad first (the one impression whose label is known), then ads drawn (seeded) from the
distinct item-feature tuples of the sample rows.

The candidates go in one of the two encodings of ``PredictRequest`` (``columnar``): as
``candidate_columns`` (default: one packed column per item feature, much cheaper for the server
to parse and check) or as ``candidates`` (one ``Features`` map per ad). Both carry the same
candidates, drawn the same way (:func:`columnar_request` turns one into the other).

Requests are serialized once. The work is columnar: every distinct value of a feature becomes its
serialized map entry once, a row's ``Features`` is the concatenation of its entries, and a request
is ``head + candidate field bytes`` (protobuf merges concatenated fields, so this parses to the
same message as building it field by field; the tests check that); a columnar request's columns
are numpy gathers of the candidates' rows. Example::

    md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest())
    pool = build_request_pool(
        "data/samples/eval",
        sides_from_metadata(md),
        value_types=value_types_from_metadata(md),
        sequence_formats=sequence_formats_from_metadata(md),
    )

How a sequence column is written (its ``sequence_delim``) and how many ids the server takes come
from the metadata too (:func:`sequence_formats_from_metadata`, i.e. the bundle's fg.json), so a
config with another delimiter or sequence length needs nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from loadtest.pool import RequestPool
from protos import predict_pb2

SIDES = ("user", "item", "context", "sequence")
VALUE_TYPES = {"int64": pa.int64(), "double": pa.float64(), "string": pa.string()}
# Column kind of candidate_columns per Arrow type, and the placeholder sent in missing rows
_COLUMN_KINDS = {pa.int64(): "int64s", pa.float64(): "doubles", pa.string(): "strings"}
_PLACEHOLDERS = {"int64s": 0, "doubles": 0.0, "strings": ""}
_VALUE_COLUMN = {"int64_value": "int64s", "double_value": "doubles", "string_value": "strings"}
_CANDIDATES_TAG = bytes(
    [predict_pb2.PredictRequest.DESCRIPTOR.fields_by_name["candidates"].number << 3 | 2]
)


def sides_from_metadata(metadata: predict_pb2.ModelMetadata) -> dict[str, str]:
    """Feature name → ``user | item | context | sequence`` (``sequence`` for kind sequence_id)."""
    sides = {}
    for f in metadata.features:
        side = "sequence" if f.kind == "sequence_id" else f.side
        if side not in SIDES:
            raise ValueError(
                f"model metadata: feature {f.name!r} has side {f.side!r} kind {f.kind!r}; "
                f"expected side one of {', '.join(SIDES[:3])} or kind sequence_id; load-test a "
                "server of this dynrec version"
            )
        sides[f.name] = side
    if not sides:
        raise ValueError(
            "model metadata lists no features; check that the server at --host has loaded its "
            "model (see its log)"
        )
    return sides


def value_types_from_metadata(metadata: predict_pb2.ModelMetadata) -> dict[str, str]:
    """Feature name → wire type (``int64 | double | string``) for the non-sequence features."""
    return {
        f.name: f.value_type for f in metadata.features if f.value_type and f.kind != "sequence_id"
    }


@dataclass(frozen=True)
class SequenceFormat:
    """One sequence sub-feature's sample encoding and server limit, from the model metadata.

    ``delimiter`` joins the ids of a string column (the config's ``sequence_delim``; "" when the
    server does not say), ``max_length`` is the most ids the server accepts (0: no limit), and
    ``sequence`` names the sequence in messages.
    """

    sequence: str
    delimiter: str
    max_length: int


def sequence_formats_from_metadata(
    metadata: predict_pb2.ModelMetadata,
) -> dict[str, SequenceFormat]:
    """Sequence sub-feature name → its :class:`SequenceFormat` (``ModelMetadata.sequences``)."""
    return {
        name: SequenceFormat(s.name, s.delimiter, s.max_length)
        for s in metadata.sequences
        for name in s.features
    }


def build_request_pool(
    samples: str | Path,
    feature_sides: Mapping[str, str],
    *,
    value_types: Mapping[str, str] | None = None,
    num_requests: int = 2000,
    num_candidates: int = 100,
    seed: int = 0,
    max_rows: int = 100_000,
    sequence_formats: Mapping[str, SequenceFormat] | None = None,
    columnar: bool = True,
) -> RequestPool:
    """Serialize ``num_requests`` PredictRequests from the first ``max_rows`` rows of ``samples``.

    ``samples`` is a Parquet file or a directory of ``part-*.parquet`` whose columns carry the
    feature names (others, like ``clk``, are ignored). ``value_types`` (from the metadata) casts
    columns to what the server expects; without it the Parquet type decides (int → int64_value,
    float → double_value, string → string_value). Nulls (and NaN) become an unset ``Value``, an
    explicit missing value. Sequence columns are list columns or strings of ids joined by their
    ``sequence_formats`` delimiter (needed for every sequence feature); an empty token is a missing
    id and is sent as 0, and only the most recent ``max_length`` ids are kept (the server rejects
    longer sequences). ``columnar``: candidates as
    ``candidate_columns`` (a null is a ``missing`` row) instead of ``candidates``; the same seed
    draws the same candidates either way.
    """
    _check_pool_args(feature_sides, num_requests, num_candidates)
    formats = _sequence_formats(feature_sides, sequence_formats or {})
    table = _read_rows(Path(samples), list(feature_sides), max_rows)
    by_side = {s: [n for n, side in feature_sides.items() if side == s] for s in SIDES}
    entries = {
        n: _entry_codes(n, table.column(n), (value_types or {}).get(n))
        for s in ("user", "item", "context")
        for n in by_side[s]
    }
    rng = np.random.default_rng(seed)
    rows = rng.choice(table.num_rows, num_requests, replace=table.num_rows < num_requests)
    users = _join_rows([entries[n] for n in by_side["user"]], rows)
    contexts = _join_rows([entries[n] for n in by_side["context"]], rows)
    sequences = _align(
        {n: _jagged_ids(n, table.column(n), formats[n]) for n in by_side["sequence"]}
    )
    item_features = [entries[n] for n in by_side["item"]]
    first, item_of_row = _item_tuples(item_features)
    if columnar:
        columns = {
            n: _column_values(n, table.column(n), (value_types or {}).get(n))
            for n in by_side["item"]
        }
        serialize = _columnar_candidates(columns, first, num_candidates)
    else:
        serialize = _row_candidates(_candidate_fields(item_features, first))
    payloads = []
    for i, r in enumerate(rows):
        req = _request_head(f"loadtest-{i}", users[i], contexts[i], sequences, r)
        others = _draw(rng, len(first), num_candidates - 1)
        items = np.concatenate(([item_of_row[r]], others))  # distinct item tuples
        payloads.append(serialize(req, items))
    info = {
        "samples": str(samples),
        "rows_read": table.num_rows,
        "seed": seed,
        "format": "columnar" if columnar else "rows",
        "sequences": {
            f.sequence: {"delimiter": f.delimiter, "max_length": f.max_length}
            for f in formats.values()
        },
    }
    return RequestPool(payloads, num_candidates, info)


def _check_pool_args(
    feature_sides: Mapping[str, str], num_requests: int, num_candidates: int
) -> None:
    bad = {n: s for n, s in feature_sides.items() if s not in SIDES}
    if bad:
        raise ValueError(f"feature_sides: {bad} not in {SIDES}")
    if num_candidates < 1 or num_requests < 1:
        raise ValueError(
            f"num_candidates ({num_candidates}) and num_requests ({num_requests}) must be >= 1; "
            "pass --candidates and --requests of 1 or more"
        )


def _sequence_formats(
    feature_sides: Mapping[str, str], formats: Mapping[str, SequenceFormat]
) -> dict[str, SequenceFormat]:
    """The format of each sequence feature; ValueError naming those without one."""
    names = [n for n, side in feature_sides.items() if side == "sequence"]
    missing = [n for n in names if n not in formats]
    if missing:
        raise ValueError(
            f"sequence features {missing} have no delimiter and length limit; pass "
            "sequence_formats=sequence_formats_from_metadata(metadata) (the server's "
            "ModelMetadata.sequences lists each sequence's features)"
        )
    return {n: formats[n] for n in names}


def _request_head(
    request_id: str,
    user: bytes,
    context: bytes,
    sequences: dict[str, tuple[np.ndarray, np.ndarray]],
    row: int,
) -> predict_pb2.PredictRequest:
    """A request without its candidates: the serialized ``user`` and ``context`` Features and
    sample row ``row``'s click sequences."""
    req = predict_pb2.PredictRequest(request_id=request_id)
    req.user.MergeFromString(user)
    req.context.MergeFromString(context)
    for name, (values, offsets) in sequences.items():
        req.sequences[name].ids.extend(values[offsets[row] : offsets[row + 1]].tolist())
    return req


# (request head, distinct item tuples of its candidates) -> the serialized request
_Serialize = Callable[[predict_pb2.PredictRequest, np.ndarray], bytes]


def _columnar_candidates(
    columns: dict[str, tuple[str, np.ndarray, np.ndarray]], first: np.ndarray, num_candidates: int
) -> _Serialize:
    """Candidates as ``candidate_columns``: each column gathers the rows ``first[items]`` of
    its (kind, values, missing) in ``columns``."""

    def serialize(req: predict_pb2.PredictRequest, items: np.ndarray) -> bytes:
        cc = req.candidate_columns
        cc.num_candidates = num_candidates
        cand_rows = first[items]  # a sample row of each tuple
        for name, (kind, values, missing) in columns.items():
            _fill_column(cc.columns[name], kind, values[cand_rows], missing[cand_rows])
        return req.SerializeToString()

    return serialize


def _row_candidates(item_fields: np.ndarray) -> _Serialize:
    """Candidates as ``candidates``: the head's bytes, then the serialized ``candidates`` field
    of each item tuple (``item_fields``, from :func:`_candidate_fields`)."""

    def serialize(req: predict_pb2.PredictRequest, items: np.ndarray) -> bytes:
        return req.SerializeToString() + b"".join(item_fields[items])

    return serialize


def columnar_request(
    request: predict_pb2.PredictRequest, value_types: Mapping[str, str] | None = None
) -> predict_pb2.PredictRequest:
    """A copy of ``request`` with its ``candidates`` sent as ``candidate_columns`` instead: the
    same candidates in the same order (an unset Value becomes a ``missing`` row).

    A column's kind is that of its values; a feature missing in every candidate takes its
    ``value_types`` entry (default ``int64``). A feature whose candidates mix kinds (an int and a
    string id) has no column form: ValueError.
    """
    out = predict_pb2.PredictRequest()
    out.CopyFrom(request)
    out.ClearField("candidates")
    cc = out.candidate_columns
    cc.num_candidates = len(request.candidates)
    names = list(dict.fromkeys(n for c in request.candidates for n in c.values))
    for name in names:
        values: list[object] = []
        kinds = set()
        for i, c in enumerate(request.candidates):
            if name not in c.values:
                raise ValueError(f"candidates[{i}] has no {name!r}: every column needs all rows")
            v = c.values[name]
            kind = v.WhichOneof("kind")
            values.append(None if kind is None else getattr(v, kind))
            kinds.add(kind)
        kinds.discard(None)
        if len(kinds) > 1:
            raise ValueError(f"feature {name!r} mixes {sorted(kinds)}: no single column kind")
        vtype = (value_types or {}).get(name, "int64")
        kind = _VALUE_COLUMN[kinds.pop()] if kinds else _COLUMN_KINDS[VALUE_TYPES[vtype]]
        missing = np.array([v is None for v in values], bool)
        placeholder = _PLACEHOLDERS[kind]
        filled = np.empty(len(values), object)
        filled[:] = [placeholder if v is None else v for v in values]
        _fill_column(cc.columns[name], kind, filled, missing)
    return out


# --------------------------------------------------------------------------- columns


def _read_rows(samples: Path, columns: list[str], max_rows: int) -> pa.Table:
    if samples.is_dir():
        files = sorted(samples.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(
                f"no *.parquet files in {samples}; pass the eval samples directory"
            )
        dataset = ds.dataset([str(f) for f in files], format="parquet")
    elif samples.is_file():
        dataset = ds.dataset(str(samples), format="parquet")
    else:
        raise FileNotFoundError(
            f"samples path {samples} does not exist; check --samples (the eval samples directory)"
        )
    missing = [c for c in columns if c not in dataset.schema.names]
    if missing:
        raise ValueError(
            f"{samples}: the model needs columns {missing} that the Parquet files lack "
            f"(they have {dataset.schema.names}); pass the eval samples of the served model "
            "(--samples)"
        )
    table = dataset.head(max_rows, columns=columns)
    if table.num_rows == 0:
        raise ValueError(f"{samples}: no rows; pass samples with rows (--samples)")
    return table


def _entry_codes(
    name: str, column: pa.ChunkedArray, value_type: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """(entries, codes): ``entries[codes[r]]`` is row r's serialized ``Features.values`` entry.

    One protobuf entry per distinct value (plus one for missing), not per row.
    """
    arr = _coerce(name, column.combine_chunks(), value_type)
    enc = pc.dictionary_encode(arr)
    missing = len(enc.dictionary)
    codes = enc.indices.fill_null(missing).to_numpy(zero_copy_only=False).astype(np.int64)
    kind = {pa.int64(): "int64_value", pa.float64(): "double_value", pa.string(): "string_value"}[
        arr.type
    ]
    values = [predict_pb2.Value(**{kind: v}) for v in enc.dictionary.to_pylist()] + [
        predict_pb2.Value()
    ]
    entries = np.empty(len(values), dtype=object)
    entries[:] = [predict_pb2.Features(values={name: v}).SerializeToString() for v in values]
    return entries, codes


def _coerce(name: str, arr: pa.Array, value_type: str | None) -> pa.Array:
    """Cast to int64 / float64 / string; NaN → null."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_floating(arr.type):
        arr = pc.if_else(pc.is_nan(arr), pa.scalar(None, arr.type), arr)
    if value_type is None:
        if pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type):
            target = pa.int64()
        elif pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type):
            target = pa.float64()
        elif pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            target = pa.string()
        else:
            raise ValueError(
                f"column {name!r} has type {arr.type}; expected an integer, float or string: "
                "pass the eval samples of the served model (--samples)"
            )
    elif value_type in VALUE_TYPES:
        target = VALUE_TYPES[value_type]
    else:
        raise ValueError(
            f"feature {name!r}: value_type {value_type!r} is not one of {list(VALUE_TYPES)}; "
            "load-test a server of this dynrec version"
        )
    try:
        return arr.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(
            f"column {name!r} ({arr.type}) cannot be sent as {target} the model expects: {e}; "
            "pass the eval samples of the served model (--samples)"
        ) from e


def _join_rows(features: list[tuple[np.ndarray, np.ndarray]], rows: np.ndarray) -> list[bytes]:
    """Serialized ``Features`` of each row in ``rows``: the concatenation of its entries."""
    cols = [entries[codes[rows]] for entries, codes in features]
    return [b"".join(t) for t in zip(*cols, strict=True)] if cols else [b""] * len(rows)


def _item_tuples(features: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(first, item_of_row): a sample row of each distinct item-feature tuple, and the tuple
    of each row (an index into ``first``)."""
    if not features:
        raise ValueError(
            "the model has no item-side features, so there are no candidates to send; load-test "
            "a model whose config has item features (expression: 'item:...')"
        )
    codes = np.stack([c for _, c in features], axis=1)  # (rows, item features)
    _, first, item_of_row = np.unique(codes, axis=0, return_index=True, return_inverse=True)
    return first, item_of_row.reshape(-1)


def _candidate_fields(
    features: list[tuple[np.ndarray, np.ndarray]], first: np.ndarray
) -> np.ndarray:
    """Serialized ``candidates`` fields, one per distinct item-feature tuple (row ``first[k]``)."""
    fields = np.empty(len(first), dtype=object)
    fields[:] = [_CANDIDATES_TAG + _varint(len(b)) + b for b in _join_rows(features, first)]
    return fields


def _column_values(
    name: str, column: pa.ChunkedArray, value_type: str | None
) -> tuple[str, np.ndarray, np.ndarray]:
    """(kind, values, missing) of an item column over all rows: the Column kind, the values
    with a placeholder in the null rows (an object array for strings), the null mask."""
    arr = _coerce(name, column.combine_chunks(), value_type)
    kind = _COLUMN_KINDS[arr.type]
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    filled = arr.fill_null(_PLACEHOLDERS[kind]).to_numpy(zero_copy_only=False)
    return kind, filled, missing


def _fill_column(
    column: predict_pb2.Column,
    kind: str,
    values: np.ndarray | Sequence[object],
    missing: np.ndarray,
) -> None:
    """Set ``column`` to ``values`` of Column kind ``kind``, ``missing`` marking missing rows
    (sent only when some row is missing)."""
    getattr(column, kind).values.extend(np.asarray(values).tolist())
    if missing.any():
        column.missing.extend(missing.tolist())


def _jagged_ids(
    name: str, column: pa.ChunkedArray, fmt: SequenceFormat
) -> tuple[np.ndarray, np.ndarray]:
    """(values int64, offsets [rows + 1]) of a sequence column, the most recent
    ``fmt.max_length`` ids of each row (all when 0); empty tokens are 0."""
    arr = column.combine_chunks()
    delim, keep_last = fmt.delimiter, fmt.max_length
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        if not delim:
            raise ValueError(
                f"sequence column {name!r} holds joined strings, but the model metadata gives no "
                f"delimiter for sequence {fmt.sequence!r} (SequenceInfo.delimiter); serve the "
                "model with this version of serve, or write the column as a list"
            )
        arr = pc.if_else(pc.equal(pc.utf8_trim_whitespace(arr), ""), pa.scalar(None, arr.type), arr)
        lists = pc.split_pattern(arr, delim)
        tokens = pc.utf8_trim_whitespace(lists.flatten())
        tokens = pc.if_else(pc.equal(tokens, ""), "0", tokens)
    elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lists, tokens = arr, arr.flatten()
    else:
        raise ValueError(
            f"sequence column {name!r} has type {arr.type}; expected {delim!r}-joined strings "
            "or a list: pass the eval samples of the served model (--samples)"
        )
    try:
        values = tokens.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid as e:
        raise ValueError(
            f"sequence column {name!r} has a non-integer id after splitting on {delim!r} (the "
            f"model's sequence_delim): {e}; pass the eval samples of the served model (--samples)"
        ) from e
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    if keep_last > 0:  # keep the most recent ids: re-slice values to the kept tails
        starts = np.maximum(offsets[:-1], offsets[1:] - keep_last)
        kept = offsets[1:] - starts
        values = values[np.repeat(starts, kept) + _ranges(kept)]
        offsets = np.concatenate(([0], np.cumsum(kept)))
    return values.astype(np.int64), offsets


def _align(
    sequences: dict[str, tuple[np.ndarray, np.ndarray]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Give the sub-sequences of a row equal lengths: an empty string beside one-element
    sub-sequences is one missing id (the sample writer's encoding of e.g. a NULL brand), sent as 0.
    """
    if not sequences:
        return sequences
    lengths = {n: np.diff(off) for n, (_v, off) in sequences.items()}
    row_len = np.max(np.stack(list(lengths.values())), axis=0)
    out = {}
    for name, (values, offsets) in sequences.items():
        old = lengths[name]
        new = np.where((old == 0) & (row_len == 1), 1, old)
        if np.array_equal(new, old):
            out[name] = (values, offsets)
            continue
        new_offsets = np.concatenate(([0], np.cumsum(new)))
        filled = np.zeros(int(new_offsets[-1]), np.int64)
        rows = np.repeat(np.arange(len(old)), old)
        filled[new_offsets[:-1][rows] + _ranges(old)] = values
        out[name] = (filled, new_offsets)
    return out


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths), vectorized."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts


def _draw(rng: np.random.Generator, population: int, k: int) -> np.ndarray:
    """k indices in [0, population): distinct when the population allows it."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    return rng.choice(population, k, replace=population < k)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
