"""Where a storage's row payload (values and Adagrad state) lives: the storage's one tier seam.

A :class:`~shared.hashtable.storage.FusedStorage` reads and writes its rows' payload only through
a :class:`RowPayload`, chosen once, when the storage is made, from its tables'
``cache_load_factor`` (:mod:`shared.hashtable.placement`), as TorchRec's compute kernel is chosen
in its plan:

- :class:`DevicePayload` (HBM_ONLY, factor absent or 1.0): the hash table's own ``values`` and
  ``accumulators`` arrays, every row on the device; each method is the single table call the
  storage made before this seam existed, so this path is today's, unchanged.
- :class:`~shared.hashtable.row_cache.RowCache` (CACHING): the index keeps no payload; an HBM
  cache of hot rows over a host tier (:mod:`shared.hashtable.host_store`) that holds every row
  (its ``static_*`` methods: :mod:`shared.hashtable.row_cache_static`).

Both give the same rows bit for bit (on CPU; within the kernels' tolerances on CUDA): the tier is
transparent. Keys, scores, evictions, admission and stats are the index's, and the index is the
same object in both.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.backend import Backend
from shared.hashtable.layout import ExportedRows, InsertResult
from shared.hashtable.table import HashTable


class RowPayload(Protocol):
    """The payload of a storage's rows, by row of its :class:`HashTable` (see module doc)."""

    name: str  # "HBM_ONLY", "CACHING": what the storage's repr shows
    tiered: bool  # whether some rows live off the device (then prefetch is worth a find)

    def gather(self, rows: torch.Tensor, *, stored: int | None = None) -> torch.Tensor:
        """[U, dim] float32: the values of distinct ``rows`` [U] (entries of -1 give any row:
        the caller overwrites them). ``stored``: how many entries are >= 0, where the caller
        has read it already (a tier need not read it again)."""
        ...

    def adagrad(
        self,
        rows: torch.Tensor,
        grads: torch.Tensor,
        config: AdagradConfig,
        *,
        looked_up: torch.Tensor | None = None,
    ) -> None:
        """Adagrad in place on distinct ``rows`` [n] with their summed ``grads`` [n, dim].
        ``looked_up``: the tensor the step's :meth:`gather` was given, where ``rows`` are
        exactly its entries >= 0 in order (a tier may then reuse what it found for them)."""
        ...

    def insert_or_assign(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        table_ids: torch.Tensor | None,
        accumulators: torch.Tensor | None = None,
        pinned_rows: torch.Tensor | None = None,
        exact: bool = True,
    ) -> InsertResult:
        """``HashTable.insert_or_assign`` of distinct keys, their payload stored in this tier."""
        ...

    def export(self) -> ExportedRows:
        """``HashTable.export()`` with every row's values and accumulators."""
        ...

    def reserve_max_capacity(self) -> bool:
        """``HashTable.reserve_max_capacity()``, the payload moved with the rows."""
        ...

    def prefetch(self, rows: torch.Tensor) -> None:
        """Bring distinct ``rows`` [n] (all >= 0) to the device tier before a step needs them."""
        ...

    def why_not_static(self) -> str | None:
        """Why the captured static step cannot run on this tier (None: it can)."""
        ...

    # the static step's form (shared.hashtable.static_step): fixed shapes, no host read

    def static_began(self, padded: int) -> int:
        """Called on the host before each static lookup (of ``padded`` keys), before its
        graphs are looked up; returns a version for :meth:`static_version`."""
        ...

    def static_version(self) -> int:
        """Changes when the slots a static forward resolved may no longer hold its rows (its
        backward refuses to run then)."""
        ...

    def static_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, accumulators) [slots, dim]: what :meth:`static_resolve`'s slots index."""
        ...

    def static_key(self) -> tuple[object, ...]:
        """The addresses a captured step reads beyond the index's (a change: capture again)."""
        ...

    def static_resolve(
        self, rows: torch.Tensor, found: torch.Tensor, new_values: torch.Tensor
    ) -> torch.Tensor:
        """[P] int64: the slot in :meth:`static_arrays` of each of a static step's distinct
        ``rows`` [P] (-1: no row), made ready with no host read. ``found`` [P] bool: stored
        before the step; the others were inserted by it, with values ``new_values`` [P, dim]
        (and the initial accumulators)."""
        ...

    def static_looked_up(self) -> None:
        """Called on the host after each static forward (its graph replayed, or its code run):
        work of the forward's that may go on beside what follows."""
        ...

    def static_updated(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The static backward updated ``slots`` [P] (-1: none) of ``rows`` [P] in place."""
        ...

    def static_prefetch_began(self, padded: int) -> bool:
        """Called on the host before each static prefetch (of ``padded`` rows): whether it may
        run (False: nothing to prefetch, or not now)."""
        ...

    def static_prefetch(self, rows: torch.Tensor) -> None:
        """Bring stored ``rows`` [P] (-1: none) to the device tier, with no host read, while
        the static step before the one that looks them up may still run its backward."""
        ...

    def stats(self) -> dict[str, float]:
        """Cumulative tier counters and bytes per tier (empty where there is nothing to say)."""
        ...


class DevicePayload:
    """HBM_ONLY: the payload is the table's own ``values`` / ``accumulators`` arrays."""

    name = "HBM_ONLY"
    tiered = False

    def __init__(self, table: HashTable, backend: Backend) -> None:
        assert table.accumulators is not None, "a storage's table keeps Adagrad state"
        self.table = table
        self.backend = backend

    def gather(self, rows: torch.Tensor, *, stored: int | None = None) -> torch.Tensor:
        return self.table.values[rows.clamp(min=0)]  # [U, dim]

    def adagrad(
        self,
        rows: torch.Tensor,
        grads: torch.Tensor,
        config: AdagradConfig,
        *,
        looked_up: torch.Tensor | None = None,
    ) -> None:
        accum = self.table.accumulators
        assert accum is not None
        self.backend.adagrad_update(self.table.values, accum, rows, grads, config)

    def insert_or_assign(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        table_ids: torch.Tensor | None,
        accumulators: torch.Tensor | None = None,
        pinned_rows: torch.Tensor | None = None,
        exact: bool = True,
    ) -> InsertResult:
        return self.table.insert_or_assign(
            keys,
            values,
            scores,
            table_ids=table_ids,
            accumulators=accumulators,
            pinned_rows=pinned_rows,
            exact=exact,
        )

    def export(self) -> ExportedRows:
        return self.table.export()

    def reserve_max_capacity(self) -> bool:
        return self.table.reserve_max_capacity()

    def prefetch(self, rows: torch.Tensor) -> None:
        return None  # every row is on the device already

    def why_not_static(self) -> str | None:
        return None

    # the static form is the table's own arrays: the rows are the slots, the insert wrote the
    # new rows' values and accumulators, and nothing is added to the step's ops

    def static_began(self, padded: int) -> int:
        return 0

    def static_version(self) -> int:
        return 0

    def static_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        accum = self.table.accumulators
        assert accum is not None
        return self.table.values, accum

    def static_key(self) -> tuple[object, ...]:
        return ()  # the table's arrays: the static step keys on them already

    def static_resolve(
        self, rows: torch.Tensor, found: torch.Tensor, new_values: torch.Tensor
    ) -> torch.Tensor:
        return rows

    def static_looked_up(self) -> None:
        return None

    def static_updated(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        return None

    def static_prefetch_began(self, padded: int) -> bool:
        return False  # every row is on the device already

    def static_prefetch(self, rows: torch.Tensor) -> None:
        return None

    def stats(self) -> dict[str, float]:
        t = self.table
        return {
            "hbm_payload_bytes": float(
                t.values.nbytes + (t.accumulators.nbytes if t.accumulators is not None else 0)
            )
        }
