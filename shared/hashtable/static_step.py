"""A storage's training lookup and sparse Adagrad with static shapes, replayed from CUDA graphs.

The eager training lookup of :class:`~shared.hashtable.storage.FusedStorage` issues about 150
ops a step from Python and reads the device 4 times, because the number of distinct keys, of
hits, of admitted keys and of misses decide the next op's size. On the H200 that host work is
the seed config's step (issue #18: 11 ms against 3.8 ms for the all-``num_buckets`` config, the
GPU 33 % busy). Here the same step is written with sizes known before it runs:

- the batch's keys are padded to a bucketed size ``P`` (:func:`padded_size`, 8 sizes an octave);
  padding (and any negative key, which is refused and raised at the next read of the stats or
  within 128 lookups) sorts last as the pair (table id ``T``, ``INT64_MAX``) and takes no part;
- the unique of (table id, key) keeps ``P`` runs, the real ones first; hits, admissions,
  inserts, evictions and misses are masks over them, and counts stay on the device;
- inserts and the admission counter's erase run on every bucket
  (:mod:`shared.hashtable.static_insert`), which needs the table at its max capacity: until it
  is there (growth decides sizes on the host) the eager lookup runs;
- the storage's payload tier (:class:`~shared.hashtable.payload.RowPayload`, chosen once when
  the storage was made) says where each row's values are: HBM_ONLY's rows themselves (no op),
  or a CACHING storage's cache lines, resolved with fixed shapes and no host read
  (:meth:`~shared.hashtable.row_cache_static.StaticCacheLines.static_resolve`: misses read
  from the host tier, victims written back, new keys' rows made in their lines, and a step's
  rows past the lines bypassed through staging slots written back by the backward);
- backward sums the gradients in ``ceil(log2 P)`` rounds (the eager tree's, with rounds to
  spare) and updates the rows' values in place (on a cache, the lines, then marked dirty).

On CUDA each padded size gets two graphs (forward, backward; one memory pool for all), captured
at its first step and replayed after: a step costs a few copies into the graphs' inputs and two
replays. A graph reads the table's arrays where they were at capture: if they move (the table
is rebuilt), the graphs are dropped and captured again. On CPU the same code runs eagerly (the
tests compare it with the eager lookup there).

The results are the eager lookup's: the same rows for every key, the same table content after
the step (keys, values, scores, accumulators, admission counts) and the same stats; only which
free row a new key takes may differ. A lookup's backward must come before the next training
lookup of its padded size (its buffers are the size's) and before any change of the table; a
backward that comes later is refused. On the H200 the seed config's warm training step took
8.1 ms with this step against 11.1 ms eager (2026-12-02, ``bench_train_full_s10_h200.json``), and
4.4 ms (3.4 ms of kernels) after the full-bucket merge's fast path, the one-pass rows and the
one-call backward (2026-12-04, ``bench_train_full_s14*_h200.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shared.cuda_capture import GraphPool, capture, capture_streams, graph_pool
from shared.features import ScoreStrategy
from shared.hashtable.hashing import INT64_MAX, sort_pairs
from shared.hashtable.static_insert import (
    DeviceCounts,
    StaticInsert,
    count_per_table,
    erase_rows,
    hash_keys,
    insert_absent,
    put_where,
    sum_per_table,
)
from shared.hashtable.storage import (
    _ADMITTED,
    _EVICTIONS,
    _MISSES,
    _REFUSALS,
    _REJECTIONS,
    FusedStorage,
    Plan,
)
from shared.hashtable.table import HashTable

logger = logging.getLogger(__name__)

CHECK_EVERY = 64  # lookups between looks at the error flags (a copy read a round later: no wait)
STEPS_PER_OCTAVE = 8  # padded sizes between two powers of two (as the dense graphs' T buckets)


def padded_size(n: int) -> int:
    """The bucketed size ``n`` keys are padded to: ``n`` rounded up to a multiple of
    ``2 ** (floor(log2 n) - 3)`` (at most 1/8 more; 8 sizes an octave)."""
    if n <= 2 * STEPS_PER_OCTAVE:
        return 2 * STEPS_PER_OCTAVE
    q = 1 << max(0, n.bit_length() - 1 - int(math.log2(STEPS_PER_OCTAVE)))
    return -(-n // q) * q


def supports(storage: FusedStorage) -> str | None:
    """Why ``storage``'s training lookup cannot take the static path now (None: it can)."""
    t = storage.table
    if t.num_buckets != t._max_buckets:
        return "the table may still grow"
    if storage.adagrad.eps <= 0:
        return "Adagrad eps is 0 (a masked row's zero update would divide 0 by 0)"
    if storage.dim == 0:
        return "the table has no values"
    return storage.payload.why_not_static()


