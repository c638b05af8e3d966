"""The arrays of a bucketized hash table of int64 keys → rows, and their sizing.

Layout (``capacity = num_buckets * bucket_capacity`` slots and as many rows)::

    slot_fp   [capacity] int64   fingerprint of the slot's key; empty slot: its bucket's sentinel
    slot_row  [capacity] int64   row of the slot's key (a permutation of the bucket's own rows)
    row_key   [capacity] int64   key of the row, -1 when the row is free
    row_tid   [capacity] int32   table id of the row (separate key spaces for fused tables)
    row_score [capacity] int64   eviction score (step, timestamp or use count; set by the caller)
    values    [capacity, dim]    float32 embedding rows
    accumulators [capacity, dim] float32 Adagrad state (optional)

A key's bucket is ``floor(u * num_buckets / 2**64)`` for the unsigned value ``u`` of its 64-bit
fingerprint (splitmix64 of the key, salted by the table id; even), so buckets are contiguous
fingerprint ranges. Inside a bucket the occupied slots come first, sorted by fingerprint, and the
empty slots hold the bucket's sentinel (an odd value above all of the bucket's fingerprints and
not above the next bucket's). The whole slot array is therefore one sorted sequence. Keys must be
non-negative (-1 marks a free row).

:class:`TableLayout` holds these arrays and the counters beside them; it has no algorithms. The
algorithms that read and write it are a backend's (:mod:`shared.hashtable.backend`): the torch
one (``torch_backend.py``) and the CUDA kernels (``cuda/``), which work on these same arrays.
:class:`~shared.hashtable.table.HashTable` is the public table: a layout with its backend.

**Where the row arrays live** (:class:`RowArrays`, chosen when the table is made): ``row_key``,
``row_tid`` and ``row_score`` (20 B a slot) are device memory (``DEVICE``, the default) or, on
CUDA, page-locked host memory mapped into the device (``HOST``,
:func:`~shared.hashtable.host_store.mapped_device_view`): CUDA tensors aliasing host memory, so
every algorithm, torch's and the CUDA kernels', runs on them unchanged, each access crossing PCIe
(a find's confirmation reads ``row_key``/``row_tid`` there, a score write goes there). It is for
CACHING storages of tables whose index does not fit the device (issue #52's 500M keys: the slot
arrays stay, 16 B a slot; see docs/design.md). :meth:`TableLayout._allocate` is the one place
they are made (growth and bulk builds go through it). On the CPU both are plain memory: the same
arrays, the option changes only the planner's accounting.

**Deferred counts.** A backend may leave changes of the size and counters to be read later
(:meth:`TableLayout._defer`, :class:`Counts`): the CUDA erase of keys known valid
(``HashTable.erase(..., count=False)``) and the CUDA overflow of full buckets for callers that
take padded evictions (``insert_or_assign(..., exact=False)``) copy their stats to pinned memory
and read them only when needed. ``_size``, :attr:`~TableLayout.evictions` and
:attr:`~TableLayout.refusals` are therefore properties: reading or assigning one first applies
every pending change (:meth:`TableLayout._settle`: an event wait that has long finished by
then), so they are exact whenever read; a backend settles too before it reuses the buffers a
pending change reads.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.features import ScoreStrategy
from shared.hashtable.hashing import bucket_sentinels, check_keys
from shared.hashtable.host_store import mapped_device_full

EMPTY_KEY = -1


@enum.unique
class RowArrays(enum.Enum):
    """Where a table's per-row arrays (``row_key``, ``row_tid``, ``row_score``) live (module doc)."""

    DEVICE = "DEVICE"  # the table's device
    HOST = "HOST"  # on CUDA page-locked host memory mapped into the device (UVA); on CPU, memory


class Counts(NamedTuple):
    """Changes of a table's size and counters that a backend reads later (``_defer``)."""

    size: int
    evictions: int = 0
    refusals: int = 0


class SelectedInsert(NamedTuple):
    """What a backend's ``insert_selected`` did (a captured step's insert; every size static,
    every count on the device)."""

    rows: torch.Tensor  # [M] int64: each selected key's row, -1 if refused or not selected
    inserted: torch.Tensor  # [M] bool: selected and now stored
    counts: torch.Tensor  # [3] int64: the table's size change, its evictions, its refusals
    evicted_table_ids: torch.Tensor  # [M] int64: each evicted entry's table id, then -1
    failed: torch.Tensor  # [] bool: the kernels refused the call (nothing changed)


