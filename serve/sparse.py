"""Read-only embedding lookups of a bundle on the serving device, and Batch → dense-program inputs.

Dynamic (``is_hashmap``) tables are rebuilt on the device as the shared hash-table core's
read-only :class:`~shared.hashtable.lookup.StaticLookupTable` (sorted keys, searchsorted); dense
(``num_buckets``) tables are plain [rows, dim] tensors read with ``index_select``. A key that is
not in a dynamic table (never seen, or never admitted in training) gets zeros, i.e. the eval
initializer (CONSTANT 0), and counts as a miss.

This is the general path and the reference for :mod:`serve.fused` (which serves whenever all
tables share one dim, i.e. normally). Every table is looked up once per batch (a sequence
sub-feature and its top-level feature share a table and one call); pooling and the order of the
program's inputs come from :mod:`shared.dense_inputs`, the same code training uses. Example::

    tables = SparseTables.from_bundle(bundle, device="cuda")
    inputs = tables.embed(batch.to("cuda"))      # the 6 keyword inputs of dense.pt2
    logits = program(**inputs)                   # [B]
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.batch import Batch
from shared.bundle import Bundle
from shared.dense_inputs import (
    DenseLayout,
    assemble_dense_inputs,
    dense_layout,
    feature_parts,
    parts_by_table,
    pool_features,
)
from shared.features import FeatureSet, TableSpec
from shared.hashtable.lookup import StaticLookupTable


class TableLookup(Protocol):
    """One read-only embedding table on the device."""

    dim: int
    is_hashmap: bool

    def lookup(self, ids: torch.Tensor) -> torch.Tensor: ...  # [N] int64 → [N, dim]

    @property
    def rows(self) -> int: ...

    @property
    def capacity(self) -> int: ...


class DenseTable:
    """A ``num_buckets`` table: ids are already in [0, rows) (feature generation mods them)."""

    is_hashmap = False

    def __init__(self, weight: torch.Tensor, device: torch.device) -> None:
        self.weight = weight.to(device, torch.float32).contiguous()  # [rows, dim]
        self.dim = int(self.weight.shape[1])

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def capacity(self) -> int:
        return self.rows

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, ids)  # [N, dim]


class HashLookup:
    """A dynamic table: its exported (admitted) keys in the shared core's read-only
    :class:`~shared.hashtable.lookup.StaticLookupTable`; missing keys give zeros."""

    is_hashmap = True

    def __init__(self, table: StaticLookupTable, dim: int) -> None:
        self.table = table
        self.dim = dim

    @classmethod
    def build(
        cls, keys: torch.Tensor, values: torch.Tensor, spec: TableSpec, device: torch.device
    ) -> HashLookup:
        return cls(StaticLookupTable.from_keys_values(keys, values, device=device), spec.dim)

    @property
    def rows(self) -> int:
        return self.table.size

    @property
    def capacity(self) -> int:
        return self.table.size  # a static table holds exactly its keys

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.lookup(ids)  # [N, dim]

    def hit_miss(self) -> tuple[int, int]:
        """Cumulative (hits, misses) of :meth:`lookup` since the table was built."""
        return self.table.hits, self.table.misses


@dataclass(frozen=True)
class TableStats:
    name: str
    is_hashmap: bool
    dim: int
    rows: int
    capacity: int
    hits: int  # dynamic tables: keys found (admitted ids)
    misses: int  # dynamic tables: keys not found (zeros returned)


class SparseTables:
    """All tables of a bundle on one device, and :meth:`embed`: Batch → dense-program inputs."""

    def __init__(
        self, fs: FeatureSet, tables: Mapping[str, TableLookup], device: torch.device
    ) -> None:
        missing = [t for t in fs.tables if t not in tables]
        if missing:
            raise ValueError(f"no lookup for tables {missing}")
        self.fs = fs
        self.tables = dict(tables)
        self.device = device
        self.layout: DenseLayout = dense_layout(fs)
        self.build_seconds: dict[str, float] = {}
        self._stats_base: dict[str, tuple[int, int]] = {}

    @classmethod
    def from_bundle(cls, bundle: Bundle, *, device: torch.device | str) -> SparseTables:
        """Build every table of ``bundle`` on ``device``; per-table build times are recorded."""
        dev = torch.device(device)
        fs = bundle.feature_set
        tables: dict[str, TableLookup] = {}
        seconds: dict[str, float] = {}
        for spec in fs.tables.values():
            t0 = time.perf_counter()
            if spec.is_dynamic:
                keys, values = bundle.hash_tables[spec.name]
                tables[spec.name] = HashLookup.build(keys, values, spec, dev)
            else:
                tables[spec.name] = DenseTable(bundle.dense_tables[spec.name], dev)
            seconds[spec.name] = time.perf_counter() - t0
        out = cls(fs, tables, dev)
        out.build_seconds = seconds
        return out

    def reset_stats(self) -> None:
        """Count hits and misses from now on (e.g. after warm-up, whose ids are synthetic)."""
        self._stats_base = {
            name: t.hit_miss() for name, t in self.tables.items() if isinstance(t, HashLookup)
        }

    def embed(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The dense program's inputs for ``batch`` (already on :attr:`device`)."""
        fs = self.fs
        parts = feature_parts(batch)  # then one lookup per table
        rows: list[torch.Tensor | None] = [None] * len(parts)
        for table, idx in parts_by_table(fs, parts).items():
            ids = [parts[i][2] for i in idx]
            found = self.tables[table].lookup(ids[0] if len(ids) == 1 else torch.cat(ids))
            for i, chunk in zip(idx, torch.split(found, [x.numel() for x in ids]), strict=True):
                rows[i] = chunk  # [n_i, dim]
        assert all(r is not None for r in rows)
        pooled, sequences = pool_features(fs, parts, rows)  # type: ignore[arg-type]
        return assemble_dense_inputs(fs, batch, pooled, sequences, layout=self.layout)

    def stats(self) -> list[TableStats]:
        out = []
        for name, t in self.tables.items():
            hits, misses = 0, 0
            if isinstance(t, HashLookup):
                (hits, misses), (h0, m0) = t.hit_miss(), self._stats_base.get(name, (0, 0))
                hits, misses = hits - h0, misses - m0
            out.append(TableStats(name, t.is_hashmap, t.dim, t.rows, t.capacity, hits, misses))
        return out
