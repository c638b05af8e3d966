"""Where each dynamic table's rows live, and what that costs in device and host memory.

TorchEasyRec's ``cache_load_factor`` is "the share of a table's rows whose values live in HBM":
1.0 (or absent) is HBM_ONLY, every row on the device; below 1.0 it is dynamicemb's CACHING, an
HBM cache of that share of the rows over a host tier that holds every row. This module plans it
once per table, before anything is allocated, from the config alone:

- each table's bytes on the device and on the host, from the layout the tables really allocate
  (:mod:`shared.hashtable.layout`): the index's slot arrays (fingerprint, row: 16 bytes a slot,
  and 16 a bucket), its per-row arrays (key, table id, score: 20 bytes a slot, on the device or
  the host: :class:`~shared.hashtable.layout.RowArrays`), the values and the Adagrad state
  (``8 * dim`` bytes a slot, the part a cache tiers), a CACHING table's line map (4 bytes a
  slot) and each cache line's bookkeeping (17 bytes: row, stamp, dirty bit;
  :mod:`shared.hashtable.row_cache_lines`), an admission counter table of 36 bytes a counter
  slot, and the scratch the CUDA insert kernels keep with every table they insert into, the
  counter table included (:func:`insert_scratch_bytes`: 4 bytes a slot, 20 a bucket and 256 a
  table on the device, and 8 bytes a slot where the row arrays are; a counter's are on the
  device, so its table takes 48 bytes a counter slot in all);
- with a device budget (``train_config.table_hbm_budget_gib``, ``--hbm-budget-gib``), the factor of
  every table the config leaves unset, when the tables do not fit HBM-only, as tzrec's planner does:
  the index and the counters stay in HBM (as tzrec accounts them) and one common share of the values
  is cached. When even a :data:`MIN_PLANNED_FACTOR` cache does not fit, the CACHING tables' row
  arrays move to host memory (the lead's decision for issue #52's 500M keys in 16 GiB: the
  slot arrays stay, and a find confirms each match by reading ``row_key`` (and ``row_tid``)
  over PCIe; docs/design.md), and the factor is planned again. A budget that still cannot hold
  the plan is refused, naming the biggest table.

A CACHING table's storage (:mod:`shared.hashtable.row_cache`) gets ``ceil(factor * max_capacity)``
cache lines on the device over a host tier of every row: what ``hbm_bytes`` and ``host_bytes`` count.
The insert scratch is the CUDA backend's (``shared.hashtable.cuda.insert._Scratch``); the torch
backend (the CPU) has none, but the plan is one plan whatever the backend: on the CPU it is
conservative by that much (and by 256 bytes a member of a fused storage, whose one table has
one stats buffer). Not planned: the scratch's ``rep_of``, 4 bytes a key of the largest insert
batch (a step's working memory, like the batch's own tensors).

    >>> lines = describe(plan_placement(fs.dynamic_tables, hbm_budget=None))
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.features import TableSpec
from shared.hashtable.layout import RowArrays

GIB = 1 << 30
# Bytes a slot of a table's index on the device whatever happens: slot_fp and slot_row (int64)
SLOT_BYTES_PER_SLOT = 8 + 8
# Bytes a bucket of it: its sentinel and its count (int64)
BUCKET_BYTES = 8 + 8
# Bytes a slot of its per-row arrays, where RowArrays says: row_key, row_score (int64), row_tid
ROW_ARRAY_BYTES_PER_SLOT = 8 + 8 + 4
# Bytes a slot of a whole index (an admission counter's: always on the device)
INDEX_BYTES_PER_SLOT = SLOT_BYTES_PER_SLOT + ROW_ARRAY_BYTES_PER_SLOT
# A CACHING table's device bytes beside its lines' payload: line_of_row (int32) a slot, and
# row_of_line, stamp (int64) and dirty (bool) a line (row_cache_lines.CacheLines)
LINE_MAP_BYTES_PER_SLOT = 4
LINE_BYTES = 8 + 8 + 1
# The CUDA insert kernels' scratch of a table (cuda/insert.py _Scratch, made at the table's first
# insert or erase and kept while it lives): ``win`` (int32) a slot, a target of atomics, on the
# device whatever the row arrays
INSERT_SCRATCH_BYTES_PER_SLOT = 4
# ``stage`` (int32, STAGE_FACTOR = 2 a slot of each bucket): plain stores and loads, so where the
# row arrays are (host memory mapped into the device for RowArrays.HOST)
INSERT_STAGE_BYTES_PER_SLOT = 2 * 4
# ``scount`` (int32), ``nnew`` and ``over_list`` (int64) a bucket, on the device
INSERT_SCRATCH_BYTES_PER_BUCKET = 4 + 8 + 8
# ``stats``: two calls' (2 x ST_LEN int64) a table, on the device
INSERT_SCRATCH_BYTES_PER_TABLE = 2 * 16 * 8
# Bytes a slot of the values and of their Adagrad accumulators, per dim (float32 each)
VALUE_BYTES_PER_DIM = 4 + 4
# The smallest factor planned: below it a cache thrashes whatever the skew (dynamicemb's own sweep
# starts at 10 %); a budget that needs less is refused.
MIN_PLANNED_FACTOR = 0.01


class StorageMode(enum.Enum):
    """dynamicemb's modes (HYBRID, rows split by hash, is not planned: it is slower than CACHING at
    every ratio in dynamicemb's and tzrec's measurements)."""

    HBM_ONLY = "HBM_ONLY"
    CACHING = "CACHING"


class PlacementError(ValueError):
    """A plan that cannot fit, or a mode this build cannot run; the message says what to change."""


@dataclass(frozen=True)
class TablePlacement:
    """One dynamic table's plan. ``slots``: its max capacity rounded up to whole buckets.

    The defaults of the last six fields are serving's (:mod:`serve.tiers`), which counts its
    own index (keys and line map) in ``index_bytes`` and inserts nothing on the device."""

    table: str
    mode: StorageMode
    cache_load_factor: float
    planned: bool  # True: the budget chose the factor; False: the config's (or 1.0)
    slots: int
    dim: int
    index_bytes: int  # the hash index's part always on the device (slot arrays and buckets)
    value_bytes: int  # values + Adagrad state of every slot
    counter_bytes: int  # admission counters, on the device: their table and its insert scratch
    row_array_bytes: int = 0  # the index's per-row arrays (key, table id, score) of every slot
    row_arrays: RowArrays = RowArrays.DEVICE  # where they are
    line_bytes: int = 0  # CACHING: a cache line's device bytes beside its payload
    line_map_bytes: int = 0  # CACHING: the row -> line map of every slot, on the device
    scratch_bytes: int = 0  # the CUDA insert kernels' scratch on the device: win, buckets, stats
    stage_bytes: int = 0  # their per-slot stage scratch, where the row arrays are

    @property
    def cache_bytes(self) -> int:
        """The device bytes of the payload: every slot's (HBM_ONLY), or the cache's lines with
        their bookkeeping and the line map (CACHING)."""
        payload = math.ceil(self.value_bytes * self.cache_load_factor)
        if self.mode is not StorageMode.CACHING:
            return payload
        lines = math.ceil(self.slots * self.cache_load_factor)
        return payload + lines * self.line_bytes + self.line_map_bytes

    @property
    def insert_scratch_bytes(self) -> int:
        """The device bytes of the CUDA insert kernels' scratch (the stage where the row arrays
        are on the device): ``shared.hashtable.cuda.insert.scratch_bytes`` after a first insert,
        less its batch-sized ``rep_of``."""
        on_device = self.row_arrays is RowArrays.DEVICE
        return self.scratch_bytes + (self.stage_bytes if on_device else 0)

    def device_parts(self) -> dict[str, int]:
        """The device bytes by part (:attr:`hbm_bytes` is their sum; ``counters`` holds the
        counter table's insert scratch, ``insert_scratch`` this table's)."""
        on_device = self.row_arrays is RowArrays.DEVICE
        return {
            "index": self.index_bytes,
            "row_arrays": self.row_array_bytes if on_device else 0,
            "cache": self.cache_bytes,
            "counters": self.counter_bytes,
            "insert_scratch": self.insert_scratch_bytes,
        }

    def host_parts(self) -> dict[str, int]:
        """The host bytes by part (:attr:`host_bytes` is their sum): CACHING keeps every row on
        the host (the cache is a copy of the hot ones); the row arrays and the insert kernels'
        stage scratch are there when the row arrays are planned there."""
        hosted = self.row_arrays is RowArrays.HOST
        return {
            "rows": self.value_bytes if self.mode is StorageMode.CACHING else 0,
            "row_arrays": self.row_array_bytes if hosted else 0,
            "insert_stage": self.stage_bytes if hosted else 0,
        }

    @property
    def hbm_bytes(self) -> int:
        return sum(self.device_parts().values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts().values())

    def line(self) -> str:
        """The plan's log line for this table."""
        source = "planned" if self.planned else "config"
        rows = ""
        if self.row_array_bytes:
            rows = f"; row arrays on the {self.row_arrays.value.lower()}"
        return (
            f"{self.table}: mode={self.mode.value} cache_load_factor={self.cache_load_factor:.2f} "
            f"({source}) hbm={self.hbm_bytes / GIB:.3f}GiB host={self.host_bytes / GIB:.3f}GiB "
            f"({self.slots:,} slots x dim {self.dim}{rows})"
        )


