"""The public Taobao display-ad dataset: its four CSV files, and the join into sample Parquet.

Files (headers exactly as published; ``user_profile.csv``'s last column is
``"new_user_class_level "`` with a trailing space, which the reader strips):

- ``raw_sample.csv``: user, time_stamp, adgroup_id, pid, nonclk, clk — one row per impression.
- ``ad_feature.csv``: adgroup_id, cate_id, campaign_id, customer, brand, price (brand may be
  ``NULL`` or empty).
- ``user_profile.csv``: userid, cms_segid, cms_group_id, final_gender_code, age_level,
  pvalue_level, shopping_level, occupation, new_user_class_level (empty fields are common; about
  7 % of raw_sample users have no row).
- ``behavior_log.csv``: user, time_stamp, btag, cate, brand. Not read beyond its header: the
  click sequence comes from raw_sample's clicks (the 700M-row log would not change the samples).

:func:`build_samples` writes ``out/train/part-*.parquet`` and ``out/eval/part-*.parquet`` with
one column per config feature (named as the feature), ``clk`` (int8), ``time_stamp`` (int64) and,
for synthetic data, ``_oracle_p`` (float32). Data decisions:

- **Click sequence**: the same user's clicked ads (raw_sample ``clk == 1``) with a time_stamp
  *strictly* earlier than the sample's, most recent last, at most ``sequence_length``. **Ties:**
  clicks in the same second as the sample are not visible (that includes the sample's own click
  and the clicks of other impressions of the same page view). Same-second clicks seen from a later
  second are ordered by their row order in raw_sample.csv.
- **Encoding**: sub-sequences are strings joined by ``sequence_delim``, all of equal length; the
  ad id token is always present, a clicked ad's missing cate/brand is the empty token (see
  ``shared.fg``: id 0, counted); a sample without earlier clicks has empty strings.
- **Missing scalars**: null (int64 nullable): users without a profile row, empty profile fields,
  brand ``NULL``/empty, ads without an ad_feature row (counted). A NaN or negative price is set
  to null and counted. ``pid`` stays a string.
- **Split**: by calendar day in UTC+8 (Beijing time, the dataset's clock): 2017-05-06..05-12 →
  train, 2017-05-13 → eval; rows of other days are dropped and counted.
- **Scale**: raw_sample is streamed from CSV into compact numpy columns (29 bytes per row:
  user, time_stamp, adgroup_id, dictionary-coded pid, clk), sorted in place by (user,
  time_stamp, file row) with one int64 key, joined to ad_feature/user_profile by searchsorted
  (int32 row indices), and the samples are produced and written in chunks of ``chunk_rows``
  (vectorized: each sample's window of earlier clicks comes from two searchsorted calls over
  the sorted click keys; no per-row Python). Resident: about 90 bytes per raw row, plus one
  chunk and the per-file write buffers. Measured (``bench/bench_reader.py``, 2 shared cores):
  ``small`` (300K rows) 0.35 GB peak RSS in 0.7 s; ``full`` (26.6M rows) 3.0–3.3 GB peak RSS in
  90–113 s.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from shared.features import FeatureKind, FeatureSet, FeatureSpec, Side

T = TypeVar("T")

RAW_SAMPLE = "raw_sample.csv"
AD_FEATURE = "ad_feature.csv"
USER_PROFILE = "user_profile.csv"
BEHAVIOR_LOG = "behavior_log.csv"
ORACLE_FILE = "raw_sample_oracle.parquet"  # synthetic data only: row-aligned with raw_sample.csv

RAW_SAMPLE_HEADER = ("user", "time_stamp", "adgroup_id", "pid", "nonclk", "clk")
AD_FEATURE_HEADER = ("adgroup_id", "cate_id", "campaign_id", "customer", "brand", "price")
USER_PROFILE_HEADER = (
    "userid",
    "cms_segid",
    "cms_group_id",
    "final_gender_code",
    "age_level",
    "pvalue_level",
    "shopping_level",
    "occupation",
    "new_user_class_level ",  # sic: the published header has a trailing space
)
BEHAVIOR_LOG_HEADER = ("user", "time_stamp", "btag", "cate", "brand")
NULL_VALUES = ["", "NULL"]

TZ = dt.timezone(dt.timedelta(hours=8))  # the dataset's clock (Beijing time)
TRAIN_FIRST_DAY = dt.date(2017, 5, 6)
EVAL_DAY = dt.date(2017, 5, 13)
ORACLE_COLUMN = "_oracle_p"
LABEL_COLUMN = "clk"
SPLITS = ("train", "eval")

# inputs a feature may read, per side; value = (file, column)
USER_INPUTS = {
    "user_id": (RAW_SAMPLE, "user"),
    **{c.strip(): (USER_PROFILE, c.strip()) for c in USER_PROFILE_HEADER[1:]},
}
AD_INPUTS = {c: (AD_FEATURE, c) for c in AD_FEATURE_HEADER}
CONTEXT_INPUTS = {"pid": (RAW_SAMPLE, "pid")}
SEQUENCE_INPUTS = ("adgroup_id", "cate_id", "campaign_id", "customer", "brand")


def day_index(day: dt.date) -> int:
    """Days since 1970-01-01 of a UTC+8 calendar day (as :func:`sample_days` counts them)."""
    return (day - dt.date(1970, 1, 1)).days


def sample_days(time_stamp: np.ndarray) -> np.ndarray:
    """UTC+8 calendar day (days since epoch) of Unix-second timestamps."""
    return (time_stamp + 8 * 3600) // 86400


def day_start(day: dt.date) -> int:
    """Unix time of 00:00:00 UTC+8 on ``day``."""
    return int(dt.datetime(day.year, day.month, day.day, tzinfo=TZ).timestamp())


# --------------------------------------------------------------------------- reading


def _check_header(path: Path, expected: tuple[str, ...]) -> None:
    with path.open("rb") as f:
        header = f.readline().decode("utf-8").rstrip("\r\n").split(",")
    if [h.strip() for h in header] != [e.strip() for e in expected]:
        raise ValueError(
            f"{path}: header {header} is not the published one {list(expected)}; is this the "
            "Taobao display-ad dataset?"
        )


def _read_small_csv(path: Path, header: tuple[str, ...], types: dict[str, pa.DataType]) -> pa.Table:
    """Read a whole CSV with names stripped of spaces and typed columns; nulls per NULL_VALUES."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; the --raw directory must hold {RAW_SAMPLE}, {AD_FEATURE}, ..."
        )
    _check_header(path, header)
    names = [h.strip() for h in header]
    return pcsv.read_csv(
        path,
        read_options=pcsv.ReadOptions(column_names=names, skip_rows=1),
        convert_options=pcsv.ConvertOptions(
            column_types=types, null_values=NULL_VALUES, strings_can_be_null=True
        ),
    )


