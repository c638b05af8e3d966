"""A bucketized hash table of int64 keys → rows of a float32 value buffer, in vectorized torch.

Layout (``capacity = num_buckets * bucket_capacity`` slots and as many rows)::

    slot_fp   [capacity] int64   fingerprint of the slot's key; empty slot: its bucket's sentinel
    slot_row  [capacity] int64   row of the slot's key (a permutation of the bucket's own rows)
    row_key   [capacity] int64   key of the row, -1 when the row is free
    row_tid   [capacity] int32   table id of the row (separate key spaces for fused tables)
    row_score [capacity] int64   eviction score (step, timestamp or use count; set by the caller)
    values    [capacity, dim]    float32 embedding rows
    accumulators [capacity, dim] float32 Adagrad state (optional)

A key's bucket is ``floor(u * num_buckets / 2**64)`` for the unsigned value ``u`` of its 64-bit
fingerprint (splitmix64 of the key, salted by the table id; even), so buckets are contiguous
fingerprint ranges. Inside a bucket the occupied slots come first, sorted by fingerprint, and the
empty slots hold the bucket's sentinel (an odd value above all of the bucket's fingerprints and
not above the next bucket's). The whole slot array is therefore one sorted sequence, and a
batch ``find`` is a single ``torch.searchsorted`` plus a comparison of the full (key, table id)
pair (and of a neighbour slot, for the rare keys sharing a fingerprint); no per-key loop, no
probing. This replaces dynamicemb's 1-byte digests (which speed up a linear probe inside a
bucket in a CUDA kernel) by an 8-byte fingerprint per slot.

Rows never move while the table keeps its size: an insert re-sorts only the occupied slots of
the touched buckets (a ``[buckets, <= bucket_capacity]`` sort) and takes the free rows of those
buckets; a growth (rehash into twice the buckets) rebuilds all rows and bumps
:attr:`HashTable.generation`.

Determinism: every step is a stable sort, a searchsorted, a cumsum or a scatter to distinct
indices, so the same sequence of calls gives the same table on CPU and CUDA. Keys must be
non-negative (-1 marks a free row).

On CUDA with CuPy installed, ``find``, ``insert_or_assign``, ``erase`` and ``from_keys_values``
run the kernels of :mod:`shared.hashtable.cuda` on these same arrays, with the same results; the
code here stays the CPU path and the reference (``shared.hashtable.cuda.disabled()`` forces it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.features import ScoreStrategy, TableSpec
from shared.hashtable.buckets import group_runs, keep_best, merge_full_buckets
from shared.hashtable.cuda import runtime as cuda_kernels
from shared.hashtable.hashing import (
    bucket_of,
    bucket_sentinels,
    check_keys,
    count_ids,
    count_sorted,
    fingerprint,
    unique_pairs,
)

EMPTY_KEY = -1


class ExportedRows(NamedTuple):
    """Stored entries, sorted by (table id, key). ``accumulators`` is None without optimizer state."""

    keys: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N, dim] float32
    scores: torch.Tensor  # [N] int64
    accumulators: torch.Tensor | None  # [N, dim] float32
    table_ids: torch.Tensor  # [N] int64


@dataclass
class InsertResult:
    """What :meth:`HashTable.insert_or_assign` did, per input key (duplicates share a result)."""

    rows: torch.Tensor  # [n] int64: row of the key after the call, -1 if it is not stored
    inserted: torch.Tensor  # [n] bool: the key was new and is now stored
    evicted_keys: torch.Tensor  # [E] int64: keys removed to make room
    evicted_table_ids: torch.Tensor  # [E] int64
    num_refused: int  # new (unique) keys that could not be stored


class HashTable:
    """int64 keys → rows of ``values``; see the module docstring for the layout.

    ``HashTable(16, init_capacity=1024, max_capacity=1 << 20)`` starts with
    ``ceil(init_capacity / bucket_capacity)`` buckets and doubles them whenever an insert would
    push the load factor above ``max_load_factor`` or overflow a bucket, up to
    ``ceil(max_capacity / bucket_capacity)`` buckets (capacities are rounded up to whole buckets;
    ``bucket_capacity`` is capped at ``max_capacity``). At that size, when a key's bucket is full,
    the entry with the lowest score leaves (ties: the newcomer stays, then the lower
    fingerprint), except for ``pinned_rows``; under ``ScoreStrategy.NO_EVICTION`` new keys are
    refused instead. Evictions and refusals are counted in :attr:`evictions` / :attr:`refusals`.
    The table does not compute scores: the caller passes them (see ``storage.py``).
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
    ) -> None:
        if dim < 0:
            raise ValueError(f"HashTable: dim must be >= 0, got {dim}")
        if not 1 <= init_capacity <= max_capacity:
            raise ValueError(
                f"HashTable: need 1 <= init_capacity ({init_capacity}) <= max_capacity "
                f"({max_capacity})"
            )
        if bucket_capacity < 1:
            raise ValueError(f"HashTable: bucket_capacity must be >= 1, got {bucket_capacity}")
        if not 0.0 < max_load_factor <= 1.0:
            raise ValueError(f"HashTable: max_load_factor must be in (0, 1], got {max_load_factor}")
        self.dim = dim
        self.bucket_capacity = min(bucket_capacity, max_capacity)
        self.score_strategy = score_strategy
        self.max_load_factor = max_load_factor
        self.with_accumulator = with_accumulator
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.device = torch.device(device)
        self._max_buckets = math.ceil(max_capacity / self.bucket_capacity)
        if self._max_buckets >= 1 << 31:
            raise ValueError(f"HashTable: max_capacity {max_capacity} needs >= 2**31 buckets")
        self.evictions = 0  # existing keys removed to make room (cumulative)
        self.refusals = 0  # new keys not stored (cumulative)
        self.generation = 0  # bumped whenever rows move (growth)
        self._allocate(min(math.ceil(init_capacity / self.bucket_capacity), self._max_buckets))

    @classmethod
    def from_spec(
        cls,
        spec: TableSpec,
        *,
        device: torch.device | str = "cpu",
        with_accumulator: bool = True,
        initial_accumulator_value: float = 0.0,
        max_load_factor: float = 0.5,
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
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_buckets(self) -> int:
        return self._num_buckets

    @property
    def capacity(self) -> int:
        return self._num_buckets * self.bucket_capacity

    @property
    def max_capacity(self) -> int:
        """The capacity growth stops at (max_capacity rounded up to whole buckets)."""
        return self._max_buckets * self.bucket_capacity

    @property
    def size(self) -> int:
        return self._size

    @property
    def load_factor(self) -> float:
        return self._size / self.capacity

    @property
    def values(self) -> torch.Tensor:
        """[capacity, dim] float32, indexed by the rows that :meth:`find` returns."""
        return self._values

    @property
    def accumulators(self) -> torch.Tensor | None:
        """[capacity, dim] float32 Adagrad state beside :attr:`values` (None without it)."""
        return self._accum

    @property
    def row_keys(self) -> torch.Tensor:
        """[capacity] int64 key of each row, -1 for free rows (read-only view of the table)."""
        return self._row_key

    @property
    def row_table_ids(self) -> torch.Tensor:
        return self._row_tid

    # ------------------------------------------------------------------ storage

    def _allocate(self, num_buckets: int) -> None:
        b, dev = self.bucket_capacity, self.device
        cap = num_buckets * b
        self._num_buckets = num_buckets
        self._sentinel = bucket_sentinels(num_buckets, dev)  # [nb]
        self._slot_fp = self._sentinel.repeat_interleave(b)  # [cap]
        self._slot_row = torch.arange(cap, dtype=torch.int64, device=dev)
        self._row_key = torch.full((cap,), EMPTY_KEY, dtype=torch.int64, device=dev)
        self._row_tid = torch.zeros(cap, dtype=torch.int32, device=dev)
        self._row_score = torch.zeros(cap, dtype=torch.int64, device=dev)
        self._values = torch.zeros(cap, self.dim, dtype=torch.float32, device=dev)
        self._accum = (
            torch.full(
                (cap, self.dim), self.initial_accumulator_value, dtype=torch.float32, device=dev
            )
            if self.with_accumulator
            else None
        )
        self._bucket_count = torch.zeros(num_buckets, dtype=torch.int64, device=dev)
        self._size = 0
        self._any_tid = False  # whether a non-zero table id was ever stored

    def _prepare(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, what: str, validate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys = check_keys(keys.to(self.device), what, check_sign=validate)
        if table_ids is None:
            return keys, None
        table_ids = table_ids.to(self.device, torch.int64)
        if table_ids.shape != keys.shape:
            raise ValueError(
                f"{what}: table_ids shape {tuple(table_ids.shape)} != keys shape "
                f"{tuple(keys.shape)}"
            )
        if validate and bool(((table_ids < 0) | (table_ids >= 1 << 31)).any()):
            raise ValueError(f"{what}: table ids must be in [0, 2**31)")
        return keys, table_ids

    def _fingerprint(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, num_buckets: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fingerprint, bucket) of each key for ``num_buckets`` (default: the current count)."""
        fp = fingerprint(keys, table_ids)
        return fp, bucket_of(fp, self._num_buckets if num_buckets is None else num_buckets)

    def _row_match(
        self, rows: torch.Tensor, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> torch.Tensor:
        match = self._row_key[rows] == keys
        if table_ids is None and not self._any_tid:
            return match  # every stored table id is 0
        tid = self._row_tid[rows]
        return match & (tid == 0 if table_ids is None else tid == table_ids)

    def _locate(
        self, fp: torch.Tensor, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot position and found mask of each key (one searchsorted, then collision runs)."""
        last = self.capacity - 1
        pos = torch.searchsorted(self._slot_fp, fp).clamp_(max=last)
        same_fp = self._slot_fp[pos] == fp
        found = same_fp & self._row_match(self._slot_row[pos], keys, table_ids)
        more = same_fp & ~found
        if not self._any_tid:
            # Only table id 0 is stored, and mix64 is a bijection: at most two stored keys (whose
            # mixes differ in the dropped lowest bit) share a fingerprint, in adjacent slots.
            # One more probe settles every key, with no host sync.
            nxt = (pos + 1).clamp_(max=last)
            hit = (
                more & (self._slot_fp[nxt] == fp) & self._row_match(self._slot_row[nxt], keys, None)
            )
            return torch.where(hit, nxt, pos), found | hit
        while bool(more.any()):  # equal fingerprints of different pairs: walk the run (rare)
            more &= pos < last
            pos = torch.where(more, pos + 1, pos)
            same_fp = more & (self._slot_fp[pos] == fp)
            hit = same_fp & self._row_match(self._slot_row[pos], keys, table_ids)
            found |= hit
            more = same_fp & ~hit
        return pos, found

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
        if self.device.type == "cuda" and cuda_kernels.available():
            from shared.hashtable.cuda.find import find

            return find(self, keys, table_ids)
        fp = fingerprint(keys, table_ids)
        pos, found = self._locate(fp, keys, table_ids)
        rows = torch.where(found, self._slot_row[pos], torch.full_like(pos, -1))
        return rows, found

    def scores_of(self, rows: torch.Tensor) -> torch.Tensor:
        return self._row_score[rows]

    def set_scores(self, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrite the scores of distinct existing ``rows`` (e.g. the rows used in a step)."""
        self._row_score[rows] = scores.to(self.device, torch.int64)

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
        """[num_tables] int64: stored keys per table id."""
        tids = self._row_tid[self._row_key >= 0].to(torch.int64)
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
    ) -> InsertResult:
        """Store ``values`` [n, dim] and ``scores`` [n] for ``keys`` [n].

        Existing keys get the new values and scores (and accumulators if given, else they keep
        theirs); new keys are inserted (accumulators default to ``initial_accumulator_value``),
        growing the table first if the load factor bound would be exceeded. Duplicate keys: the
        last occurrence wins. ``pinned_rows`` (rows from :meth:`find`) are never evicted by this
        call, e.g. the rows of the keys the current batch uses.
        """
        if self.device.type == "cuda" and cuda_kernels.available():
            from shared.hashtable.cuda.insert import insert_or_assign

            res = insert_or_assign(
                self,
                keys,
                values,
                scores,
                table_ids=table_ids,
                accumulators=accumulators,
                pinned_rows=pinned_rows,
            )
            if res is not None:
                return res
        keys, table_ids = self._prepare(keys, table_ids, "HashTable.insert_or_assign")
        n = keys.numel()
        values = values.to(self.device, torch.float32).reshape(n, self.dim)
        scores = scores.to(self.device, torch.int64).reshape(n)
        if accumulators is not None:
            accumulators = accumulators.to(self.device, torch.float32).reshape(n, self.dim)
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        if n == 0:
            none = torch.zeros(0, dtype=torch.bool, device=self.device)
            return InsertResult(empty, none, empty, empty, 0)

        order, starts, counts, inverse, _ = unique_pairs(keys, table_ids)
        last = order[starts + counts - 1]  # the last occurrence of each pair wins
        uk, us, uv = keys[last], scores[last], values[last]
        ut = None if table_ids is None else table_ids[last]
        ua = None if accumulators is None else accumulators[last]

        pinned = None
        if pinned_rows is not None:
            pinned = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
            pinned[pinned_rows.to(self.device)] = True
        evicted_k, evicted_t = [empty], [empty]
        fp, bucket, pos, found, pinned = self._grow_for(uk, ut, pinned, evicted_k, evicted_t)
        new = torch.nonzero(~found).squeeze(1)
        rows_u = torch.where(found, self._slot_row[pos], torch.full_like(pos, -1))
        hit = torch.nonzero(found).squeeze(1)
        if hit.numel():
            r = rows_u[hit]
            self._values[r] = uv[hit]
            self._row_score[r] = us[hit]
            if ua is not None and self._accum is not None:
                self._accum[r] = ua[hit]
        refused = 0
        if new.numel():
            new_rows, ek, et, refused = self._insert_new(
                fp[new],
                bucket[new],
                uk[new],
                None if ut is None else ut[new],
                uv[new],
                us[new],
                None if ua is None else ua[new],
                pinned,
            )
            rows_u[new] = new_rows
            evicted_k.append(ek)
            evicted_t.append(et)
        inserted_u = ~found & (rows_u >= 0)
        return InsertResult(
            rows_u[inverse],
            inserted_u[inverse],
            torch.cat(evicted_k),
            torch.cat(evicted_t),
            refused,
        )

    def _grow_for(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        pinned: torch.Tensor | None,
        evicted_keys: list[torch.Tensor],
        evicted_tids: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Locate distinct ``keys``, first doubling the buckets while the new ones would break
        the load bound or overflow a bucket (below max capacity). Returns (fp, bucket, slot
        position, found, pinned remapped to the new rows); appends rehash evictions."""
        while True:
            fp, bucket = self._fingerprint(keys, table_ids)
            pos, found = self._locate(fp, keys, table_ids)
            new = torch.nonzero(~found).squeeze(1)
            target = self._target_buckets(self._size + new.numel(), bucket[new])
            if target == self._num_buckets:
                return fp, bucket, pos, found, pinned
            remap, (ek, et) = self._rebuild_from_rows(target, pinned)
            evicted_keys.append(ek)
            evicted_tids.append(et)
            if pinned is not None:
                moved = remap[torch.nonzero(pinned).squeeze(1)]
                pinned = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
                pinned[moved[moved >= 0]] = True

    def erase(self, keys: torch.Tensor, table_ids: torch.Tensor | None = None) -> int:
        """Remove ``keys`` (missing ones are ignored); returns how many were removed."""
        if self.device.type == "cuda" and cuda_kernels.available():
            from shared.hashtable.cuda.insert import erase

            erased = erase(self, keys, table_ids)  # one host sync; None: the core's job
            if erased is not None:
                return erased
        keys, table_ids = self._prepare(keys, table_ids, "HashTable.erase")
        if keys.numel() == 0:
            return 0
        order, starts, _, _, _ = unique_pairs(keys, table_ids)
        first = order[starts]
        uk = keys[first]
        ut = None if table_ids is None else table_ids[first]
        fp, bucket = self._fingerprint(uk, ut)
        pos, found = self._locate(fp, uk, ut)
        hit = torch.nonzero(found).squeeze(1)
        if hit.numel() == 0:
            return 0
        pos, bucket = pos[hit], bucket[hit]
        rows = self._slot_row[pos]
        self._free_rows(rows)
        self._slot_fp[pos] = self._sentinel[bucket]
        affected, per_bucket = torch.unique_consecutive(
            torch.sort(bucket).values, return_counts=True
        )
        width = int(self._bucket_count[affected].max())  # erased slots lie within this prefix
        self._bucket_count[affected] -= per_bucket
        self._resort(affected, width)
        self._size -= hit.numel()
        return hit.numel()

    def clear(self, table_id: int | None = None) -> int:
        """Erase every key (of one key space if ``table_id`` is given); returns how many."""
        live = self._row_key >= 0
        if table_id is not None:
            live &= self._row_tid == table_id
        rows = torch.nonzero(live).squeeze(1)
        return self.erase(self._row_key[rows], self._row_tid[rows].to(torch.int64))

    def _free_rows(self, rows: torch.Tensor) -> None:
        self._row_key[rows] = EMPTY_KEY
        self._row_tid[rows] = 0
        self._row_score[rows] = 0

    def _write_rows(
        self,
        rows: torch.Tensor,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        values: torch.Tensor,
        scores: torch.Tensor,
        accumulators: torch.Tensor | None,
    ) -> None:
        self._row_key[rows] = keys
        if table_ids is None:
            self._row_tid[rows] = 0
        else:
            self._row_tid[rows] = table_ids.to(torch.int32)
            self._any_tid = self._any_tid or bool((table_ids != 0).any())
        self._row_score[rows] = scores
        self._values[rows] = values
        if self._accum is not None:
            if accumulators is None:
                self._accum[rows] = self.initial_accumulator_value
            else:
                self._accum[rows] = accumulators

    def _resort(self, buckets: torch.Tensor, width: int) -> None:
        """Re-sort the first ``width`` slots of distinct ``buckets`` by fingerprint (empties go
        last); the slots past ``width`` must be empty already."""
        if buckets.numel() == 0 or width == 0:
            return
        b = self.bucket_capacity
        fp_view = self._slot_fp.view(-1, b)
        row_view = self._slot_row.view(-1, b)
        fps, idx = torch.sort(fp_view[buckets, :width], dim=1, stable=True)
        fp_view[buckets, :width] = fps
        row_view[buckets, :width] = row_view[buckets, :width].gather(1, idx)

    def _target_buckets(self, num_keys: int, new_buckets: torch.Tensor) -> int:
        """Buckets needed for ``num_keys`` under the load bound; one doubling more if a bucket of
        the new keys (``new_buckets``) would overflow while the table may still grow."""
        nb = self._num_buckets
        while (
            nb < self._max_buckets and num_keys > self.max_load_factor * nb * self.bucket_capacity
        ):
            nb = min(2 * nb, self._max_buckets)
        if nb == self._num_buckets < self._max_buckets and new_buckets.numel():
            fill = self._bucket_count + count_ids(new_buckets, nb)
            if bool((fill > self.bucket_capacity).any()):
                nb = min(2 * nb, self._max_buckets)
        return nb

    def _insert_new(
        self,
        fp: torch.Tensor,
        bucket: torch.Tensor,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        values: torch.Tensor,
        scores: torch.Tensor,
        accumulators: torch.Tensor | None,
        pinned: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Insert distinct absent keys. Returns (rows or -1, evicted keys, evicted tids, refused)."""
        b, dev = self.bucket_capacity, self.device
        order = torch.sort(fp, stable=True).indices  # groups keys by bucket (monotone in fp)
        fp, bucket, keys = fp[order], bucket[order], keys[order]
        table_ids = None if table_ids is None else table_ids[order]
        values, scores = values[order], scores[order]
        accumulators = None if accumulators is None else accumulators[order]
        aff, per_bucket, group, rank = group_runs(bucket)
        used = self._bucket_count[aff]
        overflow = used + per_bucket > b
        rows = torch.full_like(keys, -1)

        fits = torch.nonzero(~overflow[group]).squeeze(1)
        if fits.numel():  # common case: the bucket has room, take its next free slots
            slot = bucket[fits] * b + used[group[fits]] + rank[fits]
            r = self._slot_row[slot]
            self._write_rows(
                r,
                keys[fits],
                None if table_ids is None else table_ids[fits],
                values[fits],
                scores[fits],
                None if accumulators is None else accumulators[fits],
            )
            self._slot_fp[slot] = fp[fits]
            rows[fits] = r
            ok = torch.nonzero(~overflow).squeeze(1)
            done = aff[ok]
            self._bucket_count[done] += per_bucket[ok]
            self._resort(done, int(self._bucket_count[done].max()))
            self._size += fits.numel()

        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        evicted_k, evicted_t, refused = empty, empty, 0
        full = torch.nonzero(overflow[group]).squeeze(1)
        if full.numel():
            evicted_k, evicted_t, refused = self._insert_overflow(
                full, fp, bucket, keys, table_ids, values, scores, accumulators, pinned, rows
            )
        out = torch.empty_like(rows)
        out[order] = rows
        return out, evicted_k, evicted_t, refused

    def _insert_overflow(
        self,
        idx: torch.Tensor,
        fp: torch.Tensor,
        bucket: torch.Tensor,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        values: torch.Tensor,
        scores: torch.Tensor,
        accumulators: torch.Tensor | None,
        pinned: torch.Tensor | None,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Buckets that cannot take all their new keys (positions ``idx`` of the fp-sorted new
        keys): keep the best entries per :mod:`shared.hashtable.buckets`; fills ``rows``."""
        b, dev = self.bucket_capacity, self.device
        # only the best b newcomers of a bucket (by score, then fp) can stay: drop the rest now
        o = idx[torch.sort(scores[idx], descending=True, stable=True).indices]
        o = o[torch.sort(bucket[o], stable=True).indices]
        ob, _, grp, rnk = group_runs(bucket[o])
        refused = int((rnk >= b).sum())
        cand = rnk < b
        o, grp, rnk = o[cand], grp[cand], rnk[cand]
        n_ref = torch.full((ob.numel(), int(rnk.max()) + 1), -1, dtype=torch.int64, device=dev)
        n_ref[grp, rnk] = o

        e_row = self._slot_row.view(-1, b)[ob]  # [n_o, b] stored entries, occupied first
        e_valid = torch.arange(b, device=dev) < self._bucket_count[ob][:, None]
        if self.score_strategy is ScoreStrategy.NO_EVICTION:
            e_pin = e_valid
        else:
            e_pin = torch.zeros_like(e_valid) if pinned is None else pinned[e_row]
        merge = merge_full_buckets(
            self._slot_fp.view(-1, b)[ob],
            e_row,
            e_valid,
            self._row_score[e_row],
            e_pin,
            n_ref,
            fp,
            scores,
            self._sentinel[ob],
        )
        evicted_k = self._row_key[merge.evicted_rows].clone()
        evicted_t = self._row_tid[merge.evicted_rows].to(torch.int64)
        self._free_rows(merge.evicted_rows)
        pos = merge.new_pos
        self._write_rows(
            merge.new_rows,
            keys[pos],
            None if table_ids is None else table_ids[pos],
            values[pos],
            scores[pos],
            None if accumulators is None else accumulators[pos],
        )
        rows[pos] = merge.new_rows
        self._slot_fp.view(-1, b)[ob] = merge.slot_fp
        self._slot_row.view(-1, b)[ob] = merge.slot_row
        self._size += int(merge.size.sum()) - int(self._bucket_count[ob].sum())
        self._bucket_count[ob] = merge.size
        refused += merge.refused
        self.evictions += merge.evicted_rows.numel()
        self.refusals += refused
        return evicted_k, evicted_t, refused

    # ------------------------------------------------------------------ growth / bulk build

    def _rebuild_from_rows(
        self, num_buckets: int, pinned: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rehash every stored entry into ``num_buckets`` buckets.

        Returns (old row → new row or -1, (keys, table ids) evicted on the way).
        """
        rows = torch.nonzero(self._row_key >= 0).squeeze(1)
        old_cap = self.capacity
        keys, tids = self._row_key[rows], self._row_tid[rows].to(torch.int64)
        new_of_entry = self._rebuild(
            num_buckets,
            keys,
            tids,
            self._values[rows],
            self._row_score[rows],
            None if self._accum is None else self._accum[rows],
            None if pinned is None else pinned[rows],
        )
        remap = torch.full((old_cap,), -1, dtype=torch.int64, device=self.device)
        remap[rows] = new_of_entry
        lost = new_of_entry < 0
        return remap, (keys[lost], tids[lost])

    def _rebuild(
        self,
        num_buckets: int,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        accumulators: torch.Tensor | None,
        pinned: torch.Tensor | None,
        *,
        may_exceed_max: bool = False,
    ) -> torch.Tensor:
        """Replace the table by ``num_buckets`` buckets holding the given distinct entries.

        Doubles the buckets while one would overflow (up to the max, or without bound when
        ``may_exceed_max``); at the max the lowest-score entries of overflowing buckets are
        evicted. Returns the new row of each entry (-1 if evicted). Rows equal slots afterwards.
        """
        b, dev = self.bucket_capacity, self.device
        nb = num_buckets
        while True:
            fp, bucket = self._fingerprint(keys, table_ids, nb)
            order = torch.sort(fp, stable=True).indices  # also groups by bucket (monotone)
            counts = count_sorted(bucket[order], nb)
            if int(counts.max()) <= b:
                break
            if nb >= self._max_buckets and not may_exceed_max:
                break
            nb = 2 * nb if may_exceed_max else min(2 * nb, self._max_buckets)
        if int(counts.max()) > b:  # at max capacity: evict the lowest scores of full buckets
            keep = keep_best(order, bucket, scores, pinned, b)
            self.evictions += int((~keep).sum())
            order = order[keep[order]]
        bs = bucket[order]
        counts = count_sorted(bs, nb)
        start = torch.cumsum(counts, 0) - counts
        slot = bs * b + torch.arange(order.numel(), device=dev) - start[bs]

        self._allocate(nb)
        self._slot_fp[slot] = fp[order]
        self._write_rows(
            slot,
            keys[order],
            table_ids[order],
            values[order],
            scores[order],
            None if accumulators is None else accumulators[order],
        )
        self._bucket_count = counts
        self._size = order.numel()
        self.generation += 1
        new_row = torch.full_like(keys, -1)
        new_row[order] = slot
        return new_row

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
    ) -> HashTable:
        """Bulk build from distinct ``keys`` [N] and ``values`` [N, dim] with one sort.

        Sized for ``max_load_factor``; buckets double until none overflows, so nothing is lost.
        ``max_capacity`` (default: the built capacity) bounds later growth.
        """
        device = torch.device(device)
        if device.type == "cuda" and cuda_kernels.available():
            from shared.hashtable.cuda.build import from_keys_values

            table = from_keys_values(
                cls,
                keys,
                values,
                bucket_capacity=bucket_capacity,
                device=device,
                scores=scores,
                table_ids=table_ids,
                accumulators=accumulators,
                max_load_factor=max_load_factor,
                max_capacity=max_capacity,
                score_strategy=score_strategy,
            )
            if table is not None:
                return table
        keys = check_keys(keys.to(device), "HashTable.from_keys_values")
        n = keys.numel()
        if values.dim() != 2 or values.shape[0] != n:
            raise ValueError(
                f"HashTable.from_keys_values: values must be [{n}, dim], got {tuple(values.shape)}"
            )
        tids = torch.zeros_like(keys) if table_ids is None else table_ids.to(device, torch.int64)
        _, starts, counts, _, _ = unique_pairs(keys, tids if table_ids is not None else None)
        if bool((counts > 1).any()):
            order = torch.sort(keys, stable=True).indices
            dup = int(keys[order][starts[counts > 1][0]])
            raise ValueError(
                f"HashTable.from_keys_values: key {dup} appears more than once; keys must be "
                "distinct (deduplicate them, e.g. keep the last value of each key)"
            )
        table = cls.sized_for(
            n,
            values.shape[1],
            bucket_capacity=bucket_capacity,
            max_load_factor=max_load_factor,
            max_capacity=max_capacity,
            score_strategy=score_strategy,
            with_accumulator=accumulators is not None,
            device=device,
        )
        table._rebuild(
            table.num_buckets,
            keys,
            tids,
            values.to(device, torch.float32),
            torch.zeros_like(keys) if scores is None else scores.to(device, torch.int64),
            None if accumulators is None else accumulators.to(device, torch.float32),
            None,
            may_exceed_max=True,
        )
        table._max_buckets = max(table._max_buckets, table.num_buckets)
        table.generation = 0
        return table
