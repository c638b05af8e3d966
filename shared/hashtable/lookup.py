"""StaticLookupTable: the read-only key → embedding map that serving builds at startup.

Serving never inserts, so it needs no buckets, scores or free slots: the exported keys are
sorted once (one ``torch.sort``, ~0.1-0.5 s for 1.5M keys on a CPU, milliseconds on a GPU) and a
batch lookup is one ``torch.searchsorted`` plus a gather. Memory is exactly 8 bytes per key plus
the values (and as much per free slot, if built with ``spare``). Missing keys get ``fill_value``
rows (0.0, i.e. ``eval_initializer`` CONSTANT 0, the value training's eval mode returns for keys
not in the table). Example::

    table = StaticLookupTable.from_keys_values(keys, values, device="cuda")  # bundle tensors
    rows = table.lookup(request_ids)        # [N, dim]; table.hits / table.misses count keys

Use :class:`~shared.hashtable.table.HashTable` (also buildable with ``from_keys_values``) for
a table that changes after it is built.

Rewrites in place (serving's deltas, :mod:`serve.delta`): built with ``spare`` rows, the table
keeps that many free slots after its keys (key :data:`SPARE_KEY`, value ``fill_value``; a lookup
ignores them), so new contents of up to :attr:`capacity` keys can be written into the *same*
tensors (CUDA graphs captured over them stay valid). :meth:`prepare` computes the writes off the
serving path (reads only), :meth:`TableWrite.apply` does them, between batches::

    table = StaticLookupTable.from_keys_values(keys, values, spare=1024)
    write = table.prepare(new_keys, new_values)   # None: more keys than capacity
    if write is not None:
        write.apply()                             # under the caller's lock
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.hashtable.hashing import check_keys

SPARE_KEY = torch.iinfo(torch.int64).max  # the key of a free slot: sorts after every real key


def _sorted_distinct(
    keys: torch.Tensor, values: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` sorted ascending with their ``values`` rows; ValueError naming a repeated key."""
    if values.dim() != 2 or values.shape[0] != keys.numel():
        raise ValueError(
            f"{where}: values must be [{keys.numel()}, dim], got {tuple(values.shape)}"
        )
    sorted_keys, order = torch.sort(keys, stable=True)
    if sorted_keys.numel() > 1:
        dup = torch.nonzero(sorted_keys[1:] == sorted_keys[:-1]).squeeze(1)
        if dup.numel():
            raise ValueError(
                f"{where}: key {int(sorted_keys[dup[0]])} appears more than once; keys must be "
                "distinct (the export holds each key once per table: was a table exported twice?)"
            )
    return sorted_keys, values[order]


@dataclass(frozen=True)
class TableWrite:
    """New contents for a :class:`StaticLookupTable`, to write into its own tensors.

    ``keys`` [size] (sorted) when the key set changes: keys and values are rewritten up to
    ``max(size, old size)`` and the slots after ``size`` freed; None when the keys stay: only
    ``rows`` [M] of the values get ``values`` [M, dim]."""

    table: StaticLookupTable
    size: int
    keys: torch.Tensor | None
    rows: torch.Tensor
    values: torch.Tensor

    def apply(self) -> None:
        """Write (no batch may run meanwhile: the caller holds the predict lock)."""
        t = self.table
        if self.keys is None:
            t.values.index_copy_(0, self.rows, self.values)
            return
        end = max(self.size, t.size)
        t.keys[: self.size].copy_(self.keys)
        t.keys[self.size : end].fill_(SPARE_KEY)
        t.values[: self.size].copy_(self.values)
        t.values[self.size : end].fill_(t.fill_value)
        t.set_size(self.size)