@dataclass
class StaticPlan:
    """A static lookup's tensors (all of the padded size ``P``), what backward needs."""

    n: int  # real keys (the first n occurrences)
    keys: torch.Tensor  # [P] distinct keys, the real runs first
    table_ids: torch.Tensor  # [P]
    rows: torch.Tensor  # [P] row per distinct key, -1: no row (or not a real run)
    slots: torch.Tensor  # [P] where each row's payload is (RowPayload.static_resolve), or -1
    order: torch.Tensor  # [P] occurrences sorted by (table id, key)
    starts: torch.Tensor  # [P] clamped to P - 1 past the last run
    counts: torch.Tensor  # [P] 0 past the last run
    group: torch.Tensor  # [P]
    rows_out: torch.Tensor  # [P, dim] each occurrence's row of values
    stored_out: torch.Tensor  # [P] bool: the occurrence's key has a row
    errors: torch.Tensor  # [2] bool: a real key was negative (refused), a score out of range
    serial: int = 0  # which forward of its padded size this is (its buffers are the size's)
    mutations: int = 0  # FusedStorage.mutations after it: its rows are valid while unchanged
    payload_version: int = 0  # RowPayload.static_version after it: its slots valid while equal

    def expanded(self) -> torch.Tensor:
        return self.rows_out[: self.n]

    def stored(self) -> torch.Tensor:
        return self.stored_out[: self.n]


class Runs(NamedTuple):
    """:func:`unique_runs`' result: hashing.unique_pairs' tensors at a static size ``P``."""

    valid: torch.Tensor  # [P] bool: run i is a real (table id, key) pair
    keys: torch.Tensor  # [P] the run's key (INT64_MAX past the real runs)
    table_ids: torch.Tensor  # [P] its table id (T past the real runs): non-decreasing
    order: torch.Tensor  # [P] occurrences sorted by (table id, key), padding last
    starts: torch.Tensor  # [P] each run's first position in ``order`` (clamped to P - 1)
    counts: torch.Tensor  # [P] its occurrences (0 past the real runs)
    group: torch.Tensor  # [P] the run of each sorted position
    inverse: torch.Tensor  # [P] the run of each occurrence
    negative: torch.Tensor  # [] bool: a real key was negative (it took no run)


def unique_runs(
    keys: torch.Tensor, tids: torch.Tensor, n_real: torch.Tensor, n_tables: int
) -> Runs:
    """The distinct (table id, key) pairs of the first ``n_real`` of ``keys`` [P] (table ids
    ``tids``), by the stable sorts of hashing.unique_pairs, with no host read: padding and
    negative keys become the pair (``n_tables``, INT64_MAX), which sorts after every real one."""
    p, dev = keys.numel(), keys.device
    span = torch.arange(p, device=dev)
    real = span < n_real
    good = real & (keys >= 0)
    k = torch.where(good, keys, INT64_MAX)
    tid = torch.where(good, tids, n_tables)
    order, group, _ = sort_pairs(k, tid)
    starts = torch.searchsorted(group, span)
    counts = torch.searchsorted(group, span, right=True) - starts
    inverse = torch.empty_like(order).index_copy_(0, order, group)
    n_good = good.sum()
    last = group.index_select(0, (n_good - 1).clamp(min=0).reshape(1))
    valid = span < torch.where(n_good > 0, last + 1, 0)
    starts = starts.clamp(max=p - 1)
    first = order[starts]
    return Runs(
        valid=valid,
        keys=k[first],
        table_ids=tid[first],
        order=order,
        starts=starts,
        counts=torch.where(valid, counts, 0),
        group=group,
        inverse=inverse,
        negative=(real & (keys < 0)).any(),
    )


