"""CACHING: an HBM cache of hot rows' payload over a host tier that holds every row.

The decision, and why: the **index stays on the device**. Keys, table ids, fingerprints, scores
and the bucket structure are the :class:`~shared.hashtable.table.HashTable` of an HBM_ONLY
storage, built with no payload (``dim`` 0), so every key, score, eviction decision, admission
and stat is the HBM-only one by construction, and the planner
(:mod:`shared.hashtable.placement`) already counts the index in HBM (36 B a slot against
``8 * dim`` B of payload: at dim 16 the payload is 78 % of a row's bytes, at dim 128 97 %).
What moves is the payload: the values and Adagrad accumulators of **every** row live in a
:class:`~shared.hashtable.host_store.HostStore` (on CUDA page-locked host memory mapped into the
device's address space, plain memory on CPU), and ``lines`` cache lines on the device hold the
payload of the rows in use.

The cache is three modules, one class each, each class extending the one listed before it
(imports go one way: no cycle):

- :mod:`shared.hashtable.row_cache_lines`: ``CacheLines``, the lines, their maps, stamps and
  dirty bits (each array with its sink slot), the clock window both resolves take their victims
  from, the counters and stats;
- :mod:`shared.hashtable.row_cache_static`: ``StaticCacheLines``, the static step's fixed-shape
  resolve and its staging slots (the ``static_*`` methods of the
  :class:`~shared.hashtable.payload.RowPayload` seam);
- this module: :class:`RowCache`, the public class: the eager resolve, the step's gather,
  Adagrad and prefetch, the index's changes, flush and export.

A call that touches rows (:meth:`RowCache.gather`, :meth:`RowCache.adagrad`,
:meth:`RowCache.prefetch`) resolves them to lines first, with **one host read** (the size of the
miss list): hits are stamped; the misses are read from the host tier in ONE vectorized gather of
the packed miss list, in row order (the misses by row and the victims by write-back row, paired
in that order: the device's random host reads cost it about the same per row, ordered ones less;
on CUDA a kernel reading the host rows through UVA, straight into device
memory: :mod:`shared.hashtable.cuda.host_rows`). Their lines are, first, lines never used yet (in
order), then victims chosen by a **clock over the lines**: a window of ``2 * (misses + hits)``
lines after the hand (the whole cache when that is more), of which the least recently used
that this call has not stamped are taken, and the hand moves past the window. A call stamps
its hits and the lines it just took, so the window always holds enough others, and a call
never evicts its own rows. Why a window: a ``topk`` over every line each call cost more than the
misses themselves at large caches (3M lines at 10 % of 30M rows, 30M at 100 % on the first H100
run); the window keeps the recently used half of what it passes (an approximate LRU, as Redis'
sampled LRU), and the choice only affects speed, never results (the tier is transparent).
Dirty victims go back to the host in the same pass that reads the misses into their lines
(:meth:`~shared.hashtable.host_store.HostStore.swap`: on CUDA one kernel, so the write-backs
and the reads cross PCIe at the same time, one each way, where two launches would take the sum
of both); clean victims' rows are -1 there, so nothing is read on the host to select them.
Evictions and write-backs are counted on the device and read when :attr:`RowCache.counters` or
:meth:`RowCache.stats` is asked.

When a call needs more rows than there are lines (a cache of a few rows), the rows past the
cache are *bypassed*: read from and updated in the host tier directly, with the same
arithmetic. From there the values a step reads and the Adagrad update work on lines exactly as
they work on rows in HBM_ONLY (the same backend call).

The index's own changes reach the cache through :meth:`RowCache.insert_or_assign` and
:meth:`RowCache.reserve_max_capacity`: a new key's payload (its initializer row) is written to
the host tier and any line of its row dropped (the row belonged to an evicted key); growth
(rehash) moves rows, so the same move is applied to the host tier and to the line map, found by
looking the pre-growth keys up in the grown index (growth is rare and already O(capacity)).

Checkpoints and exports flush the dirty lines, then read every row from the host tier: the same
files as HBM_ONLY.

A step's Adagrad takes the lines its lookup resolved (the storage passes the tensor the lookup
gave :meth:`RowCache.gather` as ``looked_up``): no second resolve, no second host read, and
the backward's rows are not counted again. A version, bumped whenever a line may leave its row
(an eviction, a dropped line, growth), tells whether those lines still hold the rows; a call in
between that evicted (a prefetch, an eval lookup) makes the Adagrad resolve its rows again.

Done for issue #52: the host tier's rows moved by the device (UVA kernels, no host sync; the
write-backs overlapped with the misses' reads), one host read an eager resolve and none in the
backward, victims from a bounded window, the static (capturable) form
(:mod:`shared.hashtable.row_cache_static`). Not built yet: the resolve as custom kernels (torch
ops); the misses of batch i+1 fetched on a side stream while step i runs (prefetch runs on the
training thread between steps, with the eager resolve's host read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.hashing import compact_positions
from shared.hashtable.layout import ExportedRows, InsertResult
from shared.hashtable.row_cache_lines import CacheCounters, with_sink
from shared.hashtable.row_cache_static import StaticCacheLines

__all__ = ["CacheCounters", "RowCache"]  # CacheCounters: row_cache_lines', named here too

T = TypeVar("T")


class RowCache(StaticCacheLines):
    """The CACHING payload of a storage's ``table`` (a :class:`~shared.hashtable.table.HashTable`
    of ``dim`` 0): ``lines`` device lines of ``dim`` values and ``dim`` accumulators over
    ``store``, which holds every row. ``backend``: the storage's (runs Adagrad on the lines, as
    on rows in HBM_ONLY). Its state and constructor are
    :class:`~shared.hashtable.row_cache_lines.CacheLines`', the static step's methods
    :class:`~shared.hashtable.row_cache_static.StaticCacheLines`'."""

    name = "CACHING"
    tiered = True

    def __repr__(self) -> str:
        return f"RowCache(lines={self.lines}, dim={self.dim}, store={self.store!r})"

    # ------------------------------------------------------------------ resolve

    def _resolve(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """([n] int64 lines of distinct ``rows`` [n] (all >= 0), -1 for rows bypassed; the
        number bypassed): a new call (stamp); hits stamped, misses loaded into lines this call
        does not use (:meth:`_take`). One host read: the size of the miss list."""
        self._tick += 1
        tick = self._tick  # [] int64 on the device
        self._last_padded = rows.numel()  # may bypass: no static prefetch beside its update
        lines = self.line_of_row[rows].to(torch.int64)  # [n]
        miss = lines < 0
        self._stamps[torch.where(miss, self.lines, lines)] = tick  # hits (misses: the sink)
        at = torch.nonzero(miss).squeeze(1)  # [n_miss] positions of the misses: the host read
        n_miss = at.numel()
        hits = rows.numel() - n_miss
        self._counts.hits += hits
        if n_miss == 0:
            return lines, 0
        # the lines stamped by this call are its hits' (distinct rows, distinct lines)
        k = min(n_miss, self.lines - hits)
        if k:
            taken, back = self._take(k, hits, tick)
            # which line a miss takes is free: the misses by row and the victims by write-back
            # row, paired in that order, so the host tier is walked ascending both ways
            # (row_cache_static._pair_in_row_order says why)
            missed = at[:k][torch.argsort(rows[at[:k]])]  # [k] positions, rows ascending
            if back is not None:
                by_back = torch.argsort(back)
                taken, back = taken[by_back], back[by_back]
            self._fill(taken, back, rows[missed], tick)
            lines[missed] = taken
        self._counts.misses += k
        self._counts.bypassed += n_miss - k
        return lines, n_miss - k

    def _take(
        self, k: int, hits: int, tick: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([k] lines for a call's misses, none stamped by the call (it stamped ``hits``
        lines): lines never used first, then the least recently used of the window after the
        clock hand (see the module doc), evicted; [k] the row each line's payload must go back
        to, -1 for none, or None where no line was evicted). ``k <= lines - hits``."""
        dev = self.values.device
        fresh = min(k, self.lines - self._fresh)
        taken: list[torch.Tensor] = []
        if fresh:
            new = torch.arange(self._fresh, self._fresh + fresh, device=dev)  # [fresh]
            self._fresh += fresh
            self.stamp[new] = tick  # this call's now: the window below passes them over
            taken.append(new)
        rest = k - fresh
        if rest == 0:
            return taken[0], None
        # the call has stamped hits + fresh lines, so a window of at least k + hits lines
        # (<= L) holds `rest` others; twice that lets the older half go
        width = min(self.lines, 2 * (k + hits))
        window, candidate = self._clock_window(width, tick)  # [width] each
        pick = torch.topk(candidate, rest, largest=False, sorted=False).indices
        victims = window[pick]  # [rest]
        back = self._evict(victims)  # [rest]
        if not fresh:
            return victims, back
        return torch.cat([*taken, victims]), torch.cat([back.new_full((fresh,), -1), back])

    def _evict(self, victims: torch.Tensor) -> torch.Tensor:
        """Free lines ``victims`` [k] (their rows unmapped, counted on the device: no host
        read); returns [k] the row each line's payload must go back to (its row where dirty,
        else -1), for :meth:`_fill`'s write-back."""
        self._version += 1
        return self._unmap(victims)

    def _fill(
        self, lines: torch.Tensor, back: torch.Tensor | None, rows: torch.Tensor, tick: torch.Tensor
    ) -> None:
        """Lines ``lines`` [k] take ``rows`` [k] from the host tier, after the payload they hold
        goes back to rows ``back`` [k] (-1: not written; None: no line is written): one pass
        over the host tier (on CUDA one kernel, the write-backs and reads crossing PCIe at the
        same time)."""
        if back is None:
            payload = self.store.read(rows)  # [k, 2 * dim]
        else:
            payload = self.store.swap(back, self._packed(lines), rows)
        self._unpack(lines, payload.to(self.values.device, non_blocking=True))
        self.row_of_line[lines] = rows
        self.line_of_row[rows] = lines.to(torch.int32)
        self.stamp[lines] = tick
        self.dirty[lines] = False

    def _split(self, lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions cached, positions bypassed) of resolved ``lines``."""
        cached = lines >= 0
        return torch.nonzero(cached).squeeze(1), torch.nonzero(~cached).squeeze(1)

    # ------------------------------------------------------------------ the step

    def gather(self, rows: torch.Tensor, *, stored: int | None = None) -> torch.Tensor:
        out = torch.zeros(rows.numel(), self.dim, dtype=torch.float32, device=self.values.device)
        if stored is None:
            at = torch.nonzero(rows >= 0).squeeze(1)  # [stored]: a host read
        else:
            at = compact_positions(rows >= 0, stored)  # [stored]
        if at.numel() == 0:
            return out  # [U, dim]
        real = rows if at.numel() == rows.numel() else rows[at]
        lines, n_bypassed = self._resolve(real)
        if n_bypassed == 0:
            self._resolved = (rows, lines, self._version)  # for the step's adagrad
            out[at] = self.values[lines]
            return out  # [U, dim]
        cached, bypassed = self._split(lines)
        out[at[cached]] = self.values[lines[cached]]
        if bypassed.numel():
            payload = self.store.read(real[bypassed]).to(out.device)
            out[at[bypassed]] = payload[:, : self.dim]
        return out  # [U, dim]

    def adagrad(
        self,
        rows: torch.Tensor,
        grads: torch.Tensor,
        config: AdagradConfig,
        *,
        looked_up: torch.Tensor | None = None,
    ) -> None:
        if rows.numel() == 0:
            return
        lines = self._lines_found(rows, looked_up)
        n_bypassed = 0
        if lines is None:
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

    def _lines_found(
        self, rows: torch.Tensor, looked_up: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The lines the last :meth:`gather` resolved, when ``rows`` [n] are the entries >= 0 of
        the tensor it was given (``looked_up``, the same object) and no line has left its row
        since (the version): the backward's Adagrad then skips a second resolve of the same
        rows (its host read, stamps and counts). None where that does not hold."""
        if looked_up is None or self._resolved is None:
            return None
        given, lines, version = self._resolved
        if given is not looked_up or version != self._version or lines.numel() != rows.numel():
            return None
        return lines  # [n]

    def prefetch(self, rows: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        before = self._counts.misses
        self._resolve(rows)
        self._counts.prefetched += self._counts.misses - before

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
        self._version += 1
        old_rows = torch.nonzero(old_keys >= 0).squeeze(1)
        new_rows, found = self.table.find(
            old_keys[old_rows], old_tids[old_rows].to(torch.int64), validate=False
        )
        kept = torch.nonzero(found).squeeze(1)
        old_rows, new_rows = old_rows[kept], new_rows[kept]
        capacity = self.table.capacity
        self.store.permute(capacity, old_rows, new_rows)
        self._store_moves += 1
        remap = torch.full((old_keys.numel(),), -1, dtype=torch.int64, device=old_keys.device)
        remap[old_rows] = new_rows
        held = self.row_of_line >= 0
        moved = torch.where(held, remap[self.row_of_line.clamp(min=0)], -1)  # [L]
        gone = held & (moved < 0)
        self.stamp.masked_fill_(gone, -1)
        self.dirty.masked_fill_(gone, False)
        self._row_of_line, self.row_of_line = with_sink(moved, -1)
        self._set_line_map(capacity)
        live = torch.nonzero(moved >= 0).squeeze(1)
        self.line_of_row[moved[live]] = live.to(torch.int32)

    def _read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, accumulators) [n, dim] of ``rows`` [n] as they are now, cache unchanged."""
        payload = self.store.read(rows).to(self.values.device)  # [n, 2 * dim]
        lines = self.line_of_row[rows].to(torch.int64)  # [n]
        cached = (lines >= 0).unsqueeze(1)  # [n, 1]
        line = lines.clamp(min=0)
        v = torch.where(cached, self.values[line], payload[:, : self.dim])
        a = torch.where(cached, self.accum[line], payload[:, self.dim :])
        return v, a  # [n, dim] each

    def _write(self, rows: torch.Tensor, values: torch.Tensor, accum: torch.Tensor) -> None:
        """Store the payload of distinct ``rows`` in the host tier; their lines are dropped (the
        rows now belong to keys whose payload this is)."""
        self._version += 1
        lines = self.line_of_row[rows].to(torch.int64)
        drop = torch.where(lines >= 0, lines, self.lines)  # rows without a line: the sink
        self._row_of_line[drop] = -1
        self._stamps[drop] = -1
        self._dirty[drop] = False
        self.line_of_row[rows] = -1
        self.store.write(rows, torch.cat([values, accum], 1))

    # ------------------------------------------------------------------ state

    def flush(self) -> None:
        """Write every dirty line to the host tier (lines stay cached, now clean)."""
        dirty = torch.nonzero(self.dirty).squeeze(1)
        if dirty.numel():
            self.store.write(self.row_of_line[dirty], self._packed(dirty))
            self._counts.writebacks += dirty.numel()
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
