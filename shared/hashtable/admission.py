"""Frequency admission: a bounded counter table of keys not yet in the embedding table.

A key enters the embedding table once it has been looked up ``threshold`` times in training
(counting every occurrence, duplicates in a batch included). Until then its counter lives here,
in a :class:`~shared.hashtable.table.HashTable` without values whose score is the count; the
table has a fixed capacity (``counter_capacity``, ``counter_bucket_capacity`` slots per bucket)
and, when a bucket is full, the lowest count is forgotten (LFU). Admitted keys are erased from
the counter by the caller. Counters of fused tables share one counter table (separate key
spaces through table ids), as dynamicemb's fused tables share their admission counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.features import ScoreStrategy
from shared.hashtable.backend import Backend
from shared.hashtable.hashing import split_mask
from shared.hashtable.table import ExportedRows, HashTable


@dataclass
class PendingCounts:
    """An :meth:`FrequencyCounter.add` between its two halves."""

    keys: torch.Tensor  # [n] int64, distinct
    table_ids: torch.Tensor | None
    rows: torch.Tensor  # [n] counter row of each key, -1 if not counted yet
    found: torch.Tensor  # [n] bool
    totals: torch.Tensor  # [n] int64: the counts after this add


class FrequencyCounter:
    """Bounded (table id, key) → count map. ``add`` returns the counts after adding."""

    def __init__(
        self,
        capacity: int,
        bucket_capacity: int = 1024,
        *,
        device: torch.device | str = "cpu",
        backend: Backend | None = None,
    ) -> None:
        """``backend``: the counter table's (default: ``backend_for`` the device)."""
        self.table = HashTable(
            0,
            init_capacity=capacity,
            max_capacity=capacity,
            bucket_capacity=bucket_capacity,
            score_strategy=ScoreStrategy.LFU,
            device=device,
            backend=backend,
        )

    @property
    def size(self) -> int:
        return self.table.size

    @property
    def capacity(self) -> int:
        return self.table.capacity

    @property
    def evictions(self) -> int:
        """Counters forgotten to make room (their keys start again from zero)."""
        return self.table.evictions + self.table.refusals

    def add(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        table_ids: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> torch.Tensor:
        """Add ``counts`` [n] to distinct ``keys`` [n]; returns the totals [n] int64.

        ``validate=False`` skips the check of the keys (the caller checked them).

        A key that cannot be remembered (its bucket is full of higher counts) still gets its
        total for this call, so a key seen ``threshold`` times in one batch is admitted.
        """
        pending = self.totals(keys, counts, table_ids, validate=validate)
        self.remember(pending, int(pending.found.sum()))
        return pending.totals

    def totals(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        table_ids: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> PendingCounts:
        """The first half of :meth:`add`, without a host sync: the totals [n] the keys reach.
        Nothing is stored until :meth:`remember` (which needs ``found``'s count)."""
        device = self.table.device
        keys, counts = keys.to(device), counts.to(device, torch.int64)
        table_ids = None if table_ids is None else table_ids.to(device)
        rows, found = self.table.find(keys, table_ids, validate=validate)
        old = self.table.scores_of(rows.clamp(min=0))
        totals = torch.where(found, counts + old, counts)
        return PendingCounts(keys, table_ids, rows, found, totals)

    def remember(self, pending: PendingCounts, n_found: int) -> None:
        """The second half of :meth:`add`: store the totals (``n_found``: ``found``'s count)."""
        hit, new = split_mask(pending.found, n_found)
        hit_rows, totals = pending.rows[hit], pending.totals
        if hit.numel():
            self.table.set_scores(hit_rows, totals[hit])
        if new.numel():
            tids = pending.table_ids
            self.table.insert_or_assign(
                pending.keys[new],
                torch.zeros(new.numel(), 0, device=self.table.device),
                totals[new],
                table_ids=None if tids is None else tids[new],
                pinned_rows=hit_rows,
                exact=False,  # the result is not used: no host read for full buckets
            )

    def erase(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None = None, *, count: bool = True
    ) -> int | None:
        """Forget ``keys`` (admitted ones); the number forgotten, None with ``count=False``
        (valid keys promised, no host sync on CUDA: ``HashTable.erase``)."""
        return self.table.erase(keys, table_ids, count=count)

    def export(self, table_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [N] int64, counts [N] int64), sorted by key."""
        rows: ExportedRows = self.table.export(table_id)
        return rows.keys, rows.scores

    def load(
        self, keys: torch.Tensor, counts: torch.Tensor, table_ids: torch.Tensor | None = None
    ) -> None:
        """Set the counts of ``keys`` (used when restoring a checkpoint)."""
        self.table.insert_or_assign(
            keys,
            torch.zeros(keys.numel(), 0, device=self.table.device),
            counts,
            table_ids=table_ids,
        )

    def clear(self, table_id: int | None = None) -> int:
        return self.table.clear(table_id)
