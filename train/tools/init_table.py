"""``init-ckpt``: an ``init_table`` (Parquet or CSV) → a dynamicemb-layout initial checkpoint.

The init table of a dynamic table (seed 002 ``dynamicemb.init_table``; seed 000 §4.3 "warm the
table from a dense init") has the id in its first column and the embedding in its second, either
as a list column or as one string of ``--separator``-joined numbers (``"0.1,0.2,..."``; optional
surrounding brackets are ignored). Parquet string ids are hashed the way feature generation hashes
string ids of dynamic features (:mod:`shared.fg`); CSV ids must be integers. A CSV may start with
a header line (detected: its first field is not an integer).

Validation is all-or-nothing: every row is checked (vectorized) for a missing, non-integer or
negative id, a duplicate id, a missing embedding, a non-numeric or non-finite value, and a wrong
number of values; any problem raises :class:`InitTableError` listing the bad rows with their line
numbers (CSV: lines of the file; Parquet: rows, 1-based), the first ``max_errors`` of them and the
count of the rest, and nothing is written.

The checkpoint (:func:`write_init_checkpoint`) holds only the dynamic tables, in dynamicemb's
layout as ``train/checkpoint.py`` writes it (``<out>/dynamicemb/<collection>/<table>_emb_keys.
rank_R.world_size_W`` ..., :mod:`shared.hashtable.checkpoint`), one set of files per rank with
the keys ``key % world_size == rank``, plus ``dynamic_tables.json``, ``init_ckpt.json`` (what was
written from where) and ``DONE``; TorchEasyRec's ``DynamicEmbLoad`` reads its ``dynamicemb/`` as
well. Rows get score 0 (never used in this training: under an evicting strategy they leave
before keys training has used) and the sparse optimizer's ``initial_accumulator_value``.
Training starts from it with ``python -m train train ... --fine_tune_checkpoint <out>``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from protos import pipeline_pb2
from shared.features import FeatureSet, TableSpec
from shared.fg_text import INT64_MAX, hash_strings
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.checkpoint import collection_paths, table_meta, write_meta
from shared.hashtable.checkpoint_dynamicemb import opt_args, step_score, write_table_files
from shared.hashtable.storage import TableState
from train.model.multi_tower_din import sparse_adagrad
from train.model.sparse_arch import table_lr_scales

MANIFEST = "init_ckpt.json"
_INT_RE = r"^\s*[+-]?\d+\s*$"
_FLOAT_RE = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$|^\s*[+-]?(inf|nan|infinity)\s*$"


class InitTableError(ValueError):
    """Bad rows of an init table; ``problems`` holds ``(line, message)`` of the first ones."""

    def __init__(self, path: Path, problems: list[tuple[int, str]], total: int, unit: str) -> None:
        lines = [f"  {unit} {line}: {msg}" for line, msg in problems]
        more = total - len(problems)
        if more > 0:
            lines.append(f"  ... and {more} more bad {unit}s")
        super().__init__(
            f"{path}: {total} bad {unit}{'s' if total != 1 else ''}; nothing was written. Fix "
            "them (or drop them) and run again:\n" + "\n".join(lines)
        )
        self.path = path
        self.problems = problems
        self.total = total


@dataclass(frozen=True)
class InitTable:
    """A validated init table: distinct non-negative keys and their rows, in file order."""

    path: Path
    keys: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N, dim] float32


# --------------------------------------------------------------------------- reading


def _read_csv(path: Path, delimiter: str) -> tuple[pa.Table, np.ndarray, list[tuple[int, str]]]:
    """(two string columns, line number of each row, rows with the wrong number of fields)."""
    skipped: list[tuple[int, str]] = []

    def on_invalid(row: Any) -> str:
        skipped.append(
            (
                int(row.number or 0),
                f"{row.actual_columns} fields, expected 2 (id, embedding); quote the embedding "
                "when its separator is the CSV delimiter",
            )
        )
        return "skip"

    table = pcsv.read_csv(
        path,
        read_options=pcsv.ReadOptions(autogenerate_column_names=True, use_threads=False),
        parse_options=pcsv.ParseOptions(
            delimiter=delimiter, invalid_row_handler=on_invalid, ignore_empty_lines=False
        ),
        convert_options=pcsv.ConvertOptions(column_types={"f0": pa.string(), "f1": pa.string()}),
    )
    if table.num_columns < 2:
        raise ValueError(
            f"{path}: {table.num_columns} column; an init table needs the id and the embedding"
        )
    table = table.select([0, 1])
    total = table.num_rows + len(skipped)
    gone = np.asarray([n for n, _ in skipped], dtype=np.int64)
    lines = np.setdiff1d(np.arange(1, total + 1, dtype=np.int64), gone)
    first = table.column(0)[0].as_py() if table.num_rows else None
    if first is not None and not pc.match_substring_regex(pa.array([first]), _INT_RE)[0].as_py():
        table, lines = table.slice(1), lines[1:]  # a header line
    return table, lines, skipped


def _read(path: Path, delimiter: str) -> tuple[pa.Table, np.ndarray, list[tuple[int, str]], str]:
    if not path.is_file():
        raise FileNotFoundError(f"init table {path} does not exist")
    if path.suffix.lower() in (".parquet", ".pq") or _is_parquet(path):
        table = pq.read_table(path)
        if table.num_columns < 2:
            raise ValueError(f"{path}: {table.num_columns} column; need the id and the embedding")
        table = table.select([0, 1])
        return table, np.arange(1, table.num_rows + 1, dtype=np.int64), [], "row"
    table, lines, skipped = _read_csv(path, delimiter)
    return table, lines, skipped, "line"


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _combine(col: pa.ChunkedArray) -> pa.Array:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_large_string(arr.type) or pa.types.is_string_view(arr.type):
        arr = arr.cast(pa.string())
    return arr


# --------------------------------------------------------------------------- validation


class _Checks:
    """Per-row problems, kept as masks (vectorized) and formatted only for reported rows."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.items: list[tuple[np.ndarray, Any]] = []  # (bool mask [n], row -> message)

    def add(self, mask: np.ndarray, message: Any) -> None:
        if mask.any():
            self.items.append((mask, message))

    def bad(self) -> np.ndarray:
        out = np.zeros(self.n, bool)
        for mask, _ in self.items:
            out |= mask
        return out

    def messages(self, row: int) -> str:
        return "; ".join(msg(row) for mask, msg in self.items if mask[row])