def _slots(capacity: int, bucket_capacity: int) -> int:
    bucket = min(bucket_capacity, capacity)
    return math.ceil(capacity / bucket) * bucket


def insert_scratch_bytes(slots: int, buckets: int, row_arrays: RowArrays) -> int:
    """Device bytes of the scratch the CUDA insert kernels keep with a table of ``slots`` in
    ``buckets`` whose row arrays are where ``row_arrays`` says (the stage goes with them):
    ``shared.hashtable.cuda.insert.scratch_bytes`` after a first insert, less the batch-sized
    ``rep_of`` (module doc).

    >>> insert_scratch_bytes(1024, 8, RowArrays.DEVICE)  # 12 B a slot, 20 a bucket, 256
    12704
    """
    stage = INSERT_STAGE_BYTES_PER_SLOT * slots if row_arrays is RowArrays.DEVICE else 0
    return _scratch_on_device(slots, buckets) + stage


def _scratch_on_device(slots: int, buckets: int) -> int:
    """The insert scratch's bytes on the device wherever the row arrays are (all but ``stage``)."""
    return (
        INSERT_SCRATCH_BYTES_PER_SLOT * slots
        + INSERT_SCRATCH_BYTES_PER_BUCKET * buckets
        + INSERT_SCRATCH_BYTES_PER_TABLE
    )


