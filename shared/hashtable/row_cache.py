"""CACHING: an HBM cache of hot rows' payload over a host tier that holds every row.

The decision, and why: the **index stays on the device**. Keys, table ids, fingerprints, scores
and the bucket structure are the :class:`~shared.hashtable.table.HashTable` of an HBM_ONLY
storage, built with no payload (``dim`` 0), so every key, score, eviction decision, admission
and stat is the HBM-only one by construction, and the planner
(:mod:`shared.hashtable.placement`) already counts the index in HBM (36 B a slot against
``8 * dim`` B of payload: at dim 16 the payload is 78 % of a row's bytes, at dim 128 97 %).
What moves is the payload: the values and Adagrad accumulators of **every** row live in a
:class:`~shared.hashtable.host_store.HostStore` (pinned memory on CUDA, plain memory on CPU),
and ``lines`` cache lines on the device hold the payload of the rows in use.

Caching is keyed by row (the table's slot row, what ``find`` returns):

- ``line_of_row`` [capacity] int32 (-1: not cached) and ``row_of_line`` [lines] int64;
- ``stamp`` [lines] int64: the call that last used the line (-1: free), for eviction;
- ``dirty`` [lines] bool: the line holds updates the host tier does not have yet.

A call that touches rows (:meth:`RowCache.gather`, :meth:`RowCache.adagrad`,
:meth:`RowCache.prefetch`) resolves them to lines first: hits are stamped; the misses are read
from the host tier in ONE vectorized gather of the packed miss list (``index_select`` into a
pinned buffer, then one ``non_blocking`` copy to the device); their lines are the free ones, then
the least recently used among the lines this call does not use (so a call never evicts its own
rows); dirty victims go back to the host in ONE scatter. When a call needs more rows than there
are lines (a cache of a few rows), the rows past the cache are *bypassed*: read from and updated
in the host tier directly, with the same arithmetic. From there the values a step reads and the
Adagrad update work on lines exactly as they work on rows in HBM_ONLY (the same backend call).

The index's own changes reach the cache through :meth:`RowCache.insert_or_assign` and
:meth:`RowCache.reserve_max_capacity`: a new key's payload (its initializer row) is written to
the host tier and any line of its row dropped (the row belonged to an evicted key); growth
(rehash) moves rows, so the same move is applied to the host tier and to the line map, found by
looking the pre-growth keys up in the grown index (growth is rare and already O(capacity)).

Checkpoints and exports flush the dirty lines, then read every row from the host tier: the same
files as HBM_ONLY. Not built yet (issue #52): CUDA kernels for the resolve (this is torch, with
host reads of the miss count), and the static captured step on cached rows
(:meth:`RowCache.why_not_static`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.backend import Backend
from shared.hashtable.host_store import HostStore
from shared.hashtable.layout import ExportedRows, InsertResult
from shared.hashtable.table import HashTable

T = TypeVar("T")

# a stamp above every real one: lines a call must keep sort after every candidate victim
_KEEP = torch.iinfo(torch.int64).max


@dataclass
class CacheCounters:
    """Cumulative counters of one cache (rows, not lookups: a row is counted once a call)."""

    hits: int = 0  # rows found in a line
    misses: int = 0  # rows read from the host tier into a line
    bypassed: int = 0  # rows used in the host tier directly (the call needed more lines)
    evictions: int = 0  # lines given to another row
    writebacks: int = 0  # of those, dirty lines written to the host tier
    prefetched: int = 0  # rows :meth:`RowCache.prefetch` brought in (also counted as misses)


class RowCache:
    """The CACHING payload of a storage's ``table`` (a :class:`HashTable` of ``dim`` 0): ``lines``
    device lines of ``dim`` values and ``dim`` accumulators over ``store``, which holds every row.
    ``backend``: the storage's (runs Adagrad on the lines, as on rows in HBM_ONLY)."""

    name = "CACHING"
    tiered = True

    def __init__(
        self,
        table: HashTable,
        backend: Backend,
        *,
        dim: int,
        lines: int,
        store: HostStore,
        initial_accumulator_value: float,
    ) -> None:
        if table.dim != 0 or table.accumulators is not None:
            raise ValueError("RowCache: the index table must have dim 0 and no accumulators")
        if lines < 1:
            raise ValueError(f"RowCache: lines must be >= 1, got {lines}")
        if store.capacity != table.capacity:
            raise ValueError(
                f"RowCache: the host store holds {store.capacity} rows, the table {table.capacity}"
            )
        dev = table.device
        self.table = table
        self.backend = backend
        self.dim = dim
        self.store = store
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.values = torch.zeros(lines, dim, dtype=torch.float32, device=dev)  # [L, dim]
        self.accum = torch.zeros(lines, dim, dtype=torch.float32, device=dev)  # [L, dim]
        self.row_of_line = torch.full((lines,), -1, dtype=torch.int64, device=dev)
        self.stamp = torch.full((lines,), -1, dtype=torch.int64, device=dev)
        self.dirty = torch.zeros(lines, dtype=torch.bool, device=dev)
        self.line_of_row = torch.full((table.capacity,), -1, dtype=torch.int32, device=dev)
        self._tick = 0  # calls so far: the stamp of the current one
        self.counters = CacheCounters()

    @property
    def lines(self) -> int:
        return self.values.shape[0]

    def __repr__(self) -> str:
        return f"RowCache(lines={self.lines}, dim={self.dim}, store={self.store!r})"

    # ------------------------------------------------------------------ resolve

    def _resolve(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """([n] int64 lines of distinct ``rows`` [n] (all >= 0), -1 for rows bypassed; the
        number bypassed): a new call (stamp); hits stamped, misses loaded into free or least
        recently used lines that this call does not use. Host reads: the miss count, and with
        misses the victims' write-backs."""
        self._tick += 1
        tick = self._tick
        lines = self.line_of_row[rows].to(torch.int64)  # [n]
        miss = lines < 0
        n_miss = int(miss.sum())
        self.stamp[lines[~miss]] = tick
        self.counters.hits += rows.numel() - n_miss
        if n_miss == 0:
            return lines, 0
        at = torch.nonzero(miss).squeeze(1)  # [n_miss] positions of the misses
        candidate = torch.where(self.stamp < tick, self.stamp, _KEEP)  # [L]
        # the lines stamped by this call are its hits' (distinct rows, distinct lines)
        k = min(n_miss, self.lines - (rows.numel() - n_miss))
        if k:
            victims = torch.topk(candidate, k, largest=False, sorted=False).indices  # [k]
            self._evict(victims)
            self._fill(victims, rows[at[:k]], tick)
            lines[at[:k]] = victims
        self.counters.misses += k
        self.counters.bypassed += n_miss - k
        return lines, n_miss - k

    def _evict(self, victims: torch.Tensor) -> None:
        """Free lines ``victims`` [k]: dirty ones written back in one scatter."""
        old = self.row_of_line[victims]  # [k]
        held = old >= 0
        back = held & self.dirty[victims]
        n_held, n_back = (int(x) for x in torch.stack([held.sum(), back.sum()]).tolist())
        if n_back:
            wb = victims[back]
            self.store.write(old[back], torch.cat([self.values[wb], self.accum[wb]], 1))
        if n_held:
            self.line_of_row[old[held]] = -1
        self.counters.evictions += n_held
        self.counters.writebacks += n_back

    def _fill(self, victims: torch.Tensor, rows: torch.Tensor, tick: int) -> None:
        """Lines ``victims`` [k] take ``rows`` [k] from the host tier (one gather, one copy)."""
        payload = self.store.read(rows).to(self.values.device, non_blocking=True)  # [k, 2 * dim]
        self.values[victims] = payload[:, : self.dim]
        self.accum[victims] = payload[:, self.dim :]
        self.row_of_line[victims] = rows
        self.line_of_row[rows] = victims.to(torch.int32)
        self.stamp[victims] = tick
        self.dirty[victims] = False

    def _split(self, lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions cached, positions bypassed) of resolved ``lines``."""
        cached = lines >= 0
        return torch.nonzero(cached).squeeze(1), torch.nonzero(~cached).squeeze(1)

    # ------------------------------------------------------------------ the step

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows.numel(), self.dim, dtype=torch.float32, device=self.values.device)
        at = torch.nonzero(rows >= 0).squeeze(1)
        if at.numel() == 0:
            return out  # [U, dim]
        real = rows[at]
        lines, n_bypassed = self._resolve(real)
        if n_bypassed == 0:
            out[at] = self.values[lines]
            return out  # [U, dim]
        cached, bypassed = self._split(lines)
        out[at[cached]] = self.values[lines[cached]]
        if bypassed.numel():
            payload = self.store.read(real[bypassed]).to(out.device)
            out[at[bypassed]] = payload[:, : self.dim]
        return out  # [U, dim]

    def adagrad(self, rows: torch.Tensor, grads: torch.Tensor, config: AdagradConfig) -> None:
        if rows.numel() == 0:
            return
        lines, n_bypassed = self._resolve(rows)
        if n_bypassed == 0:
            self.backend.adagrad_update(self.values, self.accum, lines, grads, config)
            self.dirty[lines] = True
            return
        cached, bypassed = self._split(lines)
        if cached.numel():
            at = lines[cached]
            self.backend.adagrad_update(self.values, self.accum, at, grads[cached], config)
            self.dirty[at] = True
        if bypassed.numel():  # the same update on host rows, on the device, written back
            rb = rows[bypassed]
            payload = self.store.read(rb).to(self.values.device)  # [b, 2 * dim]
            v = payload[:, : self.dim].contiguous()
            a = payload[:, self.dim :].contiguous()
            idx = torch.arange(rb.numel(), device=v.device)
            self.backend.adagrad_update(v, a, idx, grads[bypassed], config)
            self.store.write(rb, torch.cat([v, a], 1))

    def prefetch(self, rows: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        before = self.counters.misses
        self._resolve(rows)
        self.counters.prefetched += self.counters.misses - before

    # ------------------------------------------------------------------ index changes

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
        """The index's insert, then the payload of every stored key into the host tier (a new
        key without ``accumulators`` gets the initial accumulator value, an existing one keeps
        its own). ``keys`` must be distinct (the storage's are)."""
        n = keys.numel()
        result = self._tracking_moves(
            lambda: self.table.insert_or_assign(
                keys,
                torch.zeros(n, 0, dtype=torch.float32),
                scores,
                table_ids=table_ids,
                pinned_rows=pinned_rows,
                exact=exact,
            )
        )
        at = torch.nonzero(result.rows >= 0).squeeze(1)
        if at.numel() == 0:
            return result
        rows = result.rows[at]
        dev = self.values.device
        v = values.to(dev, torch.float32).reshape(n, self.dim)[at]
        if accumulators is not None:
            a = accumulators.to(dev, torch.float32).reshape(n, self.dim)[at]
        else:
            a = torch.full_like(v, self.initial_accumulator_value)
            kept = torch.nonzero(~result.inserted[at]).squeeze(1)  # assigned: keep theirs
            if kept.numel():
                a[kept] = self._read(rows[kept])[1]
        self._write(rows, v, a)
        return result

    def reserve_max_capacity(self) -> bool:
        return self._tracking_moves(self.table.reserve_max_capacity)

    def _tracking_moves(self, change: Callable[[], T]) -> T:
        """``change()`` of the index; if it grew the table, move the payload with the rows."""
        t = self.table
        old_keys, old_tids, generation = t.row_keys, t.row_table_ids, t.generation
        out = change()
        if t.generation != generation:
            self._moved(old_keys, old_tids)
        return out

    def _moved(self, old_keys: torch.Tensor, old_tids: torch.Tensor) -> None:
        """The index was rebuilt: pre-growth row r held ``old_keys[r]``; find each key's row now
        and move the host tier and the line map the same way (keys gone: payload dropped)."""
        old_rows = torch.nonzero(old_keys >= 0).squeeze(1)
        new_rows, found = self.table.find(
            old_keys[old_rows], old_tids[old_rows].to(torch.int64), validate=False
        )
        kept = torch.nonzero(found).squeeze(1)
        old_rows, new_rows = old_rows[kept], new_rows[kept]
        capacity = self.table.capacity
        self.store.permute(capacity, old_rows, new_rows)
        remap = torch.full((old_keys.numel(),), -1, dtype=torch.int64, device=old_keys.device)
        remap[old_rows] = new_rows
        held = self.row_of_line >= 0
        moved = torch.where(held, remap[self.row_of_line.clamp(min=0)], -1)  # [L]
        gone = held & (moved < 0)
        self.stamp[gone] = -1
        self.dirty[gone] = False
        self.row_of_line = moved
        self.line_of_row = torch.full(
            (capacity,), -1, dtype=torch.int32, device=self.line_of_row.device
        )
        live = torch.nonzero(moved >= 0).squeeze(1)
        self.line_of_row[moved[live]] = live.to(torch.int32)

    def _read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, accumulators) [n, dim] of ``rows`` [n] as they are now, cache unchanged."""
        payload = self.store.read(rows).to(self.values.device)  # [n, 2 * dim]
        v, a = payload[:, : self.dim], payload[:, self.dim :]
        lines = self.line_of_row[rows].to(torch.int64)
        at = torch.nonzero(lines >= 0).squeeze(1)
        if at.numel():
            v[at], a[at] = self.values[lines[at]], self.accum[lines[at]]
        return v, a

    def _write(self, rows: torch.Tensor, values: torch.Tensor, accum: torch.Tensor) -> None:
        """Store the payload of distinct ``rows`` in the host tier; their lines are dropped (the
        rows now belong to keys whose payload this is)."""
        lines = self.line_of_row[rows].to(torch.int64)
        drop = lines[lines >= 0]
        self.row_of_line[drop] = -1
        self.stamp[drop] = -1
        self.dirty[drop] = False
        self.line_of_row[rows] = -1
        self.store.write(rows, torch.cat([values, accum], 1))

    # ------------------------------------------------------------------ state

    def flush(self) -> None:
        """Write every dirty line to the host tier (lines stay cached, now clean)."""
        dirty = torch.nonzero(self.dirty).squeeze(1)
        if dirty.numel():
            rows = self.row_of_line[dirty]
            self.store.write(rows, torch.cat([self.values[dirty], self.accum[dirty]], 1))
            self.counters.writebacks += dirty.numel()
            self.dirty[dirty] = False

    def export(self) -> ExportedRows:
        """The index's export with every row's payload: dirty lines flushed, then read from the
        host tier."""
        self.flush()
        rows = self.table.export()
        found, _ = self.table.find(rows.keys, rows.table_ids, validate=False)
        payload = self.store.read(found).to(self.values.device)  # [N, 2 * dim]
        return rows._replace(
            values=payload[:, : self.dim].contiguous(),
            accumulators=payload[:, self.dim :].contiguous(),
        )

    def why_not_static(self) -> str | None:
        return (
            "the storage is CACHING (cache_load_factor < 1): its rows' payload is resolved to "
            "cache lines with host reads, which a captured graph cannot do yet (issue #52)"
        )

    def stats(self) -> dict[str, float]:
        c = self.counters
        used = c.hits + c.misses + c.bypassed
        hbm = self.values.nbytes + self.accum.nbytes
        hbm += self.row_of_line.nbytes + self.stamp.nbytes + self.dirty.nbytes
        hbm += self.line_of_row.nbytes
        return {
            "cache_lines": float(self.lines),
            "cache_hits": float(c.hits),
            "cache_misses": float(c.misses),
            "cache_bypassed": float(c.bypassed),
            "cache_evictions": float(c.evictions),
            "cache_writebacks": float(c.writebacks),
            "cache_prefetched": float(c.prefetched),
            "cache_hit_rate": c.hits / used if used else 0.0,
            "hbm_payload_bytes": float(hbm),
            "host_payload_bytes": float(self.store.capacity * 2 * self.dim * 4),
        }
