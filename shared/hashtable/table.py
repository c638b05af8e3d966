"""HashTable: int64 keys → rows of a float32 value buffer, with growth, eviction and a backend.

The table's arrays are a :class:`~shared.hashtable.layout.TableLayout` (its docstring has the
layout: bucketized slots sorted by fingerprint, rows beside them). Its operations are those of
its backend (:mod:`shared.hashtable.backend`), chosen once, when the table is made or copied to
a device (:meth:`HashTable.to`), and shown in its repr: on a CUDA device with CuPy installed the
kernels of :mod:`shared.hashtable.cuda`, elsewhere the torch backend, which is the CPU path and
the reference; both give the same rows, key sets and results (the GPU tests compare them).
``HashTable(..., backend=TorchBackend())`` picks one explicitly.

Determinism: the same sequence of calls gives the same table on CPU and CUDA, with either
backend. Keys must be non-negative (-1 marks a free row).
"""

from __future__ import annotations

import copy
import math
from typing import Literal, overload

import torch

from shared.features import ScoreStrategy, TableSpec
from shared.hashtable.backend import Backend, backend_for
from shared.hashtable.hashing import count_ids, unique_pairs
from shared.hashtable.layout import ExportedRows, InsertResult, RowArrays, TableLayout

__all__ = ["ExportedRows", "HashTable", "InsertResult", "RowArrays"]
# the per-row arrays whose place RowArrays chooses (layout.py)
_ROW_ARRAYS = ("_row_key", "_row_tid", "_row_score")


