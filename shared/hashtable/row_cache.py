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

Caching is keyed by row (the table's slot row, what ``find`` returns):

- ``line_of_row`` [capacity] int32 (-1: not cached) and ``row_of_line`` [lines] int64;
- ``stamp`` [lines] int64: the call that last used the line (-1: free), for eviction;
- ``dirty`` [lines] bool: the line holds updates the host tier does not have yet.

Each of these arrays has one slot more than it shows (a *sink*): a scatter of positions that
have nothing to write (misses when stamping hits, victims that held no row when unmapping them,
rows without a line when dropping lines) sends them there, so no scatter needs a host read to
select its positions first.

A call that touches rows (:meth:`RowCache.gather`, :meth:`RowCache.adagrad`,
:meth:`RowCache.prefetch`) resolves them to lines first, with **one host read** (the size of the
miss list): hits are stamped; the misses are read from the host tier in ONE vectorized gather of
the packed miss list (on CUDA a kernel reading the host rows through UVA, straight into device
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

**The static step's form** (:meth:`RowCache.static_resolve`, called by
:mod:`shared.hashtable.static_step` through the :class:`~shared.hashtable.payload.RowPayload`
seam): the same resolve with fixed shapes and no host read, so that a CACHING storage's
training step is captured in a CUDA graph like HBM_ONLY's. The step's P padded distinct rows
(a validity mask) resolve through masks: a cumsum over "needs a line" gives each such row its
victim among a window of ``min(L, 2P)`` lines after the clock hand (sorted by stamp, this
call's last; the hand, the tick and the counters are device tensors, shared with the eager
resolve), one :meth:`HostStore.swap` of P slots (-1: nothing) writes the dirty victims back and
reads the stored rows, and a new key's line takes its initializer row at once (dirty), never
crossing to the host and back. The lookup then gathers from lines and the backward's Adagrad
updates lines (dirty marked): HBM_ONLY's arithmetic on other slots. A step with more distinct
rows than lines (or than the lines it does not use itself) bypasses the rest in fixed shapes
too: ``P - L`` staging slots after the lines' sink (made on the host before the step,
:meth:`RowCache.static_began`) take their payload in the forward's swap, and the backward writes
them back to the host tier in one write of P slots (-1 skipped), which only steps of more keys
than lines issue. Lines the eager path thinks never used are forgotten once a static step ran
(``_fresh``): the window finds them by their stamp (-1 sorts first).