def read_ad_feature(raw_dir: Path) -> pa.Table:
    types = {c: pa.int64() for c in AD_FEATURE_HEADER} | {"price": pa.float64()}
    table = _read_small_csv(raw_dir / AD_FEATURE, AD_FEATURE_HEADER, types)
    return _sorted_unique(table, "adgroup_id", raw_dir / AD_FEATURE)


def read_user_profile(raw_dir: Path) -> pa.Table:
    types = {c.strip(): pa.int64() for c in USER_PROFILE_HEADER}
    table = _read_small_csv(raw_dir / USER_PROFILE, USER_PROFILE_HEADER, types)
    return _sorted_unique(table, "userid", raw_dir / USER_PROFILE)


def _sorted_unique(table: pa.Table, key: str, path: Path) -> pa.Table:
    if table.column(key).null_count:
        raise ValueError(f"{path}: {table.column(key).null_count} rows without {key}")
    table = table.sort_by(key)
    ids = table.column(key).to_numpy()
    dup = np.flatnonzero(ids[1:] == ids[:-1])
    if len(dup):
        raise ValueError(f"{path}: {key} {ids[dup[0]]} appears more than once")
    return table


@dataclass
class RawSamples:
    """raw_sample.csv in compact columns, in file order."""

    user: np.ndarray  # int64
    time_stamp: np.ndarray  # int64
    adgroup_id: np.ndarray  # int64
    pid_codes: np.ndarray  # int32 index into pid_values
    pid_values: pa.Array  # string
    clk: np.ndarray  # int8


