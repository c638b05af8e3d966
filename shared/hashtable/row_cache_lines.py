"""The device lines of a CACHING storage's row cache: their arrays, clock, counters and stats.

:class:`CacheLines` holds the state that both forms of the resolve work on, the eager one
(:class:`~shared.hashtable.row_cache.RowCache`, :mod:`shared.hashtable.row_cache`, which
explains the cache as a whole) and the static step's fixed-shape one
(:mod:`shared.hashtable.row_cache_static`); neither form owns it, so it lives below both:
``RowCache`` subclasses ``StaticCacheLines``, which subclasses ``CacheLines`` (no import cycle).

Caching is keyed by row (the table's slot row, what ``find`` returns):

- ``values`` / ``accum`` [lines, dim]: the payload of the rows in use;
- ``line_of_row`` [capacity] int32 (-1: not cached) and ``row_of_line`` [lines] int64;
- ``stamp`` [lines] int64: the call that last used the line (-1: free), for eviction;
- ``dirty`` [lines] bool: the line holds updates the host tier does not have yet.

Each of these arrays has one slot more than it shows (a *sink*): a scatter of positions that
have nothing to write (misses when stamping hits, victims that held no row when unmapping them,
rows without a line when dropping lines) sends them there, so no scatter needs a host read to
select its positions first.

The call counter (the current stamp), the clock hand and the eviction counters are device
tensors, so that the static step's captured resolve advances them as the eager one does.
:meth:`CacheLines._window` is the victim window both resolves share: the lines after the hand,
each with its stamp as its age (this call's own lines never candidates; the eager resolve ranks
them with :meth:`CacheLines._clock_window`, the static one sorts int32 ages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shared.hashtable.backend import Backend
from shared.hashtable.host_store import HostStore, TensorHostStore
from shared.hashtable.table import HashTable

# a stamp above every real one: lines a call must keep sort after every candidate victim
KEEP = torch.iinfo(torch.int64).max


@dataclass
class CacheCounters:
    """Cumulative counters of one cache (rows, not lookups: a row is counted once a call)."""

    hits: int = 0  # rows found in a line
    misses: int = 0  # rows read from the host tier into a line
    bypassed: int = 0  # rows used in the host tier directly (the call needed more lines)
    evictions: int = 0  # lines given to another row
    writebacks: int = 0  # of those, dirty lines written to the host tier (and flushed lines)
    prefetched: int = 0  # rows a prefetch (eager or static) brought in (also counted as misses)
    created: int = 0  # new keys' rows made in a line by the static step (no host tier read)


def with_sink(shown: torch.Tensor, fill: float | bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(``shown`` with one slot (row) more, filled with ``fill``; the view of its first ones)."""
    full = torch.cat([shown, shown.new_full((1, *shown.shape[1:]), fill)])
    return full, full[: shown.shape[0]]


class CacheLines:
    """``lines`` device lines of ``dim`` values and ``dim`` accumulators over ``store`` (which
    holds every row of ``table``, a :class:`HashTable` of ``dim`` 0), with their maps, stamps,
    dirty bits, clock and counters. ``backend``: the storage's (runs Adagrad on the lines, as on
    rows in HBM_ONLY). The resolves that fill them are its subclasses' (see the module doc)."""

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
        self._values, self.values = with_sink(payload, 0.0)  # [L, dim]
        self._accum, self.accum = with_sink(payload, 0.0)  # [L, dim]
        free = torch.full((lines,), -1, dtype=torch.int64, device=dev)
        self._row_of_line, self.row_of_line = with_sink(free, -1)
        self._stamps, self.stamp = with_sink(free, -1)
        self._dirty, self.dirty = with_sink(torch.zeros_like(free, dtype=torch.bool), False)
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
        # the static step's hits, misses, new rows made in lines, bypassed rows; rows its
        # prefetch read
        self._static = torch.zeros(5, dtype=torch.int64, device=dev)
        self._prefetch_bumps = 0  # the bumps of _version that were static prefetches
        self._last_padded = 0  # the last resolve's rows (padded): more than lines may bypass
        self._staged = 0  # staging slots after the sink of _values / _accum (static bypass)
        self._store_moves = 0  # growths of the host tier (a captured swap holds its address)
        # the static resolve fills its slots in place, in one kernel, where the device reads
        # and writes the host rows itself (a mapped store on CUDA); else through torch ops
        self._fills_in_place = (
            isinstance(store, TensorHostStore) and store.mapped and dev.type == "cuda"
        )

    def _set_line_map(self, capacity: int) -> None:
        """An empty ``line_of_row`` [capacity] (and its sink)."""
        none = torch.full((capacity,), -1, dtype=torch.int32, device=self.values.device)
        self._line_map, self.line_of_row = with_sink(none, -1)

    @property
    def lines(self) -> int:
        return self.values.shape[0]

    def _clock_window(self, width: int, tick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([width] the lines after the clock hand, wrapping around; [width] their stamps,
        :data:`KEEP` for the lines call ``tick`` stamped itself): the candidate victims, the
        least recently used smallest. The hand moves past the window. Why a window, not every
        line: :mod:`shared.hashtable.row_cache`'s doc."""
        window = self._window(width)
        stamps = self.stamp[window]  # [width]
        return window, torch.where(stamps < tick, stamps, KEEP)

    def _window(self, width: int) -> torch.Tensor:
        """[width] the lines after the clock hand, wrapping around; the hand moves past them."""
        window = (self._hand + torch.arange(width, device=self.values.device)) % self.lines
        self._hand.add_(width).remainder_(self.lines)
        return window

    def _packed(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, 2 * dim]: the values, then the accumulators, of ``slots`` [n] (lines, the sink,
        staging slots): a host tier's row layout."""
        return torch.cat([self._values[slots], self._accum[slots]], 1)

    def _unpack(self, slots: torch.Tensor, payload: torch.Tensor) -> None:
        """Slots ``slots`` [n] take ``payload`` [n, 2 * dim] (:meth:`_packed`'s layout)."""
        self._values[slots] = payload[:, : self.dim]
        self._accum[slots] = payload[:, self.dim :]

    def _unmap(self, victims: torch.Tensor, taking: torch.Tensor | None = None) -> torch.Tensor:
        """Lines ``victims`` [k] leave the rows they hold (where ``taking`` [k], if given; the
        others are the sink): those rows unmapped, evictions and write-backs counted on the
        device, no host read. Returns [k] the row each line's payload must go back to (its row
        where held and dirty, else -1). Both resolves evict through it."""
        old = self._row_of_line[victims]  # [k]
        held = old >= 0 if taking is None else taking & (old >= 0)
        back = held & self._dirty[victims]
        # index_fill_, not ``[...] = -1``: a Python scalar assigned through an index is copied
        # from unpinned host memory, which a CUDA graph capture refuses
        self._line_map.index_fill_(0, torch.where(held, old, self.line_of_row.numel()), -1)
        self._evicted += torch.stack([held.sum(), back.sum()])
        return torch.where(back, old, -1)

    @property
    def counters(self) -> CacheCounters:
        """The counters so far (a host read: evictions and the static step's resolves are
        counted on the device)."""
        evictions, writebacks, hits, misses, created, bypassed, prefetched = torch.cat(
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
            prefetched=c.prefetched + prefetched,
        )

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