def _ids(arr: pa.Array, checks: _Checks) -> np.ndarray:
    """int64 ids (0 where bad); problems go to ``checks``."""
    n = len(arr)
    null = np.asarray(arr.is_null()) if arr.null_count else np.zeros(n, bool)
    t = arr.type
    if pa.types.is_string(t):
        raw = arr.to_numpy(zero_copy_only=False)
        empty = null | np.asarray(pc.equal(pc.fill_null(pc.utf8_trim_whitespace(arr), ""), ""))
        checks.add(empty, lambda i: "missing id")
        is_int = np.asarray(pc.fill_null(pc.match_substring_regex(arr, _INT_RE), False))
        checks.add(~is_int & ~empty, lambda i: f"id {raw[i]!r} is not an integer")
        ids = np.zeros(n, np.int64)
        ok = is_int & ~empty
        text = pc.utf8_trim_whitespace(arr.filter(pa.array(ok)))
        long = np.asarray(pc.greater(pc.utf8_length(text), 18))
        parsed = np.zeros(len(text), np.int64)
        short = ~long
        if short.any():
            parsed[short] = np.asarray(pc.cast(text.filter(pa.array(short)), pa.int64()))
        if long.any():  # the rare 19+ digit ids: exact range check in Python
            big = [int(s) for s in text.filter(pa.array(long)).to_pylist()]
            over = np.array([not -(1 << 63) <= v <= INT64_MAX for v in big])
            parsed[long] = [0 if o else v for v, o in zip(big, over, strict=True)]
            out_of_range = np.zeros(n, bool)
            out_of_range[np.flatnonzero(ok)[long][over]] = True
            checks.add(out_of_range, lambda i: f"id {raw[i].strip()} is outside int64")
        ids[ok] = parsed
    elif pa.types.is_integer(t):
        checks.add(null, lambda i: "missing id")
        values = np.asarray(pc.fill_null(arr, 0))
        if pa.types.is_uint64(t):
            over = values > np.uint64(INT64_MAX)
            checks.add(over, lambda i: f"id {int(values[i])} is outside int64")
            values = np.where(over, 0, values)
        ids = values.astype(np.int64)
    else:
        raise ValueError(
            f"the id column has type {t}; ids must be integers (or strings: CSV integer text, "
            "Parquet strings hashed as feature generation does)"
        )
    checks.add(ids < 0, lambda i: f"negative id {int(ids[i])}; ids must be >= 0")
    return ids