def _base(t: TableSpec) -> TablePlacement:
    d = t.dynamic
    assert d is not None, f"{t.name} is not dynamic"
    slots = _slots(d.max_capacity, d.bucket_capacity)
    buckets = slots // min(d.bucket_capacity, d.max_capacity)
    counters = 0
    if d.admission is not None:  # a table of its own (row arrays on the device), inserted into
        a = d.admission
        counter_slots = _slots(a.counter_capacity, a.counter_bucket_capacity)
        counter_buckets = counter_slots // min(a.counter_bucket_capacity, a.counter_capacity)
        counters = (
            counter_slots * INDEX_BYTES_PER_SLOT
            + counter_buckets * BUCKET_BYTES
            + insert_scratch_bytes(counter_slots, counter_buckets, RowArrays.DEVICE)
        )
    factor = 1.0 if d.cache_load_factor is None else d.cache_load_factor
    return TablePlacement(
        table=t.name,
        mode=StorageMode.HBM_ONLY if factor >= 1.0 else StorageMode.CACHING,
        cache_load_factor=factor,
        planned=False,
        slots=slots,
        dim=t.dim,
        index_bytes=slots * SLOT_BYTES_PER_SLOT + buckets * BUCKET_BYTES,
        value_bytes=slots * t.dim * VALUE_BYTES_PER_DIM,
        counter_bytes=counters,
        row_array_bytes=slots * ROW_ARRAY_BYTES_PER_SLOT,
        line_bytes=LINE_BYTES,
        line_map_bytes=slots * LINE_MAP_BYTES_PER_SLOT,
        scratch_bytes=_scratch_on_device(slots, buckets),
        stage_bytes=slots * INSERT_STAGE_BYTES_PER_SLOT,
    )