class HashTable(TableLayout):
    """int64 keys → rows of ``values``; see the module docstring for the layout and backends.

    ``HashTable(16, init_capacity=1024, max_capacity=1 << 20)`` starts with
    ``ceil(init_capacity / bucket_capacity)`` buckets and doubles them whenever an insert would
    push the load factor above ``max_load_factor`` or overflow a bucket, up to
    ``ceil(max_capacity / bucket_capacity)`` buckets (capacities are rounded up to whole buckets;
    ``bucket_capacity`` is capped at ``max_capacity``). At that size, when a key's bucket is full,
    the entry with the lowest score leaves (ties: the newcomer stays, then the lower
    fingerprint), except for ``pinned_rows``; under ``ScoreStrategy.NO_EVICTION`` new keys are
    refused instead. Evictions and refusals are counted in :attr:`evictions` / :attr:`refusals`.
    The table does not compute scores: the caller passes them (see ``storage.py``).
    ``backend`` (default: :func:`~shared.hashtable.backend.backend_for` the device) runs every
    operation; it stays the table's :attr:`backend`. ``row_arrays``: where the per-row arrays
    live (:class:`~shared.hashtable.layout.RowArrays`; ``HOST``: mapped host memory on CUDA).
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
        backend: Backend | None = None,
        row_arrays: RowArrays = RowArrays.DEVICE,
    ) -> None:
        super().__init__(
            dim,
            init_capacity=init_capacity,
            max_capacity=max_capacity,
            bucket_capacity=bucket_capacity,
            score_strategy=score_strategy,
            max_load_factor=max_load_factor,
            with_accumulator=with_accumulator,
            initial_accumulator_value=initial_accumulator_value,
            device=device,
            row_arrays=row_arrays,
        )
        self.backend = self._checked(backend)

    def _checked(self, backend: Backend | None) -> Backend:
        chosen = backend_for(self.device) if backend is None else backend
        if not chosen.accepts(self.device):
            raise ValueError(
                f"HashTable: the {chosen.name!r} backend cannot run a table on {self.device}; "
                "pass backend=None to get the default backend of the device"
            )
        return chosen

    def __repr__(self) -> str:
        host = ", row_arrays=HOST" if self.row_arrays is RowArrays.HOST else ""
        return (
            f"HashTable(dim={self.dim}, size={self.size}, capacity={self.capacity}, "
            f"max_capacity={self.max_capacity}, bucket_capacity={self.bucket_capacity}, "
            f"score_strategy={self.score_strategy.value}{host}, device={self.device}, "
            f"backend={self.backend.name})"
        )

    @classmethod
    def from_spec(
        cls,
        spec: TableSpec,
        *,
        device: torch.device | str = "cpu",
        with_accumulator: bool = True,
        initial_accumulator_value: float = 0.0,
        max_load_factor: float = 0.5,
        backend: Backend | None = None,
    ) -> HashTable:
        """The table of one dynamic :class:`TableSpec` (capacities, buckets, score strategy)."""
        if spec.dynamic is None:
            raise ValueError(f"table {spec.name!r} is not dynamic (num_rows={spec.num_rows})")
        d = spec.dynamic
        return cls(
            spec.dim,
            init_capacity=d.init_capacity,
            max_capacity=d.max_capacity,
            bucket_capacity=d.bucket_capacity,
            score_strategy=d.score_strategy,
            max_load_factor=max_load_factor,
            with_accumulator=with_accumulator,
            initial_accumulator_value=initial_accumulator_value,
            device=device,
            backend=backend,
        )

    def to(self, device: torch.device | str, *, backend: Backend | None = None) -> HashTable:
        """A copy of this table on ``device`` with ``backend`` (default: ``backend_for`` the
        device). Always a new table, also on the same device; this one keeps its backend. The
        copy's row arrays live where this table's do (:attr:`row_arrays`)."""
        device = torch.device(device)
        self._settle()  # the copy starts with the exact size and nothing pending
        out = copy.copy(self)
        out._pending = []
        out.device = device
        for name, value in vars(self).items():
            if name in _ROW_ARRAYS:  # where the copy's row_arrays says, as _allocate makes them
                placed = out.row_array(value.numel(), 0, value.dtype)
                setattr(out, name, placed.copy_(value))
            elif isinstance(value, torch.Tensor):
                setattr(out, name, value.to(device, copy=True))
        out.backend = out._checked(backend)
        return out

    # ------------------------------------------------------------------ queries

    def find(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None = None, *, validate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys`` [N] → ``(rows [N] int64, found [N] bool)``; rows are -1 where missing.

        A row indexes :attr:`values` / :attr:`accumulators` (dynamicemb calls it the slot).
        ``table_ids`` [N] selects the key space of each key (fused tables; default 0).
        ``validate=False`` skips the check for negative keys (reported missing instead), which
        is the only host synchronisation of a find on a table without fused key spaces.
        """
        keys, table_ids = self._prepare(keys, table_ids, "HashTable.find", validate)
        return self.backend.find(self, keys, table_ids)

    def scores_of(self, rows: torch.Tensor) -> torch.Tensor:
        return self._row_score[rows]

    def set_scores(self, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrite the scores of distinct existing ``rows`` (e.g. the rows used in a step)."""
        self._row_score[rows] = scores.to(self.device, torch.int64)

    def decay_scores(self, shift: int) -> None:
        """Every row's score shifted right by ``shift`` bits, in place (LFU decay,
        :class:`~shared.features.LfuDecaySpec`): one device op on the score array, no host
        read, the same tensor after (a captured static step keeps reading it). Free rows
        score 0 and stay 0; counts are non-negative, so the shift is a floor division by
        ``2**shift``. Only for use counts: STEP and TIMESTAMP scores are points in time."""
        if self.score_strategy is not ScoreStrategy.LFU:
            raise ValueError(
                f"decay_scores: the table's scores are {self.score_strategy.value}, not LFU "
                "use counts; only LFU counts decay"
            )
        self._row_score.bitwise_right_shift_(shift)

    def export(self, table_id: int | None = None) -> ExportedRows:
        """Copies of every stored entry (of one key space if ``table_id`` is given), sorted by
        (table id, key) so that the same content exports the same bytes."""
        live = self._row_key >= 0
        if table_id is not None:
            live &= self._row_tid == table_id
        rows = torch.nonzero(live).squeeze(1)
        keys, tids = self._row_key[rows], self._row_tid[rows].to(torch.int64)
        order, _, _, _, _ = unique_pairs(keys, tids if table_id is None else None)
        rows = rows[order]
        return ExportedRows(
            keys=self._row_key[rows],
            values=self._values[rows],
            scores=self._row_score[rows],
            accumulators=None if self._accum is None else self._accum[rows],
            table_ids=self._row_tid[rows].to(torch.int64),
        )

    def table_sizes(self, num_tables: int) -> torch.Tensor:
        """[num_tables] int64: stored keys per table id (no host read: free rows count as the
        id ``num_tables``, which :func:`count_ids` leaves out)."""
        tids = torch.where(self._row_key >= 0, self._row_tid.to(torch.int64), num_tables)
        return count_ids(tids, num_tables)

    # ------------------------------------------------------------------ updates

    def insert_or_assign(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        table_ids: torch.Tensor | None = None,
        accumulators: torch.Tensor | None = None,
        pinned_rows: torch.Tensor | None = None,
        exact: bool = True,
    ) -> InsertResult:
        """Store ``values`` [n, dim] and ``scores`` [n] for ``keys`` [n].

        Existing keys get the new values and scores (and accumulators if given, else they keep
        theirs); new keys are inserted (accumulators default to ``initial_accumulator_value``),
        growing the table first if the load factor bound would be exceeded. Duplicate keys: the
        last occurrence wins. ``pinned_rows`` (rows from :meth:`find`) are never evicted by this
        call, e.g. the rows of the keys the current batch uses.

        ``exact=False``: the caller takes ``evicted_keys`` / ``evicted_table_ids`` padded with -1
        at the end and ``num_refused`` -1 (see :class:`InsertResult`); the CUDA backend then
        reads nothing on the host for full buckets (:attr:`size`, :attr:`evictions` and
        :attr:`refusals` stay exact: they settle when read).
        """
        return self.backend.insert_or_assign(
            self,
            keys,
            values,
            scores,
            table_ids=table_ids,
            accumulators=accumulators,
            pinned_rows=pinned_rows,
            exact=exact,
        )

    @overload
    def erase(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None = None,
        *,
        count: Literal[True] = ...,
    ) -> int: ...
    @overload
    def erase(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None = None, *, count: Literal[False]
    ) -> None: ...
    @overload
    def erase(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None = None, *, count: bool
    ) -> int | None: ...
    def erase(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None = None, *, count: bool = True
    ) -> int | None:
        """Remove ``keys`` (missing ones are ignored); returns how many were removed.

        ``count=False``: the caller does not need the number (returns None), and promises valid
        keys: non-negative, table ids in [0, 2**31) (e.g. keys taken from this table's own
        lookups, as a storage erases admitted keys from its admission counter). The backend may
        then settle the size later (the CUDA backend reads its stats when :attr:`size` is next
        read, without a host sync now); invalid keys are not reported then. Without it invalid
        keys raise the torch backend's error, the table untouched.
        """
        erased = self.backend.erase(self, keys, table_ids, count=count)
        if not count:
            return None
        assert erased is not None  # the backends count when asked to
        return erased

    def reserve_max_capacity(self) -> bool:
        """Allocate the max capacity now: the buckets inserts would grow the table to on the way
        there. Stored entries move (:attr:`generation` changes) and keep their values, scores
        and accumulators. Returns whether the table grew."""
        if self._num_buckets == self._max_buckets:
            return False
        held = self.export() if self.size else None
        self._allocate(self._max_buckets)
        self.generation += 1
        if held is not None:
            self.insert_or_assign(
                held.keys,
                held.values,
                held.scores,
                table_ids=held.table_ids,
                accumulators=held.accumulators,
            )
        return True

    def clear(self, table_id: int | None = None) -> int:
        """Erase every key (of one key space if ``table_id`` is given); returns how many."""
        live = self._row_key >= 0
        if table_id is not None:
            live &= self._row_tid == table_id
        rows = torch.nonzero(live).squeeze(1)
        return self.erase(self._row_key[rows], self._row_tid[rows].to(torch.int64))

    # ------------------------------------------------------------------ bulk build

    @classmethod
    def sized_for(
        cls,
        n: int,
        dim: int,
        *,
        bucket_capacity: int,
        max_load_factor: float,
        max_capacity: int | None,
        score_strategy: ScoreStrategy,
        with_accumulator: bool,
        device: torch.device,
        backend: Backend | None = None,
    ) -> HashTable:
        """An empty table whose capacity holds ``n`` keys at ``max_load_factor`` (growth bounded
        by ``max_capacity``, default that capacity): what a bulk build starts from."""
        cap = max(1, math.ceil(n / max_load_factor))
        return cls(
            dim,
            init_capacity=cap,
            max_capacity=max(cap, max_capacity or cap),
            bucket_capacity=bucket_capacity,
            score_strategy=score_strategy,
            max_load_factor=max_load_factor,
            with_accumulator=with_accumulator,
            device=device,
            backend=backend,
        )

    @classmethod
    def from_keys_values(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        bucket_capacity: int = 128,
        device: torch.device | str = "cpu",
        scores: torch.Tensor | None = None,
        table_ids: torch.Tensor | None = None,
        accumulators: torch.Tensor | None = None,
        max_load_factor: float = 0.5,
        max_capacity: int | None = None,
        score_strategy: ScoreStrategy = ScoreStrategy.STEP,
        backend: Backend | None = None,
    ) -> HashTable:
        """Bulk build from distinct ``keys`` [N] and ``values`` [N, dim] with one sort.

        Sized for ``max_load_factor``; buckets double until none overflows, so nothing is lost.
        ``max_capacity`` (default: the built capacity) bounds later growth. ``backend``
        (default: ``backend_for`` the device) builds the table and stays its backend.
        """
        device = torch.device(device)
        chosen = backend_for(device) if backend is None else backend

        def sized(n: int, dim: int, with_accumulator: bool) -> HashTable:
            return cls.sized_for(
                n,
                dim,
                bucket_capacity=bucket_capacity,
                max_load_factor=max_load_factor,
                max_capacity=max_capacity,
                score_strategy=score_strategy,
                with_accumulator=with_accumulator,
                device=device,
                backend=chosen,
            )

        return chosen.build(
            sized,
            keys,
            values,
            device=device,
            scores=scores,
            table_ids=table_ids,
            accumulators=accumulators,
        )