def train_lookup(
    storage: FusedStorage,
    keys: torch.Tensor,
    tids: torch.Tensor,
    n_real: torch.Tensor,
    score_now: torch.Tensor,
    counts: tuple[DeviceCounts, DeviceCounts | None],
    mark: Callable[[str], None] = lambda section: None,
) -> StaticPlan:
    """The training lookup of ``keys`` [P] (table ids ``tids`` [P]; the first ``n_real`` real)
    with no host read: FusedStorage.lookup's train path (see the module docstring).
    ``score_now`` [] int64: the STEP/TIMESTAMP score; ``counts``: the table's and the
    counter's :class:`DeviceCounts`; ``mark(section)`` is called at the end of each section
    (``bench.bench_static_step`` times them)."""
    st, t = storage, storage.table
    n_tables, dev = len(st.specs), keys.device
    runs = unique_runs(keys, tids, n_real, n_tables)
    mark("unique")
    valid, uk, ut, cnt = runs.valid, runs.keys, runs.table_ids, runs.counts
    ut_safe = torch.where(valid, ut, 0)  # a table id every table array has
    tids_arg = st._tids(ut)
    # 2. find, and the scores of the hits
    rows, found = _find(st, uk, tids_arg, valid, cnt, score_now)
    new = valid & ~found
    mark("find")
    # 3. admission: the counter's totals decide; its hits get them, its new keys are inserted
    totals, admitted = cnt, new
    not_admitted = torch.zeros_like(new)
    bad_score = torch.zeros((), dtype=torch.bool, device=dev)
    hashed = hash_keys(t.backend, uk, tids_arg)  # the table's and the counter's
    counter_counts = counts[1]
    if st.counter is not None:
        assert counter_counts is not None
        totals, admitted, not_admitted, counted, c_erase_rows, bad_score = _count(
            st, uk, tids_arg, hashed, ut_safe, cnt, new, counter_counts
        )
    mark("counter")
    # 4. the admitted keys into the table (the batch's stored keys pinned)
    init = st._init_rows(uk, ut_safe, st.dim)  # [P, dim]
    result = _insert(st, runs, tids_arg, hashed, init, rows, found, totals, admitted, score_now,
                     counts[0])  # fmt: skip
    rows = torch.where(admitted, result.rows, rows)
    mark("insert")
    # where each row's payload is: the rows themselves (HBM_ONLY: no op), or cache lines
    slots = st.payload.static_resolve(rows, found, init)
    mark("resolve")
    if st.counter is not None:
        assert counter_counts is not None
        done = result.inserted & counted & (c_erase_rows >= 0)  # now stored: forget them
        erase_rows(st.counter.table, c_erase_rows, done, counter_counts)
    mark("erase")
    # 5. values: stored rows, else the admission value (waiting) or a fresh init (refused)
    rows_out, stored_out = _values(st, runs, ut_safe, rows, slots, not_admitted)
    plan = StaticPlan(
        n=0,  # set by the caller (a host value: a replay serves any n of its size)
        keys=uk,
        table_ids=ut,
        rows=rows,
        slots=slots,
        order=runs.order,
        starts=runs.starts,
        counts=cnt,
        group=runs.group,
        rows_out=rows_out,
        stored_out=stored_out,
        errors=torch.stack([runs.negative, bad_score | result.bad_score]),
    )
    mark("values")
    return plan


def _insert(
    st: FusedStorage,
    runs: Runs,
    tids_arg: torch.Tensor | None,
    hashed: tuple[torch.Tensor, torch.Tensor],
    init: torch.Tensor,
    rows: torch.Tensor,
    found: torch.Tensor,
    totals: torch.Tensor,
    admitted: torch.Tensor,
    score_now: torch.Tensor,
    table_counts: DeviceCounts,
) -> StaticInsert:
    """Step 4 of :func:`train_lookup`: the admitted keys into the table, the batch's stored keys
    (``rows`` where ``found``) pinned; the storage's eviction, refusal and admission counts."""
    t, n_tables = st.table, len(st.specs)
    lfu = st.strategy is ScoreStrategy.LFU
    result = insert_absent(
        t,
        runs.keys,
        tids_arg,
        hashed,
        init.narrow(1, 0, t.dim),  # a view: the index of a CACHING storage keeps no values
        totals if lfu else score_now.expand(runs.keys.numel()),
        admitted,
        _row_mask(t.capacity, rows, found),
        table_counts,
        equal_scores=not lfu,
    )
    st._counts[:, _EVICTIONS] += count_per_table(result.evicted_table_ids, n_tables)
    both = st._one_hot[result.inserted.to(torch.int64)] * admitted[:, None]  # (refused, admitted)
    ut = runs.table_ids  # sorted
    st._counts[:, _REFUSALS : _ADMITTED + 1] += sum_per_table(ut, both, n_tables)
    return result


