"""Where each dynamic table's rows live, and what that costs in device and host memory.

TorchEasyRec's ``cache_load_factor`` is "the share of a table's rows whose values live in HBM":
1.0 (or absent) is HBM_ONLY, every row on the device; below 1.0 it is dynamicemb's CACHING, an
HBM cache of that share of the rows over a host tier that holds every row. This module plans it
once per table, before anything is allocated, from the config alone:

- each table's bytes on the device and on the host, from the layout the tables really allocate
  (:mod:`shared.hashtable.layout`): an index of 36 bytes a slot (fingerprint, row, key, table id,
  score), the values and the Adagrad state (``8 * dim`` bytes a slot, the part a cache tiers), and
  an admission counter table of 36 bytes a counter slot;
- with a device budget (``train_config.table_hbm_budget_gib``, ``--hbm-budget-gib``), the factor of
  every table the config leaves unset, when the tables do not fit HBM-only, as tzrec's planner does:
  the index and the counters stay in HBM (as tzrec accounts them) and one common share of the values
  is cached. A budget the indexes alone exceed is refused, naming the biggest table.

A CACHING table's storage (:mod:`shared.hashtable.row_cache`) gets ``ceil(factor * max_capacity)``
cache lines on the device over a host tier of every row: what ``hbm_bytes`` and ``host_bytes`` count.

    >>> lines = describe(plan_placement(fs.dynamic_tables, hbm_budget=None))
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.features import TableSpec

GIB = 1 << 30
# Bytes a slot of a table's index: slot_fp, slot_row, row_key, row_score (int64) and row_tid (int32)
INDEX_BYTES_PER_SLOT = 8 + 8 + 8 + 8 + 4
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
    """One dynamic table's plan. ``slots``: its max capacity rounded up to whole buckets."""

    table: str
    mode: StorageMode
    cache_load_factor: float
    planned: bool  # True: the budget chose the factor; False: the config's (or 1.0)
    slots: int
    dim: int
    index_bytes: int  # the hash index, always on the device
    value_bytes: int  # values + Adagrad state of every slot
    counter_bytes: int  # admission counters, on the device

    @property
    def hbm_bytes(self) -> int:
        cached = math.ceil(self.value_bytes * self.cache_load_factor)
        return self.index_bytes + self.counter_bytes + cached

    @property
    def host_bytes(self) -> int:
        """CACHING keeps every row on the host (the cache is a copy of the hot ones)."""
        return self.value_bytes if self.mode is StorageMode.CACHING else 0

    def line(self) -> str:
        """The plan's log line for this table."""
        source = "planned" if self.planned else "config"
        return (
            f"{self.table}: mode={self.mode.value} cache_load_factor={self.cache_load_factor:.2f} "
            f"({source}) hbm={self.hbm_bytes / GIB:.3f}GiB host={self.host_bytes / GIB:.3f}GiB "
            f"({self.slots:,} slots x dim {self.dim})"
        )


def _slots(capacity: int, bucket_capacity: int) -> int:
    bucket = min(bucket_capacity, capacity)
    return math.ceil(capacity / bucket) * bucket


def _base(t: TableSpec) -> TablePlacement:
    d = t.dynamic
    assert d is not None, f"{t.name} is not dynamic"
    slots = _slots(d.max_capacity, d.bucket_capacity)
    counters = 0
    if d.admission is not None:
        a = d.admission
        counters = _slots(a.counter_capacity, a.counter_bucket_capacity) * INDEX_BYTES_PER_SLOT
    factor = 1.0 if d.cache_load_factor is None else d.cache_load_factor
    return TablePlacement(
        table=t.name,
        mode=StorageMode.HBM_ONLY if factor >= 1.0 else StorageMode.CACHING,
        cache_load_factor=factor,
        planned=False,
        slots=slots,
        dim=t.dim,
        index_bytes=slots * INDEX_BYTES_PER_SLOT,
        value_bytes=slots * t.dim * VALUE_BYTES_PER_DIM,
        counter_bytes=counters,
    )


def plan_placement(tables: Sequence[TableSpec], *, hbm_budget: int | None) -> list[TablePlacement]:
    """Every dynamic table's placement. ``hbm_budget``: bytes of device memory the tables may use
    (None: no budget, each table as its config says). Tables whose config sets
    ``cache_load_factor`` keep it; the others share one planned factor when the budget needs one.
    Raises :class:`PlacementError` when the budget cannot hold the plan."""
    plans = [_base(t) for t in tables if t.dynamic is not None]
    if hbm_budget is None:
        return plans
    if hbm_budget <= 0:
        raise PlacementError(f"the HBM budget must be > 0 bytes, got {hbm_budget}")
    total = sum(p.hbm_bytes for p in plans)
    if total <= hbm_budget:
        return plans
    free = [p for p in plans if p.cache_load_factor >= 1.0 and not _explicit(tables, p.table)]
    fixed = sum(p.hbm_bytes for p in plans if p not in free)
    fixed += sum(p.index_bytes + p.counter_bytes for p in free)
    tiered = sum(p.value_bytes for p in free)
    factor = math.floor((hbm_budget - fixed) / tiered * 100) / 100 if tiered else 0.0
    if factor < MIN_PLANNED_FACTOR:
        biggest = max(plans, key=lambda p: p.hbm_bytes)
        raise PlacementError(
            f"the dynamic tables need {total / GIB:.2f} GiB of HBM HBM-only and at least "
            f"{(fixed + math.ceil(tiered * MIN_PLANNED_FACTOR)) / GIB:.2f} GiB with a "
            f"{MIN_PLANNED_FACTOR:.0%} cache, but the budget is {hbm_budget / GIB:.2f} GiB; the "
            f"biggest is {biggest.line()}. Lower its max_capacity (or dim), or raise the budget"
        )
    return [_with_factor(p, factor) if p in free else p for p in plans]


def _explicit(tables: Sequence[TableSpec], name: str) -> bool:
    """Whether the config set the table's cache_load_factor itself."""
    spec = next(t for t in tables if t.name == name)
    return spec.dynamic is not None and spec.dynamic.cache_load_factor is not None


def _with_factor(p: TablePlacement, factor: float) -> TablePlacement:
    mode = StorageMode.HBM_ONLY if factor >= 1.0 else StorageMode.CACHING
    return TablePlacement(
        table=p.table,
        mode=mode,
        cache_load_factor=min(factor, 1.0),
        planned=True,
        slots=p.slots,
        dim=p.dim,
        index_bytes=p.index_bytes,
        value_bytes=p.value_bytes,
        counter_bytes=p.counter_bytes,
    )


def describe(plans: Sequence[TablePlacement]) -> list[str]:
    """One line per table, then the totals."""
    hbm = sum(p.hbm_bytes for p in plans)
    host = sum(p.host_bytes for p in plans)
    total = f"total: hbm={hbm / GIB:.3f}GiB host={host / GIB:.3f}GiB ({len(plans)} dynamic tables)"
    return [p.line() for p in plans] + [total]