def read_raw_sample(raw_dir: Path, block_size: int = 16 << 20) -> RawSamples:
    """Stream raw_sample.csv into numpy columns (nonclk is checked against clk, then dropped)."""
    path = raw_dir / RAW_SAMPLE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    _check_header(path, RAW_SAMPLE_HEADER)
    types = {
        "user": pa.int64(),
        "time_stamp": pa.int64(),
        "adgroup_id": pa.int64(),
        "pid": pa.string(),
        "nonclk": pa.int8(),
        "clk": pa.int8(),
    }
    reader = pcsv.open_csv(
        path,
        read_options=pcsv.ReadOptions(block_size=block_size),
        convert_options=pcsv.ConvertOptions(column_types=types, null_values=NULL_VALUES),
    )
    cols: dict[str, list[np.ndarray]] = {c: [] for c in ("user", "time_stamp", "adgroup_id", "clk")}
    pid_chunks: list[pa.Array] = []
    rows = 0
    for rb in reader:
        for name in (*cols, "pid", "nonclk"):
            if rb.column(name).null_count:
                raise ValueError(f"{path}: empty {name} near data row {rows + 1}")
        clk, nonclk = rb.column("clk").to_numpy(), rb.column("nonclk").to_numpy()
        if ((clk != 0) & (clk != 1)).any() or (clk + nonclk != 1).any():
            raise ValueError(f"{path}: clk must be 0/1 and nonclk = 1 - clk (rows {rows + 1}..)")
        for name in cols:
            cols[name].append(rb.column(name).to_numpy())
        pid_chunks.append(pc.dictionary_encode(rb.column("pid")))
        rows += rb.num_rows
    # unify the per-block pid dictionaries into one
    pid = pa.chunked_array(pid_chunks, pa.dictionary(pa.int32(), pa.string())).unify_dictionaries()
    values = pid.chunk(0).dictionary if pid.num_chunks else pa.array([], pa.string())
    codes = (
        np.concatenate([c.indices.to_numpy() for c in pid.chunks])
        if pid.num_chunks
        else np.zeros(0)
    )

    def cat(name: str) -> np.ndarray:  # one column at a time: the blocks are freed as we go
        blocks = cols.pop(name)
        return np.concatenate(blocks) if blocks else np.zeros(0, np.int64)

    return RawSamples(
        cat("user"),
        cat("time_stamp"),
        cat("adgroup_id"),
        codes.astype(np.int32),
        values,
        cat("clk"),
    )


def read_oracle(raw_dir: Path, raw: RawSamples) -> np.ndarray | None:
    """True click probabilities (synthetic data), checked to be row-aligned with raw_sample."""
    path = raw_dir / ORACLE_FILE
    if not path.is_file():
        return None
    t = pq.read_table(path)
    if t.num_rows != len(raw.user) or not (
        np.array_equal(t.column("user").to_numpy(), raw.user)
        and np.array_equal(t.column("adgroup_id").to_numpy(), raw.adgroup_id)
    ):
        raise ValueError(f"{path}: not row-aligned with {RAW_SAMPLE}; regenerate both together")
    return t.column("p").to_numpy().astype(np.float32)


# --------------------------------------------------------------------------- building samples


@dataclass
class BuildReport:
    """What :func:`build_samples` did; also written to ``out_dir/_build_report.json``."""

    raw_rows: int = 0
    clicks: int = 0
    users: int = 0
    ads_in_ad_feature: int = 0
    profiles: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    dropped_other_days: int = 0
    samples_without_profile: int = 0  # user features null
    samples_with_unknown_ad: int = 0  # ad feature columns null
    ads_with_bad_price: int = 0  # NaN/negative price set to null
    nulls: dict[str, int] = field(default_factory=dict)  # per output column
    missing_sequence_tokens: dict[str, int] = field(default_factory=dict)
    mean_sequence_length: dict[str, float] = field(default_factory=dict)  # per split
    samples_at_sequence_cap: int = 0
    max_sequence_length: int = 0
    has_oracle: bool = False
    parts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