def _values(
    st: FusedStorage,
    runs: Runs,
    ut_safe: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    not_admitted: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, dim], [P] bool) per occurrence: its run's row of values (at its payload slot), or
    for a run without one
    its admission value (not admitted yet) or a fresh initial row (refused), and whether the
    run has a row; counts the rejections and misses per run. One pass of the backend's
    ``expand_rows``: on CUDA initial rows only for occurrences without a row."""
    uk, ut, valid, cnt = runs.keys, runs.table_ids, runs.valid, runs.counts
    n_tables = len(st.specs)
    stored = rows >= 0
    which = torch.where(valid, ut_safe + n_tables * not_admitted, 0)  # index into train_init
    looked = torch.stack([not_admitted, valid & ~stored], 1) * cnt[:, None]
    st._counts[:, _REJECTIONS : _MISSES + 1] += sum_per_table(ut, looked, n_tables)
    values = st.payload.static_arrays()[0]
    return st.backend.expand_rows(values, slots, runs.inverse, uk, which, st._train_rows)


def _find(
    st: FusedStorage,
    uk: torch.Tensor,
    tids_arg: torch.Tensor | None,
    valid: torch.Tensor,
    cnt: torch.Tensor,
    score_now: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, found) of the runs in the table, -1 and False past the real ones; the found
    rows' scores updated (LFU: + the batch's count; else the step's score)."""
    t = st.table
    rows, found = t.backend.find(t, uk, tids_arg)
    found &= valid
    rows = torch.where(found, rows, -1)
    if st.strategy is ScoreStrategy.LFU:
        put_where(t._row_score, rows, t._row_score[rows.clamp(min=0)] + cnt, found)
    else:
        put_where(t._row_score, rows, score_now.expand(uk.numel()), found)
    return rows, found