def _hashed_ids(arr: pa.Array, checks: _Checks) -> np.ndarray:
    """Parquet string ids → the stable hash feature generation uses for dynamic string ids."""
    n = len(arr)
    missing = np.asarray(pc.fill_null(pc.equal(arr, ""), True))
    checks.add(missing, lambda i: "missing id")
    filled = pc.fill_null(arr, "")
    return (hash_strings(filled) & np.uint64(INT64_MAX)).astype(np.int64)[:n]


def _embeddings(arr: pa.Array, dim: int, separator: str, checks: _Checks) -> np.ndarray:
    """[n, dim] float64 (zeros where bad); problems go to ``checks``."""
    n = len(arr)
    t = arr.type
    null = np.asarray(arr.is_null()) if arr.null_count else np.zeros(n, bool)
    if pa.types.is_string(t):
        text = pc.replace_substring_regex(pc.fill_null(arr, ""), r"^\s*\[|\]\s*$", "")
        blank = np.asarray(pc.equal(pc.utf8_trim_whitespace(text), ""))
        null |= blank
        lists = pc.split_pattern(text, separator)
        flat = pc.utf8_trim_whitespace(pc.list_flatten(lists))
        numeric = np.asarray(pc.match_substring_regex(flat, _FLOAT_RE))
        values = np.zeros(len(flat), np.float64)
        if numeric.any():
            values[numeric] = np.asarray(pc.cast(flat.filter(pa.array(numeric)), pa.float64()))
        flat_text = flat.to_numpy(zero_copy_only=False)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        lists = arr
        flat = pc.list_flatten(arr)
        if not (pa.types.is_floating(flat.type) or pa.types.is_integer(flat.type)):
            raise ValueError(f"the embedding column is a list of {flat.type}; expected numbers")
        numeric = ~np.asarray(flat.is_null()) if flat.null_count else np.ones(len(flat), bool)
        values = np.asarray(pc.fill_null(flat, 0).cast(pa.float64()))
        flat_text = np.where(numeric, "", "null")
    else:
        raise ValueError(
            f"the embedding column has type {t}; expected a list of numbers or a "
            f"{separator!r}-joined string"
        )
    checks.add(null, lambda i: "missing embedding")
    parent = np.asarray(pc.list_parent_indices(lists))
    lengths = np.asarray(pc.fill_null(pc.list_value_length(lists), 0)).astype(np.int64)
    lengths = np.where(null, 0, lengths)
    not_num = np.zeros(n, bool)
    first_bad = np.full(n, -1, np.int64)
    bad_pos = np.flatnonzero(~numeric)
    if bad_pos.size:
        rows = parent[bad_pos]
        keep = ~null[rows]
        rows, bad_pos = rows[keep], bad_pos[keep]
        not_num[rows] = True
        first_bad[rows[::-1]] = bad_pos[::-1]  # the first bad value of each row wins
    starts = np.concatenate([[0], np.cumsum(np.asarray(pc.list_value_length(lists).fill_null(0)))])

    def value_msg(i: int) -> str:
        pos = int(first_bad[i])
        return f"value {pos - starts[i] + 1} ({flat_text[pos]!r}) is not a number"

    checks.add(not_num, value_msg)
    nonfinite = np.zeros(n, bool)
    finite = np.isfinite(values) | ~numeric
    if not finite.all():
        nonfinite[parent[~finite]] = True
        nonfinite &= ~null
    checks.add(nonfinite, lambda i: "value is NaN or infinite")
    wrong = (lengths != dim) & ~null
    checks.add(wrong, lambda i: f"{int(lengths[i])} values, expected {dim} (the embedding_dim)")
    ok = ~(null | not_num | nonfinite | wrong)
    out = np.zeros((n, dim), np.float64)
    if ok.any():
        sel = np.flatnonzero(ok)
        idx = starts[sel][:, None] + np.arange(dim)[None, :]  # [m, dim]
        out[sel] = values[idx]
    return out