class ExportedRows(NamedTuple):
    """Stored entries, sorted by (table id, key). ``accumulators`` is None without optimizer state."""

    keys: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N, dim] float32
    scores: torch.Tensor  # [N] int64
    accumulators: torch.Tensor | None  # [N, dim] float32
    table_ids: torch.Tensor  # [N] int64


@dataclass
class InsertResult:
    """What :meth:`HashTable.insert_or_assign` did, per input key (duplicates share a result)."""

    rows: torch.Tensor  # [n] int64: row of the key after the call, -1 if it is not stored
    inserted: torch.Tensor  # [n] bool: the key was new and is now stored
    evicted_keys: torch.Tensor  # [E] int64: keys removed to make room
    evicted_table_ids: torch.Tensor  # [E] int64
    num_refused: int  # new (unique) keys that could not be stored
    # insert_or_assign(..., exact=False) may pad evicted_keys and evicted_table_ids with -1 at
    # the end (E then bounds the evictions; take the entries >= 0) and give num_refused -1
    # (not read on the host: the table's refusals counter has it)


class TableLayout:
    """The arrays and counters of one table (see the module docstring), allocated empty.

    Starts with ``ceil(init_capacity / bucket_capacity)`` buckets; growth may double them up to
    ``ceil(max_capacity / bucket_capacity)`` (capacities are rounded up to whole buckets;
    ``bucket_capacity`` is capped at ``max_capacity``). See :class:`HashTable` for the rules.
    """

    def __init__(
        self,
        dim: int,
        *,
        init_capacity: int,
        max_capacity: int,
        bucket_capacity: int = 128,
        score_strategy: ScoreStrategy = ScoreStrategy.STEP,
        max_load_factor: float = 0.5,
        with_accumulator: bool = False,
        initial_accumulator_value: float = 0.0,
        device: torch.device | str = "cpu",
        row_arrays: RowArrays = RowArrays.DEVICE,
    ) -> None:
        if dim < 0:
            raise ValueError(f"HashTable: dim must be >= 0, got {dim}")
        if not 1 <= init_capacity <= max_capacity:
            raise ValueError(
                f"HashTable: need 1 <= init_capacity ({init_capacity}) <= max_capacity "
                f"({max_capacity})"
            )
        if bucket_capacity < 1:
            raise ValueError(f"HashTable: bucket_capacity must be >= 1, got {bucket_capacity}")
        if not 0.0 < max_load_factor <= 1.0:
            raise ValueError(f"HashTable: max_load_factor must be in (0, 1], got {max_load_factor}")
        self.dim = dim
        self.bucket_capacity = min(bucket_capacity, max_capacity)
        self.score_strategy = score_strategy
        self.max_load_factor = max_load_factor
        self.with_accumulator = with_accumulator
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.device = torch.device(device)
        self.row_arrays = row_arrays
        self._max_buckets = math.ceil(max_capacity / self.bucket_capacity)
        if self._max_buckets >= 1 << 31:
            raise ValueError(f"HashTable: max_capacity {max_capacity} needs >= 2**31 buckets")
        self._pending: list[Callable[[], Counts]] = []  # changes not read yet (_defer)
        # the size and counters without the pending changes (see the properties)
        self._settled_size = self._settled_evictions = self._settled_refusals = 0
        self.generation = 0  # bumped whenever rows move (growth)
        self._allocate(min(math.ceil(init_capacity / self.bucket_capacity), self._max_buckets))

    # ------------------------------------------------------------------ properties

    @property
    def num_buckets(self) -> int:
        return self._num_buckets

    @property
    def capacity(self) -> int:
        return self._num_buckets * self.bucket_capacity

    @property
    def max_capacity(self) -> int:
        """The capacity growth stops at (max_capacity rounded up to whole buckets)."""
        return self._max_buckets * self.bucket_capacity

    @property
    def size(self) -> int:
        return self._size

    @property
    def _size(self) -> int:
        """Stored entries, exact: the pending changes applied first (see the module docstring)."""
        if self._pending:
            self._settle()
        return self._settled_size

    @_size.setter
    def _size(self, value: int) -> None:
        if self._pending:
            self._settle()  # the pending changes come before this assignment
        self._settled_size = value

    @property
    def evictions(self) -> int:
        """Existing keys removed to make room (cumulative; pending changes applied first)."""
        if self._pending:
            self._settle()
        return self._settled_evictions

    @evictions.setter
    def evictions(self, value: int) -> None:
        if self._pending:
            self._settle()
        self._settled_evictions = value

    @property
    def refusals(self) -> int:
        """New keys not stored (cumulative; pending changes applied first)."""
        if self._pending:
            self._settle()
        return self._settled_refusals

    @refusals.setter
    def refusals(self, value: int) -> None:
        if self._pending:
            self._settle()
        self._settled_refusals = value

    def _defer(self, counts: Callable[[], Counts]) -> None:
        """Add ``counts()`` (changes of size, evictions and refusals, read on the host when
        called) later: at the next read or assignment of ``_size``, :attr:`evictions` or
        :attr:`refusals`, or at :meth:`_settle`, in the order deferred."""
        self._pending.append(counts)

    def _settle(self) -> None:
        """Apply the pending changes (:meth:`_defer`) now."""
        pending, self._pending = self._pending, []
        for counts in pending:
            size, evictions, refusals = counts()
            self._settled_size += size
            self._settled_evictions += evictions
            self._settled_refusals += refusals

    @property
    def load_factor(self) -> float:
        return self._size / self.capacity

    @property
    def values(self) -> torch.Tensor:
        """[capacity, dim] float32, indexed by the rows that ``find`` returns."""
        return self._values

    @property
    def accumulators(self) -> torch.Tensor | None:
        """[capacity, dim] float32 Adagrad state beside :attr:`values` (None without it)."""
        return self._accum

    @property
    def row_keys(self) -> torch.Tensor:
        """[capacity] int64 key of each row, -1 for free rows (read-only view of the table)."""
        return self._row_key

    @property
    def row_table_ids(self) -> torch.Tensor:
        return self._row_tid

    # ------------------------------------------------------------------ storage

    def _allocate(self, num_buckets: int) -> None:
        """Replace every array by an empty table of ``num_buckets`` buckets."""
        b, dev = self.bucket_capacity, self.device
        cap = num_buckets * b
        self._num_buckets = num_buckets
        self._sentinel = bucket_sentinels(num_buckets, dev)  # [nb]
        self._slot_fp = self._sentinel.repeat_interleave(b)  # [cap]
        self._slot_row = torch.arange(cap, dtype=torch.int64, device=dev)
        self._row_key = self.row_array(cap, EMPTY_KEY, torch.int64)
        self._row_tid = self.row_array(cap, 0, torch.int32)
        self._row_score = self.row_array(cap, 0, torch.int64)
        self._values = torch.zeros(cap, self.dim, dtype=torch.float32, device=dev)
        self._accum = (
            torch.full(
                (cap, self.dim), self.initial_accumulator_value, dtype=torch.float32, device=dev
            )
            if self.with_accumulator
            else None
        )
        self._bucket_count = torch.zeros(num_buckets, dtype=torch.int64, device=dev)
        self._size = 0
        self._any_tid = False  # whether a non-zero table id was ever stored

    def row_array(self, n: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
        """[n] ``fill`` where :attr:`row_arrays` says: for ``HOST`` on CUDA host memory mapped
        into the device (a CUDA tensor; the CUDA driver's where ``shared.hashtable.host_memory``
        says ``driver``), else the table's device memory. The row arrays, and
        the CUDA insert kernels' per-slot ``stage`` scratch (``cuda/insert.py``), are made here."""
        if self.row_arrays is RowArrays.HOST and self.device.type == "cuda":
            return mapped_device_full(n, fill, dtype, self.device)
        return torch.full((n,), fill, dtype=dtype, device=self.device)

    def _prepare(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, what: str, validate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``keys`` [N] (and ``table_ids``) as int64 on the table's device, checked; raises the
        error naming ``what`` (``validate=False``: no host-synchronising sign/range checks)."""
        keys = check_keys(keys.to(self.device), what, check_sign=validate)
        if table_ids is None:
            return keys, None
        table_ids = table_ids.to(self.device, torch.int64)
        if table_ids.shape != keys.shape:
            raise ValueError(
                f"{what}: table_ids shape {tuple(table_ids.shape)} != keys shape "
                f"{tuple(keys.shape)}"
            )
        if validate and bool(((table_ids < 0) | (table_ids >= 1 << 31)).any()):
            raise ValueError(f"{what}: table ids must be in [0, 2**31)")
        return keys, table_ids