@dataclass(frozen=True)
class _Columns:
    """The sorted, joined per-sample inputs that chunks are cut from."""

    user: np.ndarray
    time_stamp: np.ndarray
    adgroup_id: np.ndarray
    pid_codes: np.ndarray
    clk: np.ndarray
    oracle: np.ndarray | None
    profile_row: np.ndarray  # -1: no profile
    ad_row: np.ndarray  # -1: adgroup_id not in ad_feature
    key: np.ndarray  # (dense user << 32) | (time_stamp - t0): sorted
    click_pos: np.ndarray  # sample positions of clicks (sorted order)


def _check_features(fs: FeatureSet) -> dict[str, list[FeatureSpec]]:
    """Every feature must read an input the dataset has; returns sequences by name."""
    inputs = {Side.USER: USER_INPUTS, Side.ITEM: AD_INPUTS, Side.CONTEXT: CONTEXT_INPUTS}
    sequences: dict[str, list[FeatureSpec]] = {}
    for spec in fs.features.values():
        if spec.kind is FeatureKind.SEQUENCE_ID:
            if spec.source not in SEQUENCE_INPUTS:
                raise ValueError(
                    f"feature {spec.name}: a click sequence can hold {', '.join(SEQUENCE_INPUTS)} "
                    f"of the clicked ads, not {spec.source!r}"
                )
            sequences.setdefault(spec.sequence_name or spec.name, []).append(spec)
        elif spec.source not in inputs[spec.side]:
            known = ", ".join(f"{spec.side.value}:{k}" for k in inputs[spec.side])
            raise ValueError(
                f"feature {spec.name} reads {spec.side.value}:{spec.source}; known: {known}"
            )
    if fs.label_fields != (LABEL_COLUMN,):
        raise ValueError(
            f"label_fields {fs.label_fields}: the Taobao data has the label 'clk' only"
        )
    return sequences