def plan_placement(tables: Sequence[TableSpec], *, hbm_budget: int | None) -> list[TablePlacement]:
    """Every dynamic table's placement. ``hbm_budget``: bytes of device memory the tables may use
    (None: no budget, each table as its config says). Tables whose config sets
    ``cache_load_factor`` keep it; the others share one planned factor when the budget needs one.
    When no factor of at least :data:`MIN_PLANNED_FACTOR` fits, the CACHING tables' row arrays go
    to the host and the factor is planned again. Raises :class:`PlacementError` when the budget
    cannot hold the plan."""
    plans = [_base(t) for t in tables if t.dynamic is not None]
    if hbm_budget is None:
        return plans
    if hbm_budget <= 0:
        raise PlacementError(f"the HBM budget must be > 0 bytes, got {hbm_budget}")
    total = sum(p.hbm_bytes for p in plans)
    if total <= hbm_budget:
        return plans
    explicit = {t.name for t in tables if t.dynamic and t.dynamic.cache_load_factor is not None}
    free = {p.table for p in plans if p.cache_load_factor >= 1.0 and p.table not in explicit}
    fitted = _fit(plans, free, hbm_budget)
    if fitted is not None:
        return fitted
    # the tables that will be CACHING: the planned ones and those the config caches
    hosted = [
        replace(p, row_arrays=RowArrays.HOST)
        if p.table in free or p.mode is StorageMode.CACHING
        else p
        for p in plans
    ]
    fitted = _fit(hosted, free, hbm_budget)
    if fitted is not None:
        return fitted
    least = [_with_factor(p, MIN_PLANNED_FACTOR) if p.table in free else p for p in hosted]
    biggest = max(plans, key=lambda p: p.hbm_bytes)
    raise PlacementError(
        f"the dynamic tables need {total / GIB:.2f} GiB of HBM HBM-only and at least "
        f"{sum(p.hbm_bytes for p in least) / GIB:.2f} GiB with a {MIN_PLANNED_FACTOR:.0%} cache "
        f"and the cached tables' row arrays (key, table id, score) in host memory, but the "
        f"budget is {hbm_budget / GIB:.2f} GiB; the biggest is {biggest.line()}. Lower its "
        "max_capacity (or dim), or raise the budget"
    )


def _fit(
    plans: Sequence[TablePlacement], free: set[str], budget: int
) -> list[TablePlacement] | None:
    """``plans`` with one factor for the ``free`` tables that fits ``budget`` (unchanged when they
    fit as they are), or None when a :data:`MIN_PLANNED_FACTOR` cache does not fit."""
    if sum(p.hbm_bytes for p in plans) <= budget:
        return list(plans)
    if not free:
        return None
    # every byte but the cache's lines: the index, counters, row arrays, insert scratch
    fixed = sum(p.hbm_bytes for p in plans if p.table not in free)
    fixed += sum(_with_factor(p, 0.0).hbm_bytes for p in plans if p.table in free)
    # device bytes per unit of factor: the lines' payload and bookkeeping
    tiered = sum(p.value_bytes + p.slots * p.line_bytes for p in plans if p.table in free)
    room = budget - fixed - len(free) * (1 + LINE_BYTES)  # each table's ceil()s: < 18 B more
    factor = math.floor(room / tiered * 100) / 100 if tiered else 0.0
    if factor < MIN_PLANNED_FACTOR:
        return None
    hosted = any(p.row_arrays is RowArrays.HOST for p in plans if p.table in free)
    if hosted:  # a table with host row arrays stays CACHING (unreachable at dim >= 1 anyway)
        factor = min(factor, 1.0 - MIN_PLANNED_FACTOR)
    return [_with_factor(p, factor) if p.table in free else p for p in plans]


def _with_factor(p: TablePlacement, factor: float) -> TablePlacement:
    mode = StorageMode.HBM_ONLY if factor >= 1.0 else StorageMode.CACHING
    return replace(p, mode=mode, cache_load_factor=min(factor, 1.0), planned=True)


def describe(plans: Sequence[TablePlacement]) -> list[str]:
    """One line per table, then the totals."""
    hbm = sum(p.hbm_bytes for p in plans)
    host = sum(p.host_bytes for p in plans)
    total = f"total: hbm={hbm / GIB:.3f}GiB host={host / GIB:.3f}GiB ({len(plans)} dynamic tables)"
    return [p.line() for p in plans] + [total]