class StaticLookupTable:
    """Sorted int64 keys with their rows; build with :meth:`from_keys_values`."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        fill_value: float = 0.0,
        size: int | None = None,
    ) -> None:
        """``keys`` [C] must be sorted ascending and distinct, ``values`` [C, dim] in that order;
        ``size`` < C: only the first ``size`` are keys, the rest free slots (:data:`SPARE_KEY`)."""
        if values.dim() != 2 or values.shape[0] != keys.numel():
            raise ValueError(
                f"StaticLookupTable: values must be [{keys.numel()}, dim], got {tuple(values.shape)}"
            )
        self.keys = keys  # [capacity]
        self.values = values  # [capacity, dim]
        self.fill_value = float(fill_value)
        self._size = keys.numel() if size is None else size
        # with free slots, lookups mask positions >= the size, read from this tensor (updated in
        # place by TableWrite, so a CUDA graph replays with the current size)
        self._masked = self._size < keys.numel()
        self._live = torch.tensor(self._size, dtype=torch.int64, device=keys.device)
        self.hits = 0  # looked-up keys that were found (cumulative)
        self.misses = 0  # looked-up keys that were not (cumulative)

    @classmethod
    def from_keys_values(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        device: torch.device | str = "cpu",
        fill_value: float = 0.0,
        spare: int = 0,
    ) -> StaticLookupTable:
        """Build from distinct non-negative int64 ``keys`` [N] and float ``values`` [N, dim],
        with ``spare`` free slots for :meth:`prepare` (0: exactly the keys, no masking)."""
        where = "StaticLookupTable.from_keys_values"
        if spare < 0:
            raise ValueError(f"{where}: spare must be >= 0 (free slots), got {spare}")
        device = torch.device(device)
        keys = check_keys(keys.to(device), where)
        sorted_keys, sorted_values = _sorted_distinct(keys, values.to(device, torch.float32), where)
        if not spare:
            return cls(sorted_keys, sorted_values, fill_value=fill_value)
        free_keys = torch.full((spare,), SPARE_KEY, dtype=torch.int64, device=device)
        free_rows = torch.full((spare, sorted_values.shape[1]), fill_value, device=device)
        return cls(
            torch.cat([sorted_keys, free_keys]),
            torch.cat([sorted_values, free_rows]),
            fill_value=fill_value,
            size=sorted_keys.numel(),
        )

    @property
    def size(self) -> int:
        """Keys held (the slots after them are free)."""
        return self._size

    @property
    def capacity(self) -> int:
        """Keys it can hold without new tensors: :attr:`size` + free slots."""
        return self.keys.numel()

    def set_size(self, size: int) -> None:
        """Internal to :class:`TableWrite`: the first ``size`` slots now hold the keys."""
        self._size = size
        self._live.fill_(size)

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def find(
        self, keys: torch.Tensor, *, check_sign: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into :attr:`values` [N] int64, -1 where missing; found [N] bool).

        ``check_sign=False`` skips the test for negative keys, which reads a flag back from the
        device (a host sync): for hot paths whose keys are non-negative by construction (feature
        generation's ids); a negative key then simply misses.
        """
        keys = check_keys(keys.to(self.device), "StaticLookupTable.find", check_sign=check_sign)
        if self.capacity == 0:
            return torch.full_like(keys, -1), torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.searchsorted(self.keys, keys).clamp_(max=self.capacity - 1)
        found = self.keys.index_select(0, pos) == keys
        if self._masked:  # a free slot (SPARE_KEY) is no key
            found &= pos < self._live
        return torch.where(found, pos, -1), found

    def prepare(self, keys: torch.Tensor, values: torch.Tensor) -> TableWrite | None:
        """The writes that make the table hold exactly ``keys`` [N] (distinct, any order) with
        ``values`` [N, dim], or None when they do not fit (N > :attr:`capacity`, or N <
        capacity in a table built without free slots). Reads the table only: call it off the
        serving path, then :meth:`TableWrite.apply` between batches."""
        where = "StaticLookupTable.prepare"
        keys = check_keys(keys.to(self.device), where)
        values = values.to(self.device, torch.float32)
        if values.dim() == 2 and values.shape[1] != self.dim:
            raise ValueError(f"{where}: values must have dim {self.dim}, got {values.shape[1]}")
        keys, values = _sorted_distinct(keys, values, where)
        n = keys.numel()
        if n > self.capacity or (n < self.capacity and not self._masked):
            return None
        if n == self.size and torch.equal(keys, self.keys[:n]):  # the same keys: changed rows
            rows = torch.nonzero((self.values[:n] != values).any(1)).squeeze(1)
            return TableWrite(self, n, None, rows, values.index_select(0, rows))
        return TableWrite(self, n, keys, torch.arange(n, device=self.device), values)

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [N] → rows [N, dim] float32; ``fill_value`` rows for missing keys."""
        idx, found = self.find(keys)
        if self.capacity == 0:
            out = torch.full((keys.numel(), self.dim), self.fill_value, device=self.device)
        else:
            out = self.values[idx.clamp(min=0)]  # [N, dim]
            out[~found] = self.fill_value
        n_found = int(found.sum())
        self.hits += n_found
        self.misses += keys.numel() - n_found
        return out