def _lookup(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Row (int32) of each id in ``sorted_ids``, -1 where absent."""
    if len(sorted_ids) == 0:
        return np.full(len(ids), -1, np.int64)
    pos = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return np.where(sorted_ids[pos] == ids, pos, -1).astype(np.int32)


def _sort_and_join(
    raw: RawSamples, oracle: np.ndarray | None, ads: pa.Table, profiles: pa.Table
) -> _Columns:
    """Sort by (user, time_stamp, file row) and look up profile/ad rows. Sorts ``raw`` in place
    (each column is replaced by its sorted copy, so only one extra column is alive at a time)."""
    user, ts = raw.user, raw.time_stamp
    t0 = int(ts.min()) if len(ts) else 0
    span = int(ts.max()) - t0 if len(ts) else 0
    if span >= 2**32:
        raise ValueError(
            f"{RAW_SAMPLE}: time_stamp spans {span} s; more than 2**32 s is not supported"
        )
    if len(user) and user.min() >= 0 and user.max() < 2**31:
        key = user << 32
        key |= ts - t0
        order = np.argsort(key, kind="stable")  # ties keep file order
        del key
    else:
        order = np.lexsort((ts, user))
    del user, ts
    for name in ("user", "time_stamp", "adgroup_id", "pid_codes", "clk"):
        setattr(raw, name, getattr(raw, name)[order])
    oracle = None if oracle is None else oracle[order]
    del order
    new_user = np.empty(len(raw.user), bool)
    new_user[:1] = True
    np.not_equal(raw.user[1:], raw.user[:-1], out=new_user[1:])
    key = np.cumsum(new_user, dtype=np.int64)
    del new_user
    key -= 1
    key <<= 32
    key |= raw.time_stamp - t0
    return _Columns(
        user=raw.user,
        time_stamp=raw.time_stamp,
        adgroup_id=raw.adgroup_id,
        pid_codes=raw.pid_codes,
        clk=raw.clk,
        oracle=oracle,
        profile_row=_lookup(profiles.column("userid").to_numpy(), raw.user),
        ad_row=_lookup(ads.column("adgroup_id").to_numpy(), raw.adgroup_id),
        key=key,
        click_pos=np.flatnonzero(raw.clk == 1),
    )


def _take_nullable(table: pa.Table, column: str, rows: np.ndarray) -> pa.Array:
    """table[column][rows] with rows == -1 → null."""
    col = table.column(column).combine_chunks() if table.num_rows else pa.array([], pa.int64())
    known = rows >= 0
    taken = (
        col.take(pa.array(np.where(known, rows, 0))) if len(col) else pa.nulls(len(rows), col.type)
    )
    return taken if known.all() else pc.if_else(pa.array(known), taken, pa.scalar(None, col.type))


def _join_tokens(values: pa.Array, lengths: np.ndarray, delim: str) -> pa.Array:
    """Per row, ``lengths[i]`` tokens of ``values`` (null → empty token) joined by ``delim``."""
    strings = pc.fill_null(pc.cast(values, pa.string()), "")
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    lists = pa.LargeListArray.from_arrays(pa.array(offsets), strings)
    return pc.binary_join(lists, delim)


def _sequence_columns(
    cols: _Columns,
    lo: int,
    hi: int,
    specs: list[FeatureSpec],
    ads: pa.Table,
    missing_tokens: Counter[str],
) -> tuple[dict[str, pa.Array], np.ndarray]:
    """The click-sequence columns of sorted samples [lo, hi) (strictly earlier clicks only), and
    their lengths; counts the tokens whose ad has no row into ``missing_tokens``."""
    click_key = cols.key[cols.click_pos]
    key = cols.key[lo:hi]
    end = np.searchsorted(click_key, key, side="left")  # same-second clicks are not visible
    start = np.searchsorted(click_key, (key >> 32) << 32, side="left")  # the user's first click
    cap = int(specs[0].sequence_length or 0)
    n = np.minimum(end - start, cap)
    first = np.repeat(end - n, n)
    flat = first + np.arange(len(first)) - np.repeat(np.cumsum(n) - n, n)  # click indices
    pos = cols.click_pos[flat]
    out: dict[str, pa.Array] = {}
    for spec in specs:
        if spec.source == "adgroup_id":
            values = pa.array(cols.adgroup_id[pos])
        else:
            values = _take_nullable(ads, spec.source, cols.ad_row[pos])
        if values.null_count:
            missing_tokens[spec.name] += values.null_count
        out[spec.name] = _join_tokens(values, n, spec.sequence_delim or "|")
    return out, n


def _chunk_table(
    fs: FeatureSet,
    sequences: dict[str, list[FeatureSpec]],
    cols: _Columns,
    lo: int,
    hi: int,
    ads: pa.Table,
    profiles: pa.Table,
    pid_values: pa.Array,
) -> tuple[pa.Table, np.ndarray, Counter[str]]:
    """Samples [lo, hi) of the sorted columns, the lengths of their first sequence, and the
    sequence tokens per feature whose ad has no row. Reads only its arguments (chunks are built
    on several threads)."""
    seq_cols: dict[str, pa.Array] = {}
    seq_len = np.zeros(hi - lo, np.int64)
    missing_tokens: Counter[str] = Counter()
    for i, specs in enumerate(sequences.values()):
        more, lengths = _sequence_columns(cols, lo, hi, specs, ads, missing_tokens)
        seq_cols |= more
        seq_len = lengths if i == 0 else seq_len
    out: dict[str, pa.Array] = {}
    for spec in fs.features.values():
        if spec.is_sequence:
            out[spec.name] = seq_cols[spec.name]
        elif spec.side is Side.CONTEXT:  # pid
            out[spec.name] = pid_values.take(pa.array(cols.pid_codes[lo:hi]))
        elif spec.side is Side.USER and spec.source == "user_id":
            out[spec.name] = pa.array(cols.user[lo:hi])
        elif spec.side is Side.USER:
            out[spec.name] = _take_nullable(profiles, spec.source, cols.profile_row[lo:hi])
        elif spec.source == "adgroup_id":
            out[spec.name] = pa.array(cols.adgroup_id[lo:hi])
        else:
            out[spec.name] = _take_nullable(ads, spec.source, cols.ad_row[lo:hi])
    out[LABEL_COLUMN] = pa.array(cols.clk[lo:hi])
    out["time_stamp"] = pa.array(cols.time_stamp[lo:hi])
    if cols.oracle is not None:
        out[ORACLE_COLUMN] = pa.array(cols.oracle[lo:hi])
    return pa.table(out), seq_len, missing_tokens


def build_threads() -> int:
    """The threads :func:`build_samples` builds its chunks on by default: the CPUs, at most 8."""
    return min(8, os.cpu_count() or 1)


def _in_order(
    build: Callable[[int, int], T], total: int, chunk_rows: int, threads: int
) -> Iterator[T]:
    """``build(lo, hi)`` of every chunk of ``total`` rows, in chunk order, ``threads`` at a time
    (numpy and Arrow release the GIL in their kernels); at most ``2 * threads`` chunks are built
    ahead of the one consumed, so memory stays bounded."""
    bounds = [(lo, min(lo + chunk_rows, total)) for lo in range(0, total, chunk_rows)]
    if threads <= 1:
        yield from (build(lo, hi) for lo, hi in bounds)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="build_samples") as pool:
        ahead: deque[Future[T]] = deque()
        for lo, hi in bounds:
            ahead.append(pool.submit(build, lo, hi))
            if len(ahead) > 2 * threads:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


class _PartWriter:
    """Scatters each chunk's rows at random over ``parts`` Parquet files of one split, buffering
    per file so that row groups have ``row_group_rows`` rows whatever the chunk size."""

    def __init__(self, directory: Path, parts: int, row_group_rows: int, rng: np.random.Generator):
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("part-*.parquet"):
            old.unlink()
        self.directory, self.row_group_rows, self.rng = directory, row_group_rows, rng
        self.pending: list[list[pa.Table]] = [[] for _ in range(parts)]
        self.writers: dict[int, pq.ParquetWriter] = {}

    def write(self, table: pa.Table) -> None:
        perm = self.rng.permutation(table.num_rows)
        for part, idx in enumerate(np.array_split(perm, len(self.pending))):
            if len(idx):
                self.pending[part].append(table.take(pa.array(idx)))
                self._flush(part, final=False)

    def _flush(self, part: int, *, final: bool) -> None:
        rows = sum(t.num_rows for t in self.pending[part])
        if rows == 0 or (rows < self.row_group_rows and not final):
            return
        table = pa.concat_tables(self.pending[part]).combine_chunks()
        keep = 0 if final else rows % self.row_group_rows  # whole row groups only, until the end
        if part not in self.writers:
            path = self.directory / f"part-{part:05d}.parquet"
            self.writers[part] = pq.ParquetWriter(path, table.schema, compression="zstd")
        out = table.slice(0, rows - keep)
        self.writers[part].write_table(out, row_group_size=self.row_group_rows)
        self.pending[part] = [table.slice(rows - keep)] if keep else []

    def close(self) -> int:
        for part in range(len(self.pending)):
            self._flush(part, final=True)
        for w in self.writers.values():
            w.close()
        return len(self.writers)


def _write_splits(
    writers: list[_PartWriter],
    table: pa.Table,
    seq_len: np.ndarray,
    split: np.ndarray,
    seq_cap: int,
    seq_sum: list[int],
    report: BuildReport,
) -> None:
    """A chunk's rows to their split's writer (``split``: index into ``writers`` per row, -1 =
    none), counting their sequence lengths into ``seq_sum`` and ``report``."""
    for i, writer in enumerate(writers):
        mask = split == i
        if mask.any():
            kept = seq_len[mask]
            seq_sum[i] += int(kept.sum())
            report.samples_at_sequence_cap += int((kept >= seq_cap).sum())
            report.max_sequence_length = max(report.max_sequence_length, int(kept.max()))
            writer.write(table.filter(pa.array(mask)))


def _null_bad_prices(ads: pa.Table) -> tuple[pa.Table, int]:
    """NaN or negative prices → null (feature generation would refuse them); returns the count."""
    price = ads.column("price")
    bad = pc.fill_null(pc.or_(pc.is_nan(price), pc.less(price, 0)), False)
    n = int(pc.sum(bad).as_py() or 0)
    if n:
        price = pc.if_else(bad, pa.scalar(None, pa.float64()), price)
        ads = ads.set_column(ads.schema.get_field_index("price"), "price", price)
    return ads, n


def build_samples(
    raw_dir: str | Path,
    out_dir: str | Path,
    feature_set: FeatureSet,
    *,
    chunk_rows: int = 250_000,
    threads: int | None = None,
    rows_per_part: int = 2_000_000,
    row_group_rows: int = 65_536,
    seed: int = 0,
    first_day: dt.date = TRAIN_FIRST_DAY,
    eval_day: dt.date = EVAL_DAY,
) -> BuildReport:
    """Join the four raw files into ``out_dir/{train,eval}/part-*.parquet`` (see module doc).

    Rows are scattered at random over ``ceil(rows / rows_per_part)`` files per split, in row
    groups of at most ``row_group_rows``, so that the loader can shuffle by row group. Chunks of
    ``chunk_rows`` samples are built on ``threads`` threads (default: the CPUs, at most 8) and
    written in order by one: the files are the same whatever the threads. Example::

        fs = build_feature_set(load_config("configs/multi_tower_din_taobao_dynamicemb.config"))
        build_samples("data/small/raw", "data/small/samples", fs)
    """
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    sequences = _check_features(fs := feature_set)
    if (raw_dir / BEHAVIOR_LOG).is_file():
        _check_header(raw_dir / BEHAVIOR_LOG, BEHAVIOR_LOG_HEADER)  # content unused: see module doc
    ads, bad_prices = _null_bad_prices(read_ad_feature(raw_dir))
    profiles = read_user_profile(raw_dir)
    raw = read_raw_sample(raw_dir)
    oracle = read_oracle(raw_dir, raw)
    report = BuildReport(
        raw_rows=len(raw.user),
        clicks=int(raw.clk.sum()),
        users=len(np.unique(raw.user)),
        ads_in_ad_feature=ads.num_rows,
        profiles=profiles.num_rows,
        ads_with_bad_price=bad_prices,
        has_oracle=oracle is not None,
    )
    pid_values = raw.pid_values
    cols = _sort_and_join(raw, oracle, ads, profiles)
    del raw, oracle
    report.samples_without_profile = int((cols.profile_row < 0).sum())
    report.samples_with_unknown_ad = int((cols.ad_row < 0).sum())

    days = sample_days(cols.time_stamp)
    first, last = day_index(first_day), day_index(eval_day)
    split_of = np.where(days == last, 1, np.where((days >= first) & (days < last), 0, -1))
    counts = np.bincount(split_of + 1, minlength=3)
    report.dropped_other_days, report.train_rows, report.eval_rows = (int(c) for c in counts)
    rng = np.random.default_rng(seed)
    writers = [
        _PartWriter(out_dir / name, max(1, math.ceil(n / rows_per_part)), row_group_rows, rng)
        for name, n in zip(SPLITS, counts[1:], strict=True)
    ]
    seq_sum = [0, 0]
    nulls: Counter[str] = Counter()
    seq_cap = next((s[0].sequence_length or 0 for s in sequences.values()), 0) or 2**62
    missing_tokens: Counter[str] = Counter()

    def chunk(lo: int, hi: int) -> tuple[int, int, pa.Table, np.ndarray, Counter[str]]:
        return lo, hi, *_chunk_table(fs, sequences, cols, lo, hi, ads, profiles, pid_values)

    threads = build_threads() if threads is None else threads
    for lo, hi, table, seq_len, missing in _in_order(chunk, len(cols.user), chunk_rows, threads):
        missing_tokens.update(missing)
        nulls.update({c: table.column(c).null_count for c in table.column_names})
        _write_splits(writers, table, seq_len, split_of[lo:hi], seq_cap, seq_sum, report)
    report.parts = {name: w.close() for name, w in zip(SPLITS, writers, strict=True)}
    report.nulls = {k: v for k, v in sorted(nulls.items()) if v}
    report.missing_sequence_tokens = {k: v for k, v in missing_tokens.items() if v}
    report.mean_sequence_length = {
        name: seq_sum[i] / max(int(counts[i + 1]), 1) for i, name in enumerate(SPLITS)
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "_build_report.json").write_text(report.to_json())
    return report
