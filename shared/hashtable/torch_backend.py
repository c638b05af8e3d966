"""The torch backend of a hash table: every operation in vectorized torch, on CPU and CUDA.

The reference implementation and the CPU path; the CUDA backend (``cuda/backend.py``) derives
from it and keeps these algorithms for what its kernels do not cover. They work on the arrays
of a :class:`~shared.hashtable.layout.TableLayout` (its docstring has the layout):

- find: the slot array is one sorted sequence, so a batch ``find`` is a single
  ``torch.searchsorted`` plus a comparison of the full (key, table id) pair (and of a neighbour
  slot, for the rare keys sharing a fingerprint); no per-key loop, no probing. This replaces
  dynamicemb's 1-byte digests (which speed up a linear probe inside a bucket in a CUDA kernel)
  by an 8-byte fingerprint per slot.
- insert: rows never move while the table keeps its size: an insert re-sorts only the occupied
  slots of the touched buckets (a ``[buckets, <= bucket_capacity]`` sort) and takes the free
  rows of those buckets; a growth (rehash into twice the buckets) rebuilds all rows and bumps
  ``generation``. Full buckets at max capacity keep their best entries
  (:mod:`shared.hashtable.buckets`).

Determinism: every step is a stable sort, a searchsorted, a cumsum or a scatter to distinct
indices, so the same sequence of calls gives the same table on CPU and CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from shared.features import ScoreStrategy
from shared.hashtable import hashing
from shared.hashtable.adagrad import AdagradConfig, adagrad_update
from shared.hashtable.buckets import group_runs, keep_best, merge_full_buckets
from shared.hashtable.hashing import (
    bucket_of,
    check_keys,
    count_ids,
    count_sorted,
    fingerprint,
    unique_pairs,
)
from shared.hashtable.initializers import KeyedInitializer, NewRows
from shared.hashtable.layout import EMPTY_KEY, InsertResult, SelectedInsert, TableLayout

L = TypeVar("L", bound=TableLayout)

INSERT = "HashTable.insert_or_assign"
ERASE = "HashTable.erase"
BUILD = "HashTable.from_keys_values"


class TorchRows:
    """New rows from a list of initializers: row i from ``inits[table_ids[i]]`` (table id 0
    without ``table_ids``), one initializer call per table present (see ``keyed_rows``)."""

    def __init__(self, inits: Sequence[KeyedInitializer | None], device: torch.device) -> None:
        self.inits = list(inits)
        self.device = torch.device(device)

    def __call__(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, dim: int
    ) -> torch.Tensor:
        """[n, dim] float32 rows of ``keys`` [n] (a table's initializer must not be None when
        one of its keys is asked for)."""
        n = keys.numel()
        if n == 0:
            return torch.empty(0, dim, device=self.device)
        if table_ids is None:  # table id 0 only
            init = self.inits[0]
            assert init is not None
            return init(keys, dim).to(self.device)
        # group the keys by table with one sort and read every group's size in one host sync
        # (a row is a function of its key alone, so grouping changes no bit)
        by_tid = torch.sort(table_ids, stable=True)
        ids = torch.arange(len(self.inits) + 1, dtype=by_tid.values.dtype, device=keys.device)
        bounds = torch.searchsorted(by_tid.values, ids).tolist()
        out = torch.empty(n, dim, device=self.device)
        for t, init in enumerate(self.inits):
            lo, hi = bounds[t], bounds[t + 1]
            if lo == hi:
                continue
            assert init is not None
            if hi - lo == n:  # every key is of this table
                return init(keys, dim).to(self.device)
            sel = by_tid.indices[lo:hi]
            out[sel] = init(keys[sel], dim)
        return out


class TorchBackend:
    """A hash table's operations in torch (see the module docstring); any device.

    Stateless: one instance serves every table, and copying a table shares it.
    """

    name = "torch"

    def __copy__(self) -> TorchBackend:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchBackend:
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def accepts(self, device: torch.device) -> bool:
        """Whether tables on ``device`` can use this backend (torch: every device)."""
        return True

    # ------------------------------------------------------------------ hashing, new rows

    def fingerprint(self, keys: torch.Tensor, table_ids: torch.Tensor | None) -> torch.Tensor:
        """:func:`shared.hashtable.hashing.fingerprint`: what every algorithm here hashes with."""
        return fingerprint(keys, table_ids)

    def unique_pairs(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, *, reject_negative: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`shared.hashtable.hashing.unique_pairs`."""
        return unique_pairs(keys, table_ids, reject_negative=reject_negative)

    def keyed_rows(self, inits: Sequence[KeyedInitializer | None], device: torch.device) -> NewRows:
        """The new-row function of table ids ``0 .. len(inits) - 1``, made once per list."""
        return TorchRows(inits, device)

    def expand_rows(
        self,
        values: torch.Tensor,
        rows: torch.Tensor,
        inverse: torch.Tensor,
        keys: torch.Tensor,
        which: torch.Tensor,
        new_rows: NewRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A lookup's rows per occurrence (``Backend.expand_rows``): the rows of every run
        [P, dim] (stored, else initial), then a gather by ``inverse``."""
        stored = rows >= 0
        out = values[rows.clamp(min=0)]  # [P, dim]
        out = torch.where(stored[:, None], out, new_rows(keys, which, values.shape[1]))
        return out.index_select(0, inverse), stored.index_select(0, inverse)

    # ------------------------------------------------------------------ sparse update

    def segment_sum_sorted(
        self,
        x: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        group: torch.Tensor,
        max_count: int | None = None,
    ) -> torch.Tensor:
        """:func:`shared.hashtable.hashing.segment_sum_sorted`: duplicate keys' gradients."""
        return hashing.segment_sum_sorted(x, starts, counts, group, max_count)

    def adagrad_update(
        self,
        values: torch.Tensor,
        accumulators: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        config: AdagradConfig,
    ) -> None:
        """:func:`shared.hashtable.adagrad.adagrad_update`, in place."""
        adagrad_update(values, accumulators, rows, grads, config)

    def apply_sparse_gradients(
        self,
        values: torch.Tensor,
        accumulators: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        order: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        group: torch.Tensor,
        max_count: int,
        config: AdagradConfig,
    ) -> None:
        """``Backend.apply_sparse_gradients``: the segment sum of ``grads[order]``, then
        Adagrad (rows of -1 skipped with one host read, as :func:`adagrad_update` does)."""
        g = hashing.segment_sum_sorted(grads[order], starts, counts, group, max_count)
        adagrad_update(values, accumulators, rows, g, config)

    # ------------------------------------------------------------------ operations

    def find(
        self, t: TableLayout, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [N] int64, -1 where missing; found [N] bool) of keys already checked by
        ``t._prepare`` (``HashTable.find``)."""
        fp = self.fingerprint(keys, table_ids)
        pos, found = self._locate(t, fp, keys, table_ids)
        rows = torch.where(found, t._slot_row[pos], torch.full_like(pos, -1))
        return rows, found

    def insert_or_assign(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        table_ids: torch.Tensor | None = None,
        accumulators: torch.Tensor | None = None,
        pinned_rows: torch.Tensor | None = None,
        exact: bool = True,
    ) -> InsertResult:
        """See ``HashTable.insert_or_assign`` (takes the caller's tensors unchecked; the result
        is exact also for ``exact=False``: a padded result without padding)."""
        keys, table_ids = t._prepare(keys, table_ids, INSERT)
        n = keys.numel()
        values = values.to(t.device, torch.float32).reshape(n, t.dim)
        scores = scores.to(t.device, torch.int64).reshape(n)
        if accumulators is not None:
            accumulators = accumulators.to(t.device, torch.float32).reshape(n, t.dim)
        empty = torch.zeros(0, dtype=torch.int64, device=t.device)
        if n == 0:
            none = torch.zeros(0, dtype=torch.bool, device=t.device)
            return InsertResult(empty, none, empty, empty, 0)

        order, starts, counts, inverse, _ = unique_pairs(keys, table_ids)
        last = order[starts + counts - 1]  # the last occurrence of each pair wins
        uk, us, uv = keys[last], scores[last], values[last]
        ut = None if table_ids is None else table_ids[last]
        ua = None if accumulators is None else accumulators[last]

        pinned = None
        if pinned_rows is not None:
            pinned = torch.zeros(t.capacity, dtype=torch.bool, device=t.device)
            pinned[pinned_rows.to(t.device)] = True
        evicted_k, evicted_t = [empty], [empty]
        fp, bucket, pos, found, pinned = self._grow_for(t, uk, ut, pinned, evicted_k, evicted_t)
        new = torch.nonzero(~found).squeeze(1)
        rows_u = torch.where(found, t._slot_row[pos], torch.full_like(pos, -1))
        hit = torch.nonzero(found).squeeze(1)
        if hit.numel():
            r = rows_u[hit]
            t._values[r] = uv[hit]
            t._row_score[r] = us[hit]
            if ua is not None and t._accum is not None:
                t._accum[r] = ua[hit]
        refused = 0
        if new.numel():
            new_rows, ek, et, refused = self._insert_new(
                t,
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

    def insert_selected(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        values: torch.Tensor,
        scores: torch.Tensor,
        mask: torch.Tensor,
        pinned: torch.Tensor | None,
    ) -> SelectedInsert | None:
        """None: no kernels (``static_insert.insert_absent`` merges with torch ops)."""
        return None

    def reserve_selected(self, t: TableLayout) -> None:
        """Nothing is kept between calls."""

    def erase(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None = None,
        *,
        count: bool = True,
    ) -> int | None:
        """See ``HashTable.erase`` (takes the caller's tensors unchecked; counts, and checks the
        keys, also for ``count=False``)."""
        keys, table_ids = t._prepare(keys, table_ids, ERASE)
        if keys.numel() == 0:
            return 0
        order, starts, _, _, _ = unique_pairs(keys, table_ids)
        first = order[starts]
        uk = keys[first]
        ut = None if table_ids is None else table_ids[first]
        fp, bucket = self._hash(t, uk, ut)
        pos, found = self._locate(t, fp, uk, ut)
        hit = torch.nonzero(found).squeeze(1)
        if hit.numel() == 0:
            return 0
        pos, bucket = pos[hit], bucket[hit]
        rows = t._slot_row[pos]
        self._free_rows(t, rows)
        t._slot_fp[pos] = t._sentinel[bucket]
        affected, per_bucket = torch.unique_consecutive(
            torch.sort(bucket).values, return_counts=True
        )
        width = int(t._bucket_count[affected].max())  # erased slots lie within this prefix
        t._bucket_count[affected] -= per_bucket
        self._resort(t, affected, width)
        t._size -= hit.numel()
        return hit.numel()

    def build(
        self,
        sized: Callable[[int, int, bool], L],
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        device: torch.device,
        scores: torch.Tensor | None = None,
        table_ids: torch.Tensor | None = None,
        accumulators: torch.Tensor | None = None,
    ) -> L:
        """``HashTable.from_keys_values``: the table ``sized(n, dim, with_accumulator)`` makes
        (empty, its capacity for ``n`` keys), filled with one sort of distinct ``keys``."""
        keys = check_keys(keys.to(device), BUILD)
        n = keys.numel()
        if values.dim() != 2 or values.shape[0] != n:
            raise ValueError(f"{BUILD}: values must be [{n}, dim], got {tuple(values.shape)}")
        tids = torch.zeros_like(keys) if table_ids is None else table_ids.to(device, torch.int64)
        _, starts, counts, _, _ = unique_pairs(keys, tids if table_ids is not None else None)
        if bool((counts > 1).any()):
            order = torch.sort(keys, stable=True).indices
            dup = int(keys[order][starts[counts > 1][0]])
            raise ValueError(
                f"{BUILD}: key {dup} appears more than once; keys must be "
                "distinct (deduplicate them, e.g. keep the last value of each key)"
            )
        table = sized(n, values.shape[1], accumulators is not None)
        self._rebuild(
            table,
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

    # ------------------------------------------------------------------ internals

    def _hash(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        num_buckets: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fingerprint, bucket) of each key for ``num_buckets`` (default: the current count)."""
        fp = self.fingerprint(keys, table_ids)
        return fp, bucket_of(fp, t._num_buckets if num_buckets is None else num_buckets)

    def _row_match(
        self, t: TableLayout, rows: torch.Tensor, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> torch.Tensor:
        match = t._row_key[rows] == keys
        if table_ids is None and not t._any_tid:
            return match  # every stored table id is 0
        tid = t._row_tid[rows]
        return match & (tid == 0 if table_ids is None else tid == table_ids)

    def _locate(
        self, t: TableLayout, fp: torch.Tensor, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot position and found mask of each key (one searchsorted, then collision runs)."""
        last = t.capacity - 1
        pos = torch.searchsorted(t._slot_fp, fp).clamp_(max=last)
        same_fp = t._slot_fp[pos] == fp
        found = same_fp & self._row_match(t, t._slot_row[pos], keys, table_ids)
        more = same_fp & ~found
        if not t._any_tid:
            # Only table id 0 is stored, and mix64 is a bijection: at most two stored keys (whose
            # mixes differ in the dropped lowest bit) share a fingerprint, in adjacent slots.
            # One more probe settles every key, with no host sync.
            nxt = (pos + 1).clamp_(max=last)
            hit = more & (t._slot_fp[nxt] == fp) & self._row_match(t, t._slot_row[nxt], keys, None)
            return torch.where(hit, nxt, pos), found | hit
        while bool(more.any()):  # equal fingerprints of different pairs: walk the run (rare)
            more &= pos < last
            pos = torch.where(more, pos + 1, pos)
            same_fp = more & (t._slot_fp[pos] == fp)
            hit = same_fp & self._row_match(t, t._slot_row[pos], keys, table_ids)
            found |= hit
            more = same_fp & ~hit
        return pos, found

    def _grow_for(
        self,
        t: TableLayout,
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
            fp, bucket = self._hash(t, keys, table_ids)
            pos, found = self._locate(t, fp, keys, table_ids)
            new = torch.nonzero(~found).squeeze(1)
            target = self._target_buckets(t, t._size + new.numel(), bucket[new])
            if target == t._num_buckets:
                return fp, bucket, pos, found, pinned
            remap, (ek, et) = self._rebuild_from_rows(t, target, pinned)
            evicted_keys.append(ek)
            evicted_tids.append(et)
            if pinned is not None:
                moved = remap[torch.nonzero(pinned).squeeze(1)]
                pinned = torch.zeros(t.capacity, dtype=torch.bool, device=t.device)
                pinned[moved[moved >= 0]] = True

    def _free_rows(self, t: TableLayout, rows: torch.Tensor) -> None:
        t._row_key[rows] = EMPTY_KEY
        t._row_tid[rows] = 0
        t._row_score[rows] = 0

    def _write_rows(
        self,
        t: TableLayout,
        rows: torch.Tensor,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        values: torch.Tensor,
        scores: torch.Tensor,
        accumulators: torch.Tensor | None,
    ) -> None:
        t._row_key[rows] = keys
        if table_ids is None:
            t._row_tid[rows] = 0
        else:
            t._row_tid[rows] = table_ids.to(torch.int32)
            t._any_tid = t._any_tid or bool((table_ids != 0).any())
        t._row_score[rows] = scores
        t._values[rows] = values
        if t._accum is not None:
            if accumulators is None:
                t._accum[rows] = t.initial_accumulator_value
            else:
                t._accum[rows] = accumulators

    def _resort(self, t: TableLayout, buckets: torch.Tensor, width: int) -> None:
        """Re-sort the first ``width`` slots of distinct ``buckets`` by fingerprint (empties go
        last); the slots past ``width`` must be empty already."""
        if buckets.numel() == 0 or width == 0:
            return
        b = t.bucket_capacity
        fp_view = t._slot_fp.view(-1, b)
        row_view = t._slot_row.view(-1, b)
        fps, idx = torch.sort(fp_view[buckets, :width], dim=1, stable=True)
        fp_view[buckets, :width] = fps
        row_view[buckets, :width] = row_view[buckets, :width].gather(1, idx)

    def _target_buckets(self, t: TableLayout, num_keys: int, new_buckets: torch.Tensor) -> int:
        """Buckets needed for ``num_keys`` under the load bound; one doubling more if a bucket of
        the new keys (``new_buckets``) would overflow while the table may still grow."""
        nb = t._num_buckets
        while nb < t._max_buckets and num_keys > t.max_load_factor * nb * t.bucket_capacity:
            nb = min(2 * nb, t._max_buckets)
        if nb == t._num_buckets < t._max_buckets and new_buckets.numel():
            fill = t._bucket_count + count_ids(new_buckets, nb)
            if bool((fill > t.bucket_capacity).any()):
                nb = min(2 * nb, t._max_buckets)
        return nb

    def _insert_new(
        self,
        t: TableLayout,
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
        b, dev = t.bucket_capacity, t.device
        order = torch.sort(fp, stable=True).indices  # groups keys by bucket (monotone in fp)
        fp, bucket, keys = fp[order], bucket[order], keys[order]
        table_ids = None if table_ids is None else table_ids[order]
        values, scores = values[order], scores[order]
        accumulators = None if accumulators is None else accumulators[order]
        aff, per_bucket, group, rank = group_runs(bucket)
        used = t._bucket_count[aff]
        overflow = used + per_bucket > b
        rows = torch.full_like(keys, -1)

        fits = torch.nonzero(~overflow[group]).squeeze(1)
        if fits.numel():  # common case: the bucket has room, take its next free slots
            slot = bucket[fits] * b + used[group[fits]] + rank[fits]
            r = t._slot_row[slot]
            self._write_rows(
                t,
                r,
                keys[fits],
                None if table_ids is None else table_ids[fits],
                values[fits],
                scores[fits],
                None if accumulators is None else accumulators[fits],
            )
            t._slot_fp[slot] = fp[fits]
            rows[fits] = r
            ok = torch.nonzero(~overflow).squeeze(1)
            done = aff[ok]
            t._bucket_count[done] += per_bucket[ok]
            self._resort(t, done, int(t._bucket_count[done].max()))
            t._size += fits.numel()

        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        evicted_k, evicted_t, refused = empty, empty, 0
        full = torch.nonzero(overflow[group]).squeeze(1)
        if full.numel():
            evicted_k, evicted_t, refused = self.insert_overflow(
                t, full, fp, bucket, keys, table_ids, values, scores, accumulators, pinned, rows
            )
        out = torch.empty_like(rows)
        out[order] = rows
        return out, evicted_k, evicted_t, refused

    def insert_overflow(
        self,
        t: TableLayout,
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
        b, dev = t.bucket_capacity, t.device
        # only the best b newcomers of a bucket (by score, then fp) can stay: drop the rest now
        o = idx[torch.sort(scores[idx], descending=True, stable=True).indices]
        o = o[torch.sort(bucket[o], stable=True).indices]
        ob, _, grp, rnk = group_runs(bucket[o])
        refused = int((rnk >= b).sum())
        cand = rnk < b
        o, grp, rnk = o[cand], grp[cand], rnk[cand]
        n_ref = torch.full((ob.numel(), int(rnk.max()) + 1), -1, dtype=torch.int64, device=dev)
        n_ref[grp, rnk] = o

        e_row = t._slot_row.view(-1, b)[ob]  # [n_o, b] stored entries, occupied first
        e_valid = torch.arange(b, device=dev) < t._bucket_count[ob][:, None]
        if t.score_strategy is ScoreStrategy.NO_EVICTION:
            e_pin = e_valid
        else:
            e_pin = torch.zeros_like(e_valid) if pinned is None else pinned[e_row]
        merge = merge_full_buckets(
            t._slot_fp.view(-1, b)[ob],
            e_row,
            e_valid,
            t._row_score[e_row],
            e_pin,
            n_ref,
            fp,
            scores,
            t._sentinel[ob],
        )
        evicted_k = t._row_key[merge.evicted_rows].clone()
        evicted_t = t._row_tid[merge.evicted_rows].to(torch.int64)
        self._free_rows(t, merge.evicted_rows)
        pos = merge.new_pos
        self._write_rows(
            t,
            merge.new_rows,
            keys[pos],
            None if table_ids is None else table_ids[pos],
            values[pos],
            scores[pos],
            None if accumulators is None else accumulators[pos],
        )
        rows[pos] = merge.new_rows
        t._slot_fp.view(-1, b)[ob] = merge.slot_fp
        t._slot_row.view(-1, b)[ob] = merge.slot_row
        t._size += int(merge.size.sum()) - int(t._bucket_count[ob].sum())
        t._bucket_count[ob] = merge.size
        refused += merge.refused
        t.evictions += merge.evicted_rows.numel()
        t.refusals += refused
        return evicted_k, evicted_t, refused

    def _rebuild_from_rows(
        self, t: TableLayout, num_buckets: int, pinned: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rehash every stored entry into ``num_buckets`` buckets.

        Returns (old row → new row or -1, (keys, table ids) evicted on the way).
        """
        rows = torch.nonzero(t._row_key >= 0).squeeze(1)
        old_cap = t.capacity
        keys, tids = t._row_key[rows], t._row_tid[rows].to(torch.int64)
        new_of_entry = self._rebuild(
            t,
            num_buckets,
            keys,
            tids,
            t._values[rows],
            t._row_score[rows],
            None if t._accum is None else t._accum[rows],
            None if pinned is None else pinned[rows],
        )
        remap = torch.full((old_cap,), -1, dtype=torch.int64, device=t.device)
        remap[rows] = new_of_entry
        lost = new_of_entry < 0
        return remap, (keys[lost], tids[lost])

    def _rebuild(
        self,
        t: TableLayout,
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
        b, dev = t.bucket_capacity, t.device
        nb = num_buckets
        while True:
            fp, bucket = self._hash(t, keys, table_ids, nb)
            order = torch.sort(fp, stable=True).indices  # also groups by bucket (monotone)
            counts = count_sorted(bucket[order], nb)
            if int(counts.max()) <= b:
                break
            if nb >= t._max_buckets and not may_exceed_max:
                break
            nb = 2 * nb if may_exceed_max else min(2 * nb, t._max_buckets)
        if int(counts.max()) > b:  # at max capacity: evict the lowest scores of full buckets
            keep = keep_best(order, bucket, scores, pinned, b)
            t.evictions += int((~keep).sum())
            order = order[keep[order]]
        bs = bucket[order]
        counts = count_sorted(bs, nb)
        start = torch.cumsum(counts, 0) - counts
        slot = bs * b + torch.arange(order.numel(), device=dev) - start[bs]

        t._allocate(nb)
        t._slot_fp[slot] = fp[order]
        self._write_rows(
            t,
            slot,
            keys[order],
            table_ids[order],
            values[order],
            scores[order],
            None if accumulators is None else accumulators[order],
        )
        t._bucket_count = counts
        t._size = order.numel()
        t.generation += 1
        new_row = torch.full_like(keys, -1)
        new_row[order] = slot
        return new_row