def _count(
    st: FusedStorage,
    uk: torch.Tensor,
    tids_arg: torch.Tensor | None,
    hashed: tuple[torch.Tensor, torch.Tensor],
    ut_safe: torch.Tensor,
    cnt: torch.Tensor,
    new: torch.Tensor,
    counter_counts: DeviceCounts,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FusedStorage._count and FrequencyCounter.remember as masks: (totals, admitted,
    not_admitted, counted: new keys of a table with admission, each key's counter row after
    the step (-1: none), a counter score out of range)."""
    assert st.counter is not None
    c = st.counter.table
    counted = new if st.all_admission else new & st.has_admission[ut_safe]
    c_rows, c_found = c.backend.find(c, uk, tids_arg)
    c_found &= counted
    c_rows = torch.where(c_found, c_rows, -1)
    old = c._row_score[c_rows.clamp(min=0)]
    totals = torch.where(c_found, cnt + old, cnt)
    threshold = st.thresholds[ut_safe] if st._one_threshold is None else st._one_threshold
    admitted = new & (totals >= threshold)
    put_where(c._row_score, c_rows, totals, c_found)
    result = insert_absent(
        c,
        uk,
        tids_arg,
        hashed,
        torch.zeros(uk.numel(), 0, device=uk.device),
        totals,
        counted & ~c_found,
        _row_mask(c.capacity, c_rows, c_found),
        counter_counts,
    )
    rows_after = torch.where(c_found, c_rows, result.rows)
    return totals, admitted, new & ~admitted, counted, rows_after, result.bad_score


def _row_mask(capacity: int, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[capacity] bool: the rows ``rows[i]`` where ``mask[i]``."""
    out = torch.zeros(capacity + 1, dtype=torch.bool, device=rows.device)  # the last: a sink
    out.index_copy_(0, torch.where(mask, rows, capacity), mask)
    return out[:capacity]


def apply_gradients(storage: FusedStorage, plan: StaticPlan, grad: torch.Tensor) -> None:
    """Backward of :func:`train_lookup`: ``grad`` [P, dim] (zero past the real keys) summed per
    distinct key, then Adagrad on the rows' payload slots in place (FusedStorage.apply_gradients).
    """
    values, accum = storage.payload.static_arrays()
    # slots of -1 (no row, or not a real run) are skipped: on CUDA in the kernel, no host read;
    # P bounds the longest run (its rounds are the eager tree's, with rounds to spare)
    storage.backend.apply_sparse_gradients(
        values, accum, plan.slots, grad.to(torch.float32), plan.order, plan.starts,
        plan.counts, plan.group, grad.shape[0], storage.adagrad,
    )  # fmt: skip
    storage.payload.static_updated(plan.slots, plan.rows)


def prefetch_rows(
    storage: FusedStorage, keys: torch.Tensor, tids: torch.Tensor, n_real: torch.Tensor
) -> None:
    """The rows of ``keys`` [P] (table ids ``tids`` [P]; the first ``n_real`` real) already
    stored brought to the storage's device tier (:meth:`RowPayload.static_prefetch`), with no
    host read: a find, with no insert, no score change and no admission count, so that the
    step that looks them up later does all that and hits (the eager
    :meth:`FusedStorage.prefetch`'s contract, in fixed shapes)."""
    st, t = storage, storage.table
    runs = unique_runs(keys, tids, n_real, len(st.specs))
    rows, found = t.backend.find(t, runs.keys, st._tids(runs.table_ids))
    st.payload.static_prefetch(torch.where(found & runs.valid, rows, -1))


class _Done:
    """A CPU stand-in for the CUDA event of :meth:`StaticStep._check_later` (copies are done)."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass
class _Entry:
    """One padded size's inputs, plan and graphs."""

    keys: torch.Tensor  # [P] int64
    tids: torch.Tensor  # [P] int64
    n_real: torch.Tensor  # [] int64
    score: torch.Tensor  # [] int64
    grad: torch.Tensor  # [P, dim] float32
    plan: StaticPlan | None = None
    layout: tuple[tuple[int, int], ...] | None = None  # (table id, keys) a part, in tids
    grad_rows: int = 0  # grad's rows past these are zero (apply_gradients' precondition)
    serial: int = 0  # forwards so far (StaticPlan.serial of the latest)
    forward: Any = None  # torch.cuda.CUDAGraph
    backward: Any = None


@dataclass
class _Ahead:
    """One padded size's prefetch: its inputs and graph (a memory pool of its own: it runs on
    another stream beside the step's graphs)."""

    keys: torch.Tensor  # [P] int64
    tids: torch.Tensor  # [P] int64
    n_real: torch.Tensor  # [] int64
    layout: tuple[tuple[int, int], ...] | None = None
    graph: Any = None  # torch.cuda.CUDAGraph


class StaticStep:
    """The static training lookups of one storage (see the module docstring): one
    :class:`_Entry` per padded size, captured on CUDA (``capture``), eager elsewhere."""

    def __init__(self, storage: FusedStorage, *, capture: bool, prefetch: bool = False) -> None:
        self.storage = storage
        self.capture = capture and storage.device.type == "cuda"
        self.prefetching = prefetch  # :meth:`prefetch` runs (else the storage prefetches nothing)
        self._entries: dict[int, _Entry] = {}
        self._ahead: dict[int, _Ahead] = {}  # the prefetches' (CACHING storages)
        self._pool: GraphPool | None = None  # made before the first capture
        self._ahead_pool: GraphPool | None = None  # the prefetches' (they overlap the step's)
        self._ahead_stream: Any = None  # their capture stream (shared.cuda_capture.capture_streams)
        self._arrays: tuple[Any, ...] = ()
        self.counts = DeviceCounts(storage.table)
        counter = storage.counter
        self.counter_counts = None if counter is None else DeviceCounts(counter.table)
        self.errors = torch.zeros(2, dtype=torch.bool, device=storage.device)  # StaticPlan.errors
        # prefetches_left_out: those the payload said not now to (static_prefetch_began)
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "prefetches": 0,
                      "prefetches_left_out": 0}  # fmt: skip
        self._lookups = 0
        pin = storage.device.type == "cuda"
        self._flags_host = torch.zeros(2, dtype=torch.bool, pin_memory=pin)  # _check_later's
        self._flags_done: Any = None  # the event after the last copy to _flags_host
        self.failed: str | None = None  # a capture failed: the eager lookup from then on
        self.prefetch_failed: str | None = None  # a prefetch's capture failed: none from then on

    def why_not(self) -> str | None:
        """Why the next training lookup must be eager (None: it takes this path)."""
        return self.failed or supports(self.storage)

    def lookup(self, parts: list[tuple[int, torch.Tensor]], score_now: int) -> StaticPlan | None:
        """The static lookup of ``parts`` (None: a capture failed just now, nothing changed;
        the caller runs the eager lookup, as every later one)."""
        st = self.storage
        # before the entry is looked up: the payload may move its arrays for this size
        st.payload.static_began(padded_size(sum(k.numel() for _, k in parts)))
        entry, n = self.stage(parts, score_now)
        shared = self._forward(entry)
        if shared is None:
            return None
        st.mutations += 1
        entry.serial += 1
        plan = dataclasses.replace(
            shared,
            n=n,
            serial=entry.serial,
            mutations=st.mutations,
            payload_version=st.payload.static_version(),
        )
        self._lookups += 1
        if self._lookups % CHECK_EVERY == 0:
            self._check_later()
        for t, k in parts:
            st._lookups[t][0] += k.numel()
        return plan

    def stage(self, parts: list[tuple[int, torch.Tensor]], score_now: int) -> tuple[_Entry, int]:
        """(the entry of the parts' padded size, their key count): the keys, table ids, count
        and score copied into its inputs, what its graphs (or :func:`train_lookup`) read: the
        table ids only when the parts' layout is new to the entry, the score only where it is
        read (not LFU)."""
        n = sum(k.numel() for _, k in parts)
        entry = self._entry(padded_size(n))
        self._stage_keys(entry, parts, n)
        if self.storage.strategy is not ScoreStrategy.LFU:  # LFU's scores are use counts:
            entry.score.fill_(score_now)  # train_lookup never reads the step's (one launch)
        return entry, n

    def _stage_keys(
        self, entry: _Entry | _Ahead, parts: list[tuple[int, torch.Tensor]], n: int
    ) -> None:
        """The parts' ``n`` keys, their table ids (only when the layout is new to ``entry``:
        else ``entry.tids[:n]`` holds them from the last write) and count into ``entry``."""
        keys = [k if k.dtype == torch.int64 else k.to(torch.int64) for _, k in parts]
        torch.cat(keys, out=entry.keys[:n])
        layout = tuple((t, k.numel()) for t, k in parts)
        if entry.layout != layout:
            self.storage.write_part_ids(parts, entry.tids[:n])
            entry.layout = layout
        entry.n_real.fill_(n)

    def prefetch(self, parts: list[tuple[int, torch.Tensor]]) -> bool:
        """Bring the stored rows of ``parts``' keys into the CACHING storage's lines ahead of
        their static lookup (:func:`prefetch_rows`; on CUDA one graph per padded size, in a
        pool of its own). Call it on the stream it should run on, once the step before has
        looked its keys up: it never takes that step's lines, so it may run beside that step's
        backward. Whether it ran (False: the storage's tier says not now, or the next lookup
        is not static, or prefetching is off)."""
        if not self.prefetching:
            return False
        st = self.storage
        n = sum(k.numel() for _, k in parts)
        size = padded_size(n)
        if n == 0 or self.why_not() is not None or self.prefetch_failed is not None:
            return False
        if not st.payload.static_prefetch_began(size):
            self.stats["prefetches_left_out"] += 1
            return False
        self._check_arrays()
        ahead = self._ahead.get(size)
        if ahead is None:
            dev = st.device
            ahead = self._ahead[size] = _Ahead(
                keys=torch.zeros(size, dtype=torch.int64, device=dev),
                tids=torch.zeros(size, dtype=torch.int64, device=dev),
                n_real=torch.zeros((), dtype=torch.int64, device=dev),
            )
        self._stage_keys(ahead, parts, n)
        self.stats["prefetches"] += 1
        if not self.capture:
            prefetch_rows(st, ahead.keys, ahead.tids, ahead.n_real)
            return True
        if ahead.graph is None:
            if self._ahead_pool is None:
                self._ahead_pool = graph_pool(st.device)
                # a capture stream apart from the step's graphs', which it replays beside
                # (shared.cuda_capture: a library workspace keyed by stream is not shared)
                self._ahead_stream = capture_streams(st.device).take(self)
            graph = torch.cuda.CUDAGraph()
            try:  # a capture queues nothing: on failure nothing was prefetched
                with self._capturing(graph, self._ahead_pool, self._ahead_stream):
                    prefetch_rows(st, ahead.keys, ahead.tids, ahead.n_real)
            except RuntimeError as e:  # the step itself goes on: no prefetch from now on
                self.prefetch_failed = f"capture failed: {e}"
                logger.warning("static prefetch of %r: %s; no prefetch from now on",
                               st.name, self.prefetch_failed, exc_info=True)  # fmt: skip
                return False
            ahead.graph = graph
            self.stats["captures"] += 1
        ahead.graph.replay()
        return True

    def apply_gradients(self, plan: Plan, grad: torch.Tensor) -> None:
        self.apply_part_gradients(plan, [grad])

    def apply_part_gradients(self, plan: Plan, grads: Sequence[torch.Tensor]) -> None:
        """The backward of ``plan`` given its parts' gradients ([n_i, dim] each, in order),
        concatenated straight into the size's gradient buffer (one launch)."""
        assert isinstance(plan, StaticPlan)  # FusedStorage hands it only what lookup returned
        entry = self._entries.get(plan.keys.numel())
        if self.storage.payload.static_version() != plan.payload_version:
            raise RuntimeError(
                f"the static sparse step of {self.storage.name!r}: a call between this "
                "lookup and its backward (an eval lookup, or an eager training lookup) moved "
                "the CACHING storage's cache lines its rows were in: run it after the "
                "backward (as the trainer evaluates), or run that loop with cuda_graphs off "
                "(the eager lookup)"
            )
        if entry is None or entry.serial != plan.serial or self.storage.mutations != plan.mutations:
            raise RuntimeError(
                f"the static sparse step of {self.storage.name!r} takes each lookup's backward "
                "before the next training lookup of its size or any change of the table (two "
                "forwards before a backward, or a load between): run that loop with "
                "cuda_graphs off (the eager lookup), or one backward per forward"
            )
        if len(grads) == 1:
            entry.grad[: plan.n].copy_(grads[0])
        else:
            torch.cat(list(grads), out=entry.grad[: plan.n])  # [n, dim]
        if entry.grad_rows > plan.n:  # a larger earlier step's rows: zero them (else no op)
            entry.grad[plan.n : entry.grad_rows].zero_()
        entry.grad_rows = plan.n
        if not self.capture:
            apply_gradients(self.storage, plan, entry.grad)
            return
        if entry.backward is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with self._capturing(graph):
                    apply_gradients(self.storage, plan, entry.grad)
            except RuntimeError as e:  # nothing ran: update eagerly now, eager lookups from now
                self._fail(f"backward capture failed: {e}")
                apply_gradients(self.storage, plan, entry.grad)
                return
            entry.backward = graph
        entry.backward.replay()

    def check(self) -> None:
        """Raise if a static lookup met a negative key, a score outside ``[0, 2**60)`` or a
        refusal of the CUDA insert kernels since the last check (one host read)."""
        self._raise(*self.errors.tolist())

    def _check_later(self) -> None:
        """:meth:`check` without waiting for the device: raise for the flags copied to the host
        at the previous call (if that copy is done; else keep it), then copy them again."""
        if self._flags_done is not None:
            if not self._flags_done.query():
                return  # the device is that far behind: look next time
            self._raise(*self._flags_host.tolist())
        self._flags_host.copy_(self.errors, non_blocking=True)
        self._flags_done = torch.cuda.Event() if self.errors.is_cuda else _Done()
        self._flags_done.record()

    def _raise(self, negative: bool, bad_score: bool) -> None:
        if not (negative or bad_score):
            return
        self.errors.zero_()
        self._flags_host.zero_()
        self._flags_done = None
        names = ", ".join(repr(n) for n in self.storage.names)
        if negative:
            raise ValueError(
                f"a training lookup of {names} got a negative key: keys must be non-negative "
                "int64 (negative values are reserved: -1 marks an empty slot); the captured "
                "step refused it (no row, no update). Feature generation maps raw ids into "
                "[0, 2**63)"
            )
        raise ValueError(
            f"a training lookup of {names} met a score outside [0, 2**60) (e.g. loaded from a "
            "checkpoint), or the CUDA kernels refused its insert (nothing inserted that step): "
            "the captured step ranks full buckets by scores in that range. Rescale the "
            "checkpoint's scores, or train with cuda_graphs off (the eager lookup)"
        )

    # ------------------------------------------------------------------ internals

    def _forward(self, entry: _Entry) -> StaticPlan | None:
        counts = (self.counts, self.counter_counts)
        st = self.storage
        if not self.capture:
            self.stats["eager"] += 1
            plan = train_lookup(st, entry.keys, entry.tids, entry.n_real, entry.score, counts)
            self.errors |= plan.errors
            st.payload.static_looked_up()
            return plan
        if entry.forward is None:
            for t in self._tables():  # what the insert keeps, made outside the capture
                t.backend.reserve_selected(t)
            graph = torch.cuda.CUDAGraph()
            try:  # a capture queues nothing: on failure the tables are as they were
                with self._capturing(graph):
                    entry.plan = train_lookup(
                        st, entry.keys, entry.tids, entry.n_real, entry.score, counts
                    )
                    self.errors |= entry.plan.errors
            except RuntimeError as e:
                self._fail(f"capture failed: {e}")
                return None
            entry.forward = graph
            self.stats["captures"] += 1
        entry.forward.replay()
        st.payload.static_looked_up()
        self.stats["replays"] += 1
        for c in counts:
            if c is not None:
                c.register()  # the replay added to the device counts
        assert entry.plan is not None
        return entry.plan

    @contextlib.contextmanager
    def _capturing(
        self, graph: torch.cuda.CUDAGraph, pool: GraphPool | None = None, stream: Any = None
    ) -> Iterator[None]:
        """Capture into ``graph`` (the shared pool; this thread's unsafe calls refused), with no
        garbage collection until it ends: an object collected there may free CUDA resources
        with calls a capturing thread may not make (on the H200, 2026-12-02: a dead table's
        scratch, its pinned buffers freed during a capture, aborted the GPU tests).
        :func:`shared.cuda_capture.capture` neither synchronizes nor empties the caches."""
        device = self.storage.table.device
        if pool is None:
            if self._pool is None:
                self._pool = graph_pool(device)
            pool = self._pool
        enabled = gc.isenabled()
        gc.disable()
        try:
            with capture(graph, pool=pool.id, device=device, stream=stream):
                yield
        finally:
            if enabled:
                gc.enable()

    def _fail(self, why: str) -> None:
        """Every later lookup of this storage runs eagerly (a capture failed)."""
        self.failed = why
        logger.warning("static sparse step of %r: %s; the eager lookup takes over",
                       self.storage.name, why, exc_info=True)  # fmt: skip

    def _entry(self, size: int) -> _Entry:
        self._check_arrays()
        entry = self._entries.get(size)
        if entry is None:
            dev, dim = self.storage.device, self.storage.dim
            entry = self._entries[size] = _Entry(
                keys=torch.zeros(size, dtype=torch.int64, device=dev),
                tids=torch.zeros(size, dtype=torch.int64, device=dev),
                n_real=torch.zeros((), dtype=torch.int64, device=dev),
                score=torch.zeros((), dtype=torch.int64, device=dev),
                grad=torch.zeros(size, dim, dtype=torch.float32, device=dev),
            )
        return entry

    def _check_arrays(self) -> None:
        """Drop every graph if the tables were rebuilt: they read the old arrays (the pools
        stay usable: a GraphPool keeps a graph of its own in it; a pool only these graphs held
        could not be captured into again)."""
        if len(self.storage.specs) > 1:
            # the tables compare table ids from now on (insert_absent sets it; set before a
            # capture, it does not change the find kernels' arguments after one)
            for t in self._tables():
                t._any_tid = True
        arrays = self._array_key()
        if arrays != self._arrays:
            self._entries.clear()
            self._ahead.clear()
            self._arrays = arrays

    def _tables(self) -> list[HashTable]:
        counter = self.storage.counter
        return [self.storage.table] + ([] if counter is None else [counter.table])

    def _array_key(self) -> tuple[Any, ...]:
        key: list[Any] = []
        for t in self._tables():
            arrays = (t._slot_fp, t._slot_row, t._row_key, t._row_tid, t._row_score,
                      t._values, t._accum, t._bucket_count, t._sentinel)  # fmt: skip
            key += [None if a is None else a.data_ptr() for a in arrays]
            key += [t._any_tid, t.num_buckets]
        return (*key, *self.storage.payload.static_key())