Done for issue #52: the host tier's rows moved by the device (UVA kernels, no host sync; the
write-backs overlapped with the misses' reads), one host read an eager resolve and none in the
backward, victims from a bounded window, the static (capturable) form above. Not built yet: the
resolve as custom kernels (torch ops); the misses of batch i+1 fetched on a side stream while
step i runs (prefetch runs on the training thread between steps, with the eager resolve's host
read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.backend import Backend
from shared.hashtable.hashing import compact_positions
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
    writebacks: int = 0  # of those, dirty lines written to the host tier (and flushed lines)
    prefetched: int = 0  # rows :meth:`RowCache.prefetch` brought in (also counted as misses)
    created: int = 0  # new keys' rows made in a line by the static step (no host tier read)


def _with_sink(shown: torch.Tensor, fill: float | bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(``shown`` with one slot (row) more, filled with ``fill``; the view of its first ones)."""
    full = torch.cat([shown, shown.new_full((1, *shown.shape[1:]), fill)])
    return full, full[: shown.shape[0]]


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
        payload = torch.zeros(lines, dim, dtype=torch.float32, device=dev)
        # each [L + 1] (rows) with its view [L]: the last slot a sink (see the module doc)
        self._values, self.values = _with_sink(payload, 0.0)  # [L, dim]
        self._accum, self.accum = _with_sink(payload, 0.0)  # [L, dim]
        free = torch.full((lines,), -1, dtype=torch.int64, device=dev)
        self._row_of_line, self.row_of_line = _with_sink(free, -1)
        self._stamps, self.stamp = _with_sink(free, -1)
        self._dirty, self.dirty = _with_sink(torch.zeros_like(free, dtype=torch.bool), False)
        self._set_line_map(table.capacity)
        # on the device, so that the static step's captured resolve advances them too
        self._tick = torch.zeros((), dtype=torch.int64, device=dev)  # calls: the current stamp
        self._hand = torch.zeros((), dtype=torch.int64, device=dev)  # the next window's start
        self._fresh = 0  # lines [_fresh, L) were never used: taken in order before any victim
        self._counts = CacheCounters()  # those known on the host (not evictions in _evict)
        # bumped whenever a line may leave its row (evictions, dropped lines, growth): lines
        # resolved before stay valid while it is unchanged
        self._version = 0
        # (the tensor the last gather was given, the lines of its rows >= 0, the version then)
        self._resolved: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._evicted = torch.zeros(2, dtype=torch.int64, device=dev)  # evictions, write-backs
        # the static step's hits, misses, new rows made in lines, bypassed rows
        self._static = torch.zeros(4, dtype=torch.int64, device=dev)
        self._staged = 0  # staging slots after the sink of _values / _accum (static bypass)
        self._store_moves = 0  # growths of the host tier (a captured swap holds its address)

    def _set_line_map(self, capacity: int) -> None:
        """An empty ``line_of_row`` [capacity] (and its sink)."""
        none = torch.full((capacity,), -1, dtype=torch.int32, device=self.values.device)
        self._line_map, self.line_of_row = _with_sink(none, -1)

    @property
    def lines(self) -> int:
        return self.values.shape[0]

    @property
    def counters(self) -> CacheCounters:
        """The counters so far (a host read: evictions and the static step's resolves are
        counted on the device)."""
        evictions, writebacks, hits, misses, created, bypassed = torch.cat(
            [self._evicted, self._static]
        ).tolist()
        c = self._counts
        return dataclasses.replace(
            c,
            hits=c.hits + hits,
            misses=c.misses + misses,
            bypassed=c.bypassed + bypassed,
            evictions=c.evictions + evictions,
            writebacks=c.writebacks + writebacks,
            created=c.created + created,
        )

    def __repr__(self) -> str:
        return f"RowCache(lines={self.lines}, dim={self.dim}, store={self.store!r})"

    # ------------------------------------------------------------------ resolve

    def _resolve(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """([n] int64 lines of distinct ``rows`` [n] (all >= 0), -1 for rows bypassed; the
        number bypassed): a new call (stamp); hits stamped, misses loaded into lines this call
        does not use (:meth:`_take`). One host read: the size of the miss list."""
        self._tick += 1
        tick = self._tick  # [] int64 on the device
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
            self._fill(taken, back, rows[at[:k]], tick)
            lines[at[:k]] = taken
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
        window = (self._hand + torch.arange(width, device=dev)) % self.lines  # [width]
        self._hand.add_(width).remainder_(self.lines)
        stamps = self.stamp[window]  # [width]
        candidate = torch.where(stamps < tick, stamps, _KEEP)
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
        old = self.row_of_line[victims]  # [k]
        held = old >= 0
        back = held & self.dirty[victims]
        self._line_map[torch.where(held, old, self.line_of_row.numel())] = -1  # free: the sink
        self._evicted += torch.stack([held.sum(), back.sum()])
        return torch.where(back, old, -1)

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
            out = torch.cat([self.values[lines], self.accum[lines]], 1)  # [k, 2 * dim]
            payload = self.store.swap(back, out, rows)
        payload = payload.to(self.values.device, non_blocking=True)
        self.values[lines] = payload[:, : self.dim]
        self.accum[lines] = payload[:, self.dim :]
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
        self._row_of_line, self.row_of_line = _with_sink(moved, -1)
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
            rows = self.row_of_line[dirty]
            self.store.write(rows, torch.cat([self.values[dirty], self.accum[dirty]], 1))
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

    # ------------------------------------------------------------------ the static step

    def why_not_static(self) -> str | None:
        """Why the static step cannot take this cache (None: it can): the host tier must be
        reachable with no host read (:meth:`HostStore.why_not_static`)."""
        why = self.store.why_not_static(self.values.device)
        return None if why is None else f"the CACHING storage's host tier: {why}"

    def static_began(self, padded: int) -> int:
        """A static lookup of ``padded`` keys is about to run (on the host, before its
        forward's graph or code): its resolve may evict lines, so the lines an eager lookup
        resolved are stale from now on, lines the eager resolve thinks never used may be taken,
        and a replay's swap uses the host tier; a step of more keys than lines may bypass rows,
        which need staging slots (allocated here, outside any capture: the arrays move, so the
        step captures its graphs again). Returns the version its backward checks
        (:meth:`static_version`)."""
        self._version += 1
        self._fresh = self.lines
        self.store.used_by_device(self.values.device)
        if padded - self.lines > self._staged:
            self._stage(max(padded - self.lines, 2 * self._staged))
        return self._version

    def _stage(self, n: int) -> None:
        """``n`` staging slots after the lines' sink (the lines kept): where the static step
        keeps the rows it bypasses between its forward and its backward."""
        big = self.lines + 1
        for name in ("_values", "_accum"):
            old = getattr(self, name)
            grown = torch.zeros(big + n, self.dim, dtype=torch.float32, device=old.device)
            grown[:big] = old[:big]
            setattr(self, name, grown)
        self.values, self.accum = self._values[: self.lines], self._accum[: self.lines]
        self._staged = n

    def static_version(self) -> int:
        """Bumped whenever a line may have left its row (a static step's backward compares it
        with its forward's: an eager resolve between the two may have taken its lines)."""
        return self._version

    def static_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, accumulators) [L + 1 + staged, dim]: the lines, the sink, the staging
        slots: what :meth:`static_resolve`'s slots index."""
        return self._values, self._accum

    def static_key(self) -> tuple[object, ...]:
        """What a captured step reads at fixed addresses: changes when one of them moves."""
        arrays = (self._values, self._accum, self._line_map, self._row_of_line, self._stamps,
                  self._dirty, self._tick, self._hand, self._evicted, self._static)  # fmt: skip
        return (*(a.data_ptr() for a in arrays), self._store_moves)

    def static_resolve(
        self, rows: torch.Tensor, found: torch.Tensor, new_values: torch.Tensor
    ) -> torch.Tensor:
        """[P] int64: the slot in :meth:`static_arrays` of each of a static step's distinct
        ``rows`` [P] (-1: no row), with fixed-size ops and no host read (captured on CUDA).
        ``found`` [P] bool: the row was stored before the step (its payload is in the host
        tier or a line); the other rows belong to keys the step inserted, whose payload is
        ``new_values`` [P, dim] and the initial accumulators.

        - A row with a line is stamped (a hit, or a new key's row whose evicted key left a
          line there: the line is reused).
        - The rows without a line take one each from a window of ``min(L, 2P)`` lines after
          the clock hand (the hand, a device tensor, moves past it): the window's lines sorted
          by stamp, this call's last, and the i-th such row (a cumsum over the mask) takes the
          i-th line, if that line is not this call's. With ``L >= P`` every row gets one (the
          call stamps at most ``P - k`` lines when ``k`` rows need one). Never-used lines
          (stamp -1) sort first.
        - Rows left without a line (a step of more distinct rows than lines) are *bypassed*:
          the i-th of them takes staging slot i after the lines (:meth:`static_began` made
          ``P - L`` of them), and the backward writes it back to the host tier
          (:meth:`static_updated`); a bypassed new key's initializer row is written there at
          once (a step without a backward leaves it as HBM_ONLY's insert does).
        - One :meth:`HostStore.swap` of P slots: dirty victims written back, the stored rows
          read, -1 elsewhere; a new key's line takes its initializer row and is dirty at once,
          so its row never crosses to the host and back (the eager path writes it to the host
          tier and reads it at the next resolve).
        - Maps, stamps and dirty bits are scattered with the sink slots for unused positions;
          hits, misses, new rows, bypassed rows, evictions and write-backs are counted on the
          device."""
        big, dim, dev = self.lines, self.dim, self.values.device
        p, sink_row = rows.numel(), self.line_of_row.numel()
        assert p - big <= self._staged, "static_began(padded) makes the staging slots first"
        self._tick += 1
        tick = self._tick  # [] int64
        stored = rows >= 0
        new = stored & ~found
        line = torch.where(stored, self.line_of_row[rows.clamp(min=0)].to(torch.int64), -1)
        has = line >= 0  # [P]
        self._stamps[torch.where(has, line, big)] = tick
        need = stored & ~has  # [P] rows that take a line now
        rank = torch.cumsum(need, 0) - 1  # [P] each one's victim
        width = min(big, 2 * p)
        window = (self._hand + torch.arange(width, device=dev)) % big  # [width]
        self._hand.add_(width).remainder_(big)
        stamps = self.stamp[window]
        candidate = torch.where(stamps < tick, stamps, _KEEP)
        ranked, by_age = torch.sort(candidate, stable=True)
        n_victims = min(width, p)
        victims = window[by_age[:n_victims]]  # [n_victims] oldest first
        at = rank.clamp(0, n_victims - 1)
        gets = need & (rank < n_victims) & (ranked[:n_victims][at] < _KEEP)  # not this call's
        taken = torch.where(gets, victims[at], big)  # [P] the sink: none
        old = self._row_of_line[taken]  # [P] the row each victim held
        held = gets & (old >= 0)
        back = held & self._dirty[taken]
        self._line_map[torch.where(held, old, sink_row)] = -1  # unmapped
        self._evicted += torch.stack([held.sum(), back.sum()])
        out = torch.cat([self._values[taken], self._accum[taken]], 1)  # [P, 2 * dim]
        read = torch.where(need & found, rows, -1)
        payload = self.store.swap(torch.where(back, old, -1), out, read)  # [P, 2 * dim]
        payload = payload.to(dev, non_blocking=True)
        init = torch.cat(
            [new_values, torch.full_like(new_values, self.initial_accumulator_value)], 1
        )
        payload = torch.where(new.unsqueeze(1), init, payload)
        slots = torch.where(has, line, torch.where(gets, taken, -1))  # [P]
        bypass = need & ~gets
        if p > big:  # a step that may bypass rows (its size decides: no host read)
            # the i-th bypassed row: staging slot i (after the sink)
            slots = torch.where(bypass, big + torch.cumsum(bypass, 0), slots)
            # a bypassed new key's row goes to the host tier now, as a line would hold it:
            # with no backward (no update) nothing else would write it there
            self.store.write(torch.where(bypass & new, rows, -1), init)
        fill = torch.where(need | new, slots, big)  # [P] slots written: misses', new keys'
        self._values[fill] = payload[:, :dim]
        self._accum[fill] = payload[:, dim:]
        lined = torch.where(gets | (new & has), slots, big)  # [P] lines (re)mapped
        self._row_of_line[lined] = rows
        self._line_map[torch.where(gets, rows, sink_row)] = slots.to(torch.int32)
        self._stamps[lined] = tick
        self._dirty[lined] = new
        counts = [found & has, found & gets, new & ~bypass, bypass]
        self._static += torch.stack([c.sum() for c in counts])
        return slots

    def static_updated(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The static backward's Adagrad updated slots ``slots`` [P] of ``rows`` [P] (-1:
        none): their lines are dirty now, and bypassed rows (staging slots, where a step has
        more keys than lines) go back to the host tier in one fixed-size write (-1 skipped)."""
        big = self.lines
        lined = (slots >= 0) & (slots < big)
        self._dirty[torch.where(lined, slots, big)] = True
        if rows.numel() > big:  # a step that may bypass rows (its size decides: no host read)
            staged = slots > big
            at = torch.where(staged, slots, big)
            payload = torch.cat([self._values[at], self._accum[at]], 1)  # [P, 2 * dim]
            self.store.write(torch.where(staged, rows, -1), payload)

    def stats(self) -> dict[str, float]:
        c = self.counters
        used = c.hits + c.misses + c.bypassed
        hbm = self._values.nbytes + self._accum.nbytes
        hbm += self._row_of_line.nbytes + self._stamps.nbytes + self._dirty.nbytes
        hbm += self._line_map.nbytes
        return {
            "cache_lines": float(self.lines),
            "cache_hits": float(c.hits),
            "cache_misses": float(c.misses),
            "cache_bypassed": float(c.bypassed),
            "cache_evictions": float(c.evictions),
            "cache_writebacks": float(c.writebacks),
            "cache_prefetched": float(c.prefetched),
            "cache_created": float(c.created),
            "cache_hit_rate": c.hits / used if used else 0.0,
            "hbm_payload_bytes": float(hbm),
            "host_payload_bytes": float(self.store.capacity * 2 * self.dim * 4),
        }
