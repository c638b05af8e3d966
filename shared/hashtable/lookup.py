"""StaticLookupTable: the read-only key → embedding map that serving builds at startup.

Serving never inserts, so it needs no buckets, scores or free slots: the exported keys are
sorted once (one ``torch.sort``, ~0.1-0.5 s for 1.5M keys on a CPU, milliseconds on a GPU) and a
batch lookup is one ``torch.searchsorted`` plus a gather. Memory is exactly 8 bytes per key plus
the values. Missing keys get ``fill_value`` rows (0.0, i.e. ``eval_initializer`` CONSTANT 0, the
value training's eval mode returns for keys not in the table). Example::

    table = StaticLookupTable.from_keys_values(keys, values, device="cuda")  # bundle tensors
    rows = table.lookup(request_ids)        # [N, dim]; table.hits / table.misses count keys

Use :class:`~shared.hashtable.table.HashTable` (also buildable with ``from_keys_values``) for
a table that changes after it is built.
"""

from __future__ import annotations

import torch

from shared.hashtable.hashing import check_keys


class StaticLookupTable:
    """Sorted int64 keys with their rows; build with :meth:`from_keys_values`."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, *, fill_value: float = 0.0
    ) -> None:
        """``keys`` [N] must be sorted ascending and distinct, ``values`` [N, dim] in that order."""
        if values.dim() != 2 or values.shape[0] != keys.numel():
            raise ValueError(
                f"StaticLookupTable: values must be [{keys.numel()}, dim], got {tuple(values.shape)}"
            )
        self.keys = keys
        self.values = values
        self.fill_value = float(fill_value)
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
    ) -> StaticLookupTable:
        """Build from distinct non-negative int64 ``keys`` [N] and float ``values`` [N, dim]."""
        device = torch.device(device)
        keys = check_keys(keys.to(device), "StaticLookupTable.from_keys_values")
        values = values.to(device, torch.float32)
        if values.dim() != 2 or values.shape[0] != keys.numel():
            raise ValueError(
                f"StaticLookupTable.from_keys_values: values must be [{keys.numel()}, dim], "
                f"got {tuple(values.shape)}"
            )
        sorted_keys, order = torch.sort(keys, stable=True)
        if sorted_keys.numel() > 1:
            dup = torch.nonzero(sorted_keys[1:] == sorted_keys[:-1]).squeeze(1)
            if dup.numel():
                raise ValueError(
                    f"StaticLookupTable.from_keys_values: key {int(sorted_keys[dup[0]])} appears "
                    "more than once; keys must be distinct (the export holds each key once per "
                    "table: was a table exported twice?)"
                )
        return cls(sorted_keys, values[order], fill_value=fill_value)

    @property
    def size(self) -> int:
        return self.keys.numel()

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
        if self.size == 0:
            return torch.full_like(keys, -1), torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.searchsorted(self.keys, keys).clamp_(max=self.size - 1)
        found = self.keys.index_select(0, pos) == keys
        return torch.where(found, pos, -1), found

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [N] → rows [N, dim] float32; ``fill_value`` rows for missing keys."""
        idx, found = self.find(keys)
        if self.size == 0:
            out = torch.full((keys.numel(), self.dim), self.fill_value, device=self.device)
        else:
            out = self.values[idx.clamp(min=0)]  # [N, dim]
            out[~found] = self.fill_value
        n_found = int(found.sum())
        self.hits += n_found
        self.misses += keys.numel() - n_found
        return out