def _duplicates(
    ids: np.ndarray, valid: np.ndarray, lines: np.ndarray, checks: _Checks, unit: str
) -> None:
    """Every repeat of an id (after its first row) is a bad row naming the first line."""
    rows = np.flatnonzero(valid)
    if rows.size < 2:
        return
    order = rows[np.argsort(ids[rows], kind="stable")]
    s = ids[order]
    same = np.concatenate([[False], s[1:] == s[:-1]])
    if not same.any():
        return
    run_start = np.maximum.accumulate(np.where(~same, np.arange(len(s)), 0))
    first_of = np.full(len(ids), -1, np.int64)
    first_of[order[same]] = order[run_start[same]]
    dup = first_of >= 0
    checks.add(dup, lambda i: f"id {int(ids[i])} repeats {unit} {int(lines[first_of[i]])}")


def read_init_table(
    path: str | Path, dim: int, *, separator: str = ",", delimiter: str = ",", max_errors: int = 20
) -> InitTable:
    """Read and validate an init table; :class:`InitTableError` lists every bad row."""
    path = Path(path)
    table, lines, skipped, unit = _read(path, delimiter)
    n = table.num_rows
    checks = _Checks(n)
    id_col, emb_col = _combine(table.column(0)), _combine(table.column(1))
    if pa.types.is_string(id_col.type) and unit == "row":
        ids = _hashed_ids(id_col, checks)
    else:
        ids = _ids(id_col, checks)
    id_ok = ~checks.bad()
    values = _embeddings(emb_col, dim, separator, checks)
    _duplicates(ids, id_ok, lines, checks, unit)
    bad = np.flatnonzero(checks.bad())
    problems = [(int(lines[i]), checks.messages(int(i))) for i in bad[:max_errors]]
    problems = sorted(problems + skipped)[:max_errors]
    total = bad.size + len(skipped)
    if total:
        raise InitTableError(path, problems, total, unit)
    if n == 0:
        raise ValueError(f"{path}: no rows; an init table needs at least one id")
    return InitTable(path, torch.from_numpy(ids), torch.from_numpy(values.astype(np.float32)))


# --------------------------------------------------------------------------- writing


def resolve_tables(fs: FeatureSet, given: list[str]) -> dict[str, Path]:
    """Table name → init table path, from ``--table [NAME=]PATH`` or the config's init_table
    (a relative path is taken from the working directory).

    NAME may be the table (``user_id_emb``) or a feature using it (``user_id``); a bare PATH
    needs a config with exactly one dynamic table.
    """
    dynamic = {t.name: t for t in fs.dynamic_tables}
    by_feature = {f.name: f.table for f in fs.features.values() if f.table in dynamic}
    out: dict[str, Path] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep:
            if len(dynamic) != 1:
                raise ValueError(
                    f"--table {item!r}: say which table it initializes, NAME=PATH with NAME one "
                    f"of {', '.join(dynamic)}"
                )
            name, path = next(iter(dynamic)), item
        table = name if name in dynamic else by_feature.get(name)
        if table is None:
            raise ValueError(
                f"--table {item!r}: {name!r} is not a dynamic table or a feature of one; "
                f"dynamic tables: {', '.join(dynamic)}"
            )
        out[table] = Path(path)
    if not given:
        for t in dynamic.values():
            assert t.dynamic is not None
            if t.dynamic.init_table:
                out[t.name] = Path(t.dynamic.init_table)
    if not out:
        raise ValueError(
            "no init table: set dynamicemb.init_table in the config or pass --table NAME=PATH"
        )
    return out


