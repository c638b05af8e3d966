"""Insert and erase on a table at its max capacity with static shapes and no host read: the
table operations of a captured training step (:mod:`shared.hashtable.static_step`).

Every tensor here has a size known before the call (the batch's padded key count, the table's
buckets), every count stays on the device, and a key takes part or not by a mask, so a CUDA
graph can replay the call on the next batch of the same padded size.

:func:`insert_absent` first keeps each bucket's best ``bucket_capacity`` newcomers (one sort of
the batch's keys), then hands them to the table's backend (``Backend.insert_selected``): on CUDA
the eager path's kernels with a mask and device-side counts
(:func:`shared.hashtable.cuda.insert.insert_selected`: work on the touched buckets only);
elsewhere, and where the kernels cannot take the call, the torch merge of this module, which
works on every bucket of the table (a few sorts of ``[buckets, 2 * bucket_capacity]`` a call:
on the H200 4-6 ms a step for the seed tables, ``bench/results/bench_static_step*.json``).

The content is the backends' (``insert_or_assign`` of absent keys at max capacity, ``erase``):
the same keys stay, leave or are refused (the ranking of :mod:`shared.hashtable.buckets`, here
in one sort: :func:`~shared.hashtable.buckets.rank_buckets_packed`), with the same values, scores
and accumulators. Only which free row a new key takes may differ, which no result shows. The
table's size, evictions and refusals go to a device tensor (:class:`DeviceCounts`) that the
table reads when one of them is next read (``TableLayout._defer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from shared.features import ScoreStrategy
from shared.hashtable.backend import Backend
from shared.hashtable.buckets import rank_buckets_packed
from shared.hashtable.hashing import bucket_of
from shared.hashtable.layout import EMPTY_KEY, Counts, TableLayout

if TYPE_CHECKING:
    from shared.hashtable.table import HashTable


def put_where(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """``dst[idx[i]] = src[i]`` for every ``i`` where ``mask[i]`` (distinct ``idx`` there), with
    static shapes and no host read.

    The other entries write the first selected entry's value to its index again (with none
    selected, ``dst``'s own value at ``clamp(idx[0])``), so every duplicate index receives one
    value and the result does not depend on the order of the writes.
    """
    first = torch.argmax(mask.to(torch.uint8)).reshape(1)  # the first True (0 if none)
    at = idx.clamp(0, dst.shape[0] - 1)
    at_first = at.index_select(0, first)  # [1]
    picked = mask.index_select(0, first)  # [1] bool
    own = dst.index_select(0, at_first)  # [1, ...]
    fill = torch.where(_expand(picked, own), src.index_select(0, first), own)
    value = torch.where(_expand(mask, src), src, fill)
    dst.index_copy_(0, torch.where(mask, at, at_first), value)


def free_rows(t: TableLayout, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """The rows ``rows[i]`` where ``mask[i]`` become free (key -1, table id 0, score 0): the
    torch backend's ``_free_rows`` by mask."""
    for arr, value in ((t._row_key, EMPTY_KEY), (t._row_tid, 0), (t._row_score, 0)):
        put_where(arr, rows, torch.full_like(rows, value, dtype=arr.dtype), mask)


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` [n] viewed to broadcast over ``like`` [n, ...]."""
    return mask.view(-1, *([1] * (like.dim() - 1)))


class DeviceCounts:
    """A table's size, eviction and refusal changes from static calls, summed on the device
    (``counts`` [3] int64) and handed to the table when it next reads one of them: one host read
    for any number of calls (registered with ``TableLayout._defer`` once per read)."""

    def __init__(self, table: TableLayout) -> None:
        self.table = table
        self.counts = torch.zeros(3, dtype=torch.int64, device=table.device)
        self._registered = False

    def add(self, size: torch.Tensor, evictions: torch.Tensor, refusals: torch.Tensor) -> None:
        self.counts.add_(torch.stack([size, evictions, refusals]))
        self.register()

    def register(self) -> None:
        """Have the table read the counts at its next read (host state only: a captured call
        adds on the device at every replay, while this runs once per capture, so the caller
        registers again after each replay)."""
        if not self._registered:
            self._registered = True
            self.table._defer(self._drain)

    def _drain(self) -> Counts:
        self._registered = False
        size, evictions, refusals = self.counts.tolist()  # the one host read
        self.counts.zero_()
        return Counts(size, evictions, refusals)


def count_per_table(table_ids: torch.Tensor, n_tables: int) -> torch.Tensor:
    """[n_tables] int64: how often each of ``0 .. n_tables - 1`` occurs in ``table_ids`` (others
    count nowhere). A one-hot sum, not an ``index_add_``: thousands of atomic adds to a handful
    of counters serialize on the GPU (1.6 ms a step on the H200)."""
    return (table_ids[:, None] == torch.arange(n_tables, device=table_ids.device)).sum(0)


def sum_per_table(sorted_ids: torch.Tensor, values: torch.Tensor, n_tables: int) -> torch.Tensor:
    """[n_tables, k] int64: the sums of ``values`` [n, k] by non-decreasing ``sorted_ids`` [n]
    (ids past ``n_tables - 1`` count nowhere): one cumsum read at each table's bounds.

    The cumsum is 1-D, over the columns laid end to end (column j's bounds offset by ``j * n``;
    a difference within one column is that column's sum): a scan along a dimension of only k
    rows or columns parallelizes over those few (on the H200: 12 ms for dim 0 of [655K, 2],
    ``bench_train_full_s10_scan_regression_h200.json``; ~0.2 ms for dim 1 of [2, 655K],
    ``bench_train_full_s11_kernel_insert_h200.json``)."""
    dev = sorted_ids.device
    n, k = values.shape
    flat = values.t().reshape(-1)  # [k * n]: column 0, then column 1, ...
    total = torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])
    bounds = torch.searchsorted(sorted_ids, torch.arange(n_tables + 1, device=dev))
    at = bounds[None, :] + n * torch.arange(k, device=dev)[:, None]  # [k, n_tables + 1]
    sums = total[at]
    return (sums[:, 1:] - sums[:, :-1]).t()


@dataclass
class StaticInsert:
    """What :func:`insert_absent` did, per input key (all of static size)."""

    rows: torch.Tensor  # [M] int64: the key's row, -1 if it is not stored (or not selected)
    inserted: torch.Tensor  # [M] bool: selected and now stored
    evicted_table_ids: torch.Tensor  # [buckets * 2b] int64: each evicted entry's table id, else -1
    bad_score: torch.Tensor  # [] bool: a score outside [0, 2**60) (the ranking is then not exact)


def hash_keys(
    backend: Backend, keys: torch.Tensor, table_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fingerprints, the order that sorts them): what :func:`insert_absent` needs of its keys,
    for several tables at once (a table's buckets are fingerprint ranges, whatever its size)."""
    fp = backend.fingerprint(keys, table_ids)
    return fp, torch.sort(fp, stable=True).indices


class _Newcomers(NamedTuple):
    """The newcomers a bucket can take (:func:`_best_newcomers`)."""

    take: torch.Tensor  # [M] bool: selected and among its bucket's best ``b`` newcomers
    bucket: torch.Tensor  # [M] int64: each key's bucket
    refused: torch.Tensor  # [] int64: the selected keys beyond their bucket's best ``b``
    bad_score: torch.Tensor  # [] bool: a selected score outside [0, 2**60)


def _best_newcomers(
    fp: torch.Tensor,
    by_fp: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    nb: int,
    b: int,
    equal_scores: bool,
) -> _Newcomers:
    """Each bucket's best ``b`` selected keys by score (descending), then fingerprint: one
    stable sort of (bucket, score) packed, the unselected keys past the last bucket. The
    others cannot stay (a bucket keeps ``b`` entries): refused before any merge, as the
    backends' pre-step refuses them."""
    m, dev = fp.numel(), fp.device
    bucket = bucket_of(fp, nb)
    shift = 63 - nb.bit_length()
    limit = 1 << shift
    rank_score = torch.zeros_like(scores) if equal_scores else scores
    bad_score = (mask & ((rank_score < 0) | (rank_score >= limit))).any()
    packed = (torch.where(mask, bucket, nb) << shift) | (limit - 1 - rank_score.clamp(0, limit - 1))
    order = by_fp[torch.sort(packed[by_fp], stable=True).indices]
    sorted_bucket = torch.where(mask, bucket, nb)[order]
    first = torch.searchsorted(sorted_bucket, torch.arange(nb + 1, device=dev))
    rank = torch.arange(m, device=dev) - first[sorted_bucket]
    live = sorted_bucket < nb
    refused = (live & (rank >= b)).sum()
    take = torch.zeros(m, dtype=torch.bool, device=dev).index_copy_(0, order, live & (rank < b))
    return _Newcomers(take, bucket, refused, bad_score)


def _newcomer_grid(
    take: torch.Tensor, bucket: torch.Tensor, by_fp: torch.Tensor, nb: int, b: int
) -> torch.Tensor:
    """[nb * b + 1] int64: the key positions of each bucket's taken keys in fingerprint order,
    -1 padding, then a sink cell (the newcomer columns of :func:`rank_buckets_packed`)."""
    dev = take.device
    take_fp, bucket_fp = take[by_fp], bucket[by_fp]  # bucket_fp is non-decreasing
    seen = torch.cumsum(take_fp, 0)
    start = torch.searchsorted(bucket_fp, torch.arange(nb, device=dev))
    before = torch.where(start > 0, seen[(start - 1).clamp(min=0)], 0)  # taken in lower buckets
    col = seen - 1 - before[bucket_fp]
    grid = torch.full((nb * b + 1,), -1, dtype=torch.int64, device=dev)  # the last cell: a sink
    grid.index_copy_(0, torch.where(take_fp, bucket_fp * b + col, nb * b),
                     torch.where(take_fp, by_fp, -1))  # fmt: skip
    return grid


def _on_kernels(
    t: HashTable,
    batch: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
    best: _Newcomers,
    pinned: torch.Tensor | None,
    counts: DeviceCounts,
) -> StaticInsert | None:
    """:func:`insert_absent` of the taken newcomers on the backend's kernels (``batch``: keys,
    table ids, values, scores), or None where it has none for the call (nothing changed)."""
    keys, table_ids, values, scores = batch
    done = t.backend.insert_selected(t, keys, table_ids, values, scores, best.take, pinned)
    if done is None:
        return None
    size, evictions, refusals = done.counts.unbind()
    counts.add(size, evictions, best.refused + refusals)
    bad = best.bad_score | done.failed
    return StaticInsert(done.rows, done.inserted, done.evicted_table_ids, bad)


def insert_absent(
    t: HashTable,
    keys: torch.Tensor,
    table_ids: torch.Tensor | None,
    hashed: tuple[torch.Tensor, torch.Tensor],
    values: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    pinned: torch.Tensor | None,
    counts: DeviceCounts,
    *,
    equal_scores: bool = False,
) -> StaticInsert:
    """Insert the keys ``keys[i]`` where ``mask[i]`` (distinct, absent from ``t``, non-negative;
    ``hashed``: their :func:`hash_keys`) with ``values`` [M, dim], ``scores`` [M] (in
    ``[0, 2**60)``) and fresh accumulators into ``t``, which must be at its max capacity (nothing
    grows here). ``pinned`` [capacity] bool: rows never evicted (the batch's stored keys).
    ``equal_scores``: every selected key has the same score (STEP, TIMESTAMP), so none ranks
    above another. Full buckets keep their best entries by the ranking of
    :mod:`shared.hashtable.buckets`; the size, evictions and refusals go to ``counts``. Each
    bucket's best ``bucket_capacity`` newcomers go to the backend's kernels
    (``Backend.insert_selected``) or, where it has none for the call, to the torch merge."""
    assert t.num_buckets == t._max_buckets, "insert_absent needs a table at its max capacity"
    b, nb, m, dev = t.bucket_capacity, t.num_buckets, keys.numel(), t.device
    fp, by_fp = hashed
    best = _best_newcomers(fp, by_fp, scores, mask, nb, b, equal_scores)
    on_kernels = _on_kernels(t, (keys, table_ids, values, scores), best, pinned, counts)
    if on_kernels is not None:
        return on_kernels
    grid = _newcomer_grid(best.take, best.bucket, by_fp, nb, b)
    refused_early, bad_score = best.refused, best.bad_score
    e_row = t._slot_row.view(nb, b)
    e_valid = torch.arange(b, device=dev) < t._bucket_count[:, None]
    if t.score_strategy is ScoreStrategy.NO_EVICTION:
        e_pin = e_valid
    else:
        e_pin = torch.zeros_like(e_valid) if pinned is None else pinned[e_row]
    ranked, bad_rank = rank_buckets_packed(
        t._slot_fp.view(nb, b),
        e_row,
        e_valid,
        t._row_score[e_row],
        e_pin,
        grid[: nb * b].view(nb, b),
        fp,
        scores,
        t._sentinel,
    )
    # each newcomer's row: kept ones take their assigned row, the others -1 (a sink at m)
    kept, ref = ranked.kept_new.flatten(), ranked.ref.flatten()
    rows = torch.full((m + 1,), -1, dtype=torch.int64, device=dev)
    rows.index_copy_(0, torch.where(kept, ref, m), torch.where(kept, ranked.assigned.flatten(), -1))
    rows = rows[:m]
    inserted = rows >= 0
    evicted = ranked.evicted.flatten()
    ev_rows = ref.clamp(max=t.capacity - 1)  # a stored candidate's ref is its row
    evicted_tids = torch.where(evicted, t._row_tid[ev_rows].to(torch.int64), -1)
    size_before = t._bucket_count.sum()
    # the evicted rows are freed first: a newcomer may take one of them
    free_rows(t, ev_rows, evicted)
    put_where(t._row_key, rows, keys, inserted)
    tids = torch.zeros_like(keys) if table_ids is None else table_ids
    put_where(t._row_tid, rows, tids.to(torch.int32), inserted)
    put_where(t._row_score, rows, scores, inserted)
    if t.dim:
        put_where(t._values, rows, values, inserted)
    if t._accum is not None:
        put_where(t._accum, rows, torch.full_like(values, t.initial_accumulator_value), inserted)
    t._slot_fp.copy_(ranked.slot_fp.flatten())
    t._slot_row.copy_(ranked.slot_row.flatten())
    t._bucket_count.copy_(ranked.size)
    if table_ids is not None:
        t._any_tid = True  # a superset of the exact rule (a non-zero id stored): always safe
    counts.add(
        ranked.size.sum() - size_before,
        evicted.sum(),
        refused_early + ranked.refused.sum(),
    )
    return StaticInsert(rows, inserted, evicted_tids, bad_score | bad_rank)


def erase_rows(
    t: TableLayout, rows: torch.Tensor, mask: torch.Tensor, counts: DeviceCounts
) -> None:
    """Erase the entries of the rows ``rows[i]`` where ``mask[i]`` (distinct stored rows): their
    slots take the bucket's sentinel and move behind the bucket's other entries, keeping both
    groups' order (what the backends' stable re-sort of an erase leaves)."""
    b, nb, cap, dev = t.bucket_capacity, t.num_buckets, t.capacity, t.device
    slot_of_row = torch.empty_like(t._slot_row)
    slot_of_row.index_copy_(0, t._slot_row, torch.arange(cap, device=dev))
    slots = slot_of_row[rows.clamp(0, cap - 1)]
    erased = torch.zeros(cap + 1, dtype=torch.bool, device=dev)  # the last one: a sink
    erased.index_copy_(0, torch.where(mask, slots, cap), mask)
    erased = erased[:cap].view(nb, b)
    free_rows(t, rows, mask)
    empty = erased | (torch.arange(b, device=dev) >= t._bucket_count[:, None])
    stays = ~empty
    n_stay = stays.sum(1, keepdim=True)
    to = torch.where(stays, torch.cumsum(stays, 1) - 1, n_stay + torch.cumsum(empty, 1) - 1)
    fp = torch.where(empty, t._sentinel[:, None], t._slot_fp.view(nb, b))
    t._slot_fp.copy_(torch.empty_like(fp).scatter_(1, to, fp).flatten())
    slot_row = t._slot_row.view(nb, b)
    t._slot_row.copy_(torch.empty_like(slot_row).scatter_(1, to, slot_row).flatten())
    gone = erased.sum(1)
    t._bucket_count.sub_(gone)
    zero = gone.new_zeros(())
    counts.add(-gone.sum(), zero, zero)