def write_init_checkpoint(
    out_dir: str | Path,
    tables: dict[str, InitTable],
    fs: FeatureSet,
    train_config: pipeline_pb2.TrainConfig,
    *,
    world_size: int = 1,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the initial checkpoint (see the module docstring) atomically; returns its manifest.

    Refuses a table whose keys exceed one rank's ``max_capacity`` (nothing is written).
    """
    out = Path(out_dir)
    if world_size < 1:
        raise ValueError(f"--world_size must be >= 1, got {world_size}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    ada = sparse_adagrad(train_config)
    adagrad = AdagradConfig(ada.lr, ada.eps, ada.initial_accumulator_value)
    scales = table_lr_scales(fs, train_config.sparse_optimizer)  # recorded per table
    manifest: dict[str, Any] = {"format": "dynrec-init-ckpt/1", "world_size": world_size}
    summary: dict[str, Any] = {}
    for name, init in tables.items():
        spec = fs.tables[name]
        per_rank = np.bincount((init.keys % world_size).numpy(), minlength=world_size)
        _check_capacity(spec, per_rank)
        summary[name] = {
            "source": str(init.path),
            "rows": int(init.keys.numel()),
            "rows_per_rank": [int(x) for x in per_rank],
            "dim": spec.dim,
        }
    manifest["tables"] = summary
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    collections = collection_paths(fs)
    try:
        for name, init in tables.items():
            rate = replace(adagrad, lr=adagrad.lr * scales.get(name, 1.0))
            _write_table(tmp / "dynamicemb" / collections[name], fs.tables[name], init, rate,
                         world_size)  # fmt: skip
        meta = {n: table_meta(fs.tables[n], collections[n]) for n in tables}
        write_meta(tmp, meta, id_mode=fs.id_mode.value)  # DYNREC: init tables hold raw ids
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        (tmp / "DONE").write_text("ok\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_table(
    directory: Path, spec: TableSpec, init: InitTable, adagrad: AdagradConfig, world_size: int
) -> None:
    """Every rank's files of one table (score 0, initial Adagrad sums, empty counters)."""
    assert spec.dynamic is not None
    directory.mkdir(parents=True, exist_ok=True)
    n = init.keys.numel()
    state = TableState(
        init.keys,
        init.values,
        torch.zeros(n, dtype=torch.int64),
        torch.full((n, spec.dim), adagrad.initial_accumulator_value),
    )
    strategy = spec.dynamic.score_strategy
    for rank in range(world_size):
        write_table_files(
            directory,
            spec.name,
            state,
            strategy=strategy,
            # TIMESTAMP: score 0 is the age `now`, restored as the time since: the oldest rows
            now=time.time_ns() // 1000,
            args=opt_args(adagrad, strategy, step_score(strategy, 0)) if rank == 0 else None,
            rank=rank,
            world_size=world_size,
            counter=spec.dynamic.admission is not None,
        )


def _check_capacity(spec: TableSpec, per_rank: np.ndarray) -> None:
    assert spec.dynamic is not None
    cap = spec.dynamic.max_capacity
    if int(per_rank.max()) > cap:
        rank = int(per_rank.argmax())
        raise ValueError(
            f"table {spec.name!r}: rank {rank} would hold {int(per_rank[rank])} keys, more than "
            f"its max_capacity {cap}; raise dynamicemb.max_capacity or --world_size"
        )
