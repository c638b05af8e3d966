"""One storage of fused dynamic tables: a HashTable, an admission counter, scores and stats.

Table fusion: the dynamic tables of one feature group share one :class:`HashTable` (one value
buffer, one Adagrad state, one growth schedule) and one :class:`FrequencyCounter`. Each table keeps
its own key space through a *table id* stored per row beside the key: the pair (table id, key) is
what the table hashes and compares, so ``user_id_emb`` key 7 and ``brand_emb`` key 7 are different
rows, and any int64 key in [0, 2**63) stays usable (folding the id into the key bits would take
bits away from the keys). Export and checkpoints select one table id, so they stay per logical
table. Capacities add up: the storage grows from the sum of the members' init capacities to the
sum of their max capacities, and a member may use more than its own share when others use less.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.features import (
    DynamicTableSpec,
    InitializerSpec,
    LfuDecaySpec,
    ScoreStrategy,
    TableSpec,
)
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.admission import FrequencyCounter
from shared.hashtable.backend import Backend
from shared.hashtable.cuda import runtime as cuda_kernels
from shared.hashtable.hashing import (
    NegativeKeyError,
    check_keys,
    compact_positions,
    split_mask,
)
from shared.hashtable.host_store import TensorHostStore
from shared.hashtable.initializers import KeyedInitializer
from shared.hashtable.layout import RowArrays
from shared.hashtable.payload import DevicePayload, RowPayload
from shared.hashtable.row_cache import RowCache
from shared.hashtable.table import HashTable

logger = logging.getLogger(__name__)


# Cumulative per-table counters (what stats() gives, in this order). Training lookups, except
# eval_*. The lookups are part sizes, known on the host: FusedStorage._lookups adds them there (no
# op); the others are columns of FusedStorage._counts (_COLUMNS), kept on the device and read only
# by stats(), so counting costs no host synchronisation.
COUNTERS = (
    "evictions",  # stored keys removed to make room
    "admission_rejections",  # lookups of keys not yet admitted
    "refusals",  # admitted keys that could not be stored
    "admitted",  # keys inserted into the table
    "lookups",  # keys looked up (duplicates included)
    "misses",  # of those, keys with no row after the step (a model's backoff takes them)
    "eval_lookups",  # the same two in eval mode
    "eval_misses",
)
_HOST_COUNTERS = ("lookups", "eval_lookups")  # columns of FusedStorage._lookups
_COLUMNS = ("evictions", "refusals", "admitted", "admission_rejections", "misses", "eval_misses")
_EVICTIONS, _REFUSALS, _ADMITTED, _REJECTIONS, _MISSES, _EVAL_MISSES = range(len(_COLUMNS))
assert set(_COLUMNS) | set(_HOST_COUNTERS) == set(COUNTERS)
# adjacent columns take one index_add_: refusals and admitted (FusedStorage._account), admission
# rejections and misses (a training lookup's)
assert _ADMITTED == _REFUSALS + 1 and _MISSES == _REJECTIONS + 1
# Why a full bucket refuses a new key, and what to do, by score strategy (refusal warnings)
_REFUSAL_REASONS: dict[ScoreStrategy | None, str] = {
    ScoreStrategy.NO_EVICTION: "NO_EVICTION never evicts: raise max_capacity, or choose an "
    "evicting score_strategy (LFU, STEP, TIMESTAMP)",
    ScoreStrategy.LFU: "under LFU a new key whose count is below every stored key of its bucket "
    "is refused by design (as in HierarchicalKV): raise max_capacity to keep more keys, or give "
    "the table an lfu_decay (or use STEP or TIMESTAMP) if recent keys should displace old "
    "frequent ones",
    None: "a new key whose score is below every stored key of its bucket is refused (the rows "
    "the batch uses are pinned): raise max_capacity to keep more keys",
}


@dataclass
class TableState:
    """Everything a checkpoint holds for one logical table."""

    keys: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N, dim] float32
    scores: torch.Tensor  # [N] int64
    accumulators: torch.Tensor  # [N, dim] float32
    counter_keys: torch.Tensor | None = None  # [C] int64 (None: no admission)
    counter_counts: torch.Tensor | None = None  # [C] int64


@dataclass
class LookupPlan:
    """What backward needs from one storage's forward."""

    keys: torch.Tensor  # [U] distinct keys
    table_ids: torch.Tensor  # [U]
    rows: torch.Tensor  # [U] row per distinct key, -1 if it gets no update
    order: torch.Tensor  # [N] occurrences sorted by (table id, key)
    starts: torch.Tensor  # [U]
    counts: torch.Tensor  # [U]
    group: torch.Tensor  # [N] distinct index of each sorted occurrence
    inverse: torch.Tensor  # [N] distinct index of each occurrence
    generation: int
    mutations: int  # FusedStorage.mutations when the plan was made
    out: torch.Tensor = field(repr=False)  # [U, dim] forward values of the distinct keys
    updated: int  # distinct keys with a row (rows >= 0), read in the forward
    max_count: int  # the longest run of duplicates, read in the forward

    def expanded(self) -> torch.Tensor:
        """[N, dim]: each occurrence's row of values."""
        return self.out.index_select(0, self.inverse)

    def stored(self) -> torch.Tensor:
        """[N] bool: whether each occurrence's key has a row after the step."""
        return (self.rows >= 0).index_select(0, self.inverse)


class Plan(Protocol):
    """A lookup's plan as the collection reads it (:class:`LookupPlan`, or the static step's
    ``StaticPlan``)."""

    def expanded(self) -> torch.Tensor: ...

    def stored(self) -> torch.Tensor: ...


class StaticLookup(Protocol):
    """The static (graph-replayed) training lookup of a storage
    (``shared.hashtable.static_step.StaticStep``; set by the collection's ``use_static_step``)."""

    stats: dict[str, int]  # captures, replays, eager runs, prefetches
    prefetching: bool  # whether prefetch runs (use_static_step(prefetch=True))

    def why_not(self) -> str | None: ...

    def lookup(self, parts: list[tuple[int, torch.Tensor]], score_now: int) -> Plan | None: ...

    def apply_gradients(self, plan: Plan, grad: torch.Tensor) -> None: ...

    def apply_part_gradients(self, plan: Plan, grads: Sequence[torch.Tensor]) -> None: ...

    def check(self) -> None: ...

    def prefetch(self, parts: list[tuple[int, torch.Tensor]]) -> bool: ...


@dataclass
class _PendingErase:
    """Admission-counter keys to erase once their number is read (keys now in the table)."""

    keys: torch.Tensor
    table_ids: torch.Tensor
    mask: torch.Tensor  # [n] bool: erase keys[i]


# what members of one storage agree on: dim, score strategy, bucket capacity, LFU decay
StorageKey = tuple[int, ScoreStrategy, int, LfuDecaySpec | None]


def compatibility_key(spec: TableSpec) -> StorageKey:
    """Tables fuse only when they agree on what one storage cannot mix (the LFU decay too: it
    shifts the whole score array of the storage at once)."""
    d = spec.dynamic
    assert d is not None
    return spec.dim, d.score_strategy, d.bucket_capacity, d.lfu_decay


def _checked_factors(
    name: str,
    names: list[str],
    dyn: Sequence[DynamicTableSpec],
    factors: Sequence[float] | None,
) -> list[float]:
    """The members' cache_load_factors: ``factors`` (one per member) or the specs' own (unset:
    1.0); ValueError unless one factor in (0, 1] per member."""
    if factors is None:
        factors = [1.0 if d.cache_load_factor is None else d.cache_load_factor for d in dyn]
    if len(factors) != len(dyn) or not all(0.0 < f <= 1.0 for f in factors):
        raise ValueError(
            f"storage {name!r}: cache_load_factors {list(factors)} must give one factor in "
            f"(0, 1] per table of {names}"
        )
    return list(factors)


def _check_row_arrays(
    name: str, names: list[str], factors: Sequence[float], row_arrays: RowArrays
) -> None:
    """ValueError for row arrays on the host in an HBM_ONLY storage (every factor 1.0)."""
    if row_arrays is RowArrays.HOST and all(f >= 1.0 for f in factors):
        raise ValueError(
            f"storage {name!r}: row_arrays HOST is for CACHING storages, but every table of "
            f"{names} is HBM_ONLY (cache_load_factors {list(factors)}); give one a "
            "cache_load_factor below 1, or keep its row arrays on the device"
        )


class FusedStorage:
    """Dynamic tables sharing one hash table; table ``specs[i]`` has table id ``i``.

    The hash table's backend (``backend``, default ``backend_for`` the device) also runs the
    admission counter and computes new rows (all member tables in one call).

    The rows' payload lives where the members' ``cache_load_factor`` says
    (:mod:`shared.hashtable.payload`, chosen here once): HBM_ONLY when every factor is 1.0 (or
    unset), else CACHING with ``sum(ceil(factor * max_capacity))`` cache lines over a host tier
    (:mod:`shared.hashtable.row_cache`). ``cache_load_factors`` (one per member, e.g. a budget's
    plan) replaces the specs' own.

    ``row_arrays``: where the index's per-row arrays live (:class:`RowArrays`; a plan's, as the
    factors). ``HOST`` (mapped host memory on CUDA, for tables whose index does not fit the
    device) is for CACHING storages only: an HBM_ONLY storage has its payload on the device, so
    its index on the host would be slower and save little; it is refused.
    """

    def __init__(
        self,
        name: str,
        specs: list[TableSpec],
        *,
        adagrad: AdagradConfig,
        seed: int,
        device: torch.device,
        max_load_factor: float = 0.5,
        backend: Backend | None = None,
        cache_load_factors: Sequence[float] | None = None,
        row_arrays: RowArrays = RowArrays.DEVICE,
    ) -> None:
        dyn = [s.dynamic for s in specs if s.dynamic is not None]
        assert len(dyn) == len(specs) and len({compatibility_key(s) for s in specs}) == 1
        self.name = name
        self.specs = specs
        self.names = [s.name for s in specs]
        self.dim = specs[0].dim
        self.adagrad = adagrad.on_device(device)  # its rate: set_learning_rate
        self.device = device
        first = dyn[0]
        self.strategy = first.score_strategy
        self.lfu_decay = first.lfu_decay  # None: LFU counts never decay
        self._decayed_at: int | None = None  # the step of the last decay (decay_scores)
        cache_load_factors = _checked_factors(name, self.names, dyn, cache_load_factors)
        self.cache_load_factors = cache_load_factors
        cached = any(f < 1.0 for f in cache_load_factors)
        _check_row_arrays(name, self.names, cache_load_factors, row_arrays)
        self.table = HashTable(
            0 if cached else self.dim,  # CACHING: the index alone, the payload in RowCache
            init_capacity=sum(d.init_capacity for d in dyn),
            max_capacity=sum(d.max_capacity for d in dyn),
            bucket_capacity=first.bucket_capacity,
            score_strategy=self.strategy,
            max_load_factor=max_load_factor,
            with_accumulator=not cached,
            initial_accumulator_value=adagrad.initial_accumulator_value,
            device=device,
            backend=backend,
            row_arrays=row_arrays,
        )
        self.backend = self.table.backend
        self.payload: RowPayload = (
            self._cache(cache_load_factors, dyn)
            if cached
            else DevicePayload(self.table, self.backend)
        )
        adm = [d.admission for d in dyn]
        self.counter: FrequencyCounter | None = None
        if any(adm):
            self.counter = FrequencyCounter(
                sum(a.counter_capacity for a in adm if a),
                max(a.counter_bucket_capacity for a in adm if a),
                device=device,
                backend=self.backend,
            )
        self.has_admission = torch.tensor([a is not None for a in adm], device=device)
        self.thresholds = torch.tensor([a.threshold if a else 1 for a in adm], device=device)
        # one threshold for every table (the common case): compared as a number, no gather
        thresholds = {a.threshold if a else 1 for a in adm}
        self._one_threshold = thresholds.pop() if len(thresholds) == 1 else None

        self._set_initializers(dyn, seed)
        self.all_admission = all(a is not None for a in adm)
        # [tables + 1, columns]: the last row a sink for padded evictions (_account)
        self._counts_sink = torch.zeros(
            len(specs) + 1, len(_COLUMNS), dtype=torch.int64, device=device
        )
        self._counts = self._counts_sink[: len(specs)]  # [tables, columns], a view
        self._one_hot = torch.eye(2, dtype=torch.int64, device=device)  # (refused, admitted)
        self._lookups = [[0] * len(_HOST_COUNTERS) for _ in specs]  # [table][train, eval]
        self._refusals_logged = [0] * len(specs)  # refusal totals already warned about
        self.mutations = 0  # inserts and loads so far: rows of older plans may have moved
        self._last_ids: tuple[tuple[tuple[int, int], ...], torch.Tensor] | None = None
        # per table id t: [>= its largest part] int64, all t (what _part_ids slices)
        self._id_fills = [
            torch.full((0,), t, dtype=torch.int64, device=device) for t in range(len(specs))
        ]
        self.static: StaticLookup | None = None  # the collection's use_static_step sets it

    def _set_initializers(self, dyn: Sequence[DynamicTableSpec], seed: int) -> None:
        """Each member's training, eval and admission initializers, and their row makers."""

        def keyed(init: InitializerSpec, table: str) -> KeyedInitializer:
            return KeyedInitializer(init, seed=seed, table=table)

        pairs = list(zip(self.names, dyn, strict=True))
        self.init = [keyed(d.initializer, n) for n, d in pairs]
        self.eval_init = [keyed(d.eval_initializer, n) for n, d in pairs]
        self.admission_init = [
            keyed(d.admission.initializer, n) if d.admission else None for n, d in pairs
        ]
        # training misses: table id t + n * (not admitted) picks init[t] or admission_init[t]
        self.train_init = [*self.init, *self.admission_init]
        # [n, dim] new rows of (keys, table ids) from each list, all its tables in one call
        self._init_rows = self.backend.keyed_rows(self.init, self.device)
        self._eval_rows = self.backend.keyed_rows(self.eval_init, self.device)
        self._train_rows = self.backend.keyed_rows(self.train_init, self.device)

    def _cache(self, factors: Sequence[float], dyn: Sequence[DynamicTableSpec]) -> RowCache:
        """The CACHING payload: ``ceil(factor * max_capacity)`` lines per member table."""
        lines = sum(math.ceil(f * d.max_capacity) for f, d in zip(factors, dyn, strict=True))
        cuda = self.device.type == "cuda"
        # mapped: the device reads and writes the host rows itself (UVA kernels), where the
        # CUDA kernels can run; else row ids go to the host and the CPU moves the rows
        mapped = cuda and cuda_kernels.available()
        if mapped:  # compiled now, not at the first miss of a training step
            from shared.hashtable.cuda import host_rows

            cuda_kernels.compile_modules(self.device, [host_rows.SOURCE])
        store = TensorHostStore(
            self.dim, capacity=self.table.capacity, pin=cuda, mapped=mapped, device=self.device
        )
        return RowCache(
            self.table,
            self.backend,
            dim=self.dim,
            lines=min(lines, self.table.max_capacity),
            store=store,
            initial_accumulator_value=self.adagrad.initial_accumulator_value,
        )

    def _admits(self, tid: int) -> bool:
        """Whether table ``tid`` has frequency admission (read on the host: no sync)."""
        dynamic = self.specs[tid].dynamic
        return dynamic is not None and dynamic.admission is not None

    def __repr__(self) -> str:
        return (
            f"FusedStorage({self.name!r}, tables={self.names}, capacity={self.table.capacity}, "
            f"backend={self.backend.name}, payload={self.payload.name})"
        )

    # ------------------------------------------------------------------ forward

    def decay_scores(self, step: int) -> bool:
        """The LFU decay of training step ``step`` (:class:`~shared.features.LfuDecaySpec`):
        at a multiple of its ``interval_steps``, once per step, every stored count becomes
        ``count >> shift`` (``HashTable.decay_scores``: a device op, no host read; the index's
        scores, so a CACHING storage's too). The collection calls it before the step's
        lookups; returns whether it decayed. Keyed on the step, not on calls, so a resumed run
        decays at the same steps as one that never stopped (the step is checkpointed, and the
        scores saved are the decayed ones). The admission counter's counts do not decay: a key
        waiting for admission keeps its sightings."""
        d = self.lfu_decay
        if d is None or step <= 0 or step % d.interval_steps or step == self._decayed_at:
            return False
        self._decayed_at = step
        self.table.decay_scores(d.shift)
        return True

    def _tids(self, table_ids: torch.Tensor) -> torch.Tensor | None:
        """Table ids as passed to the HashTable: None for a single-table storage."""
        return table_ids if len(self.specs) > 1 else None

    def write_part_ids(self, parts: list[tuple[int, torch.Tensor]], out: torch.Tensor) -> None:
        """:meth:`_part_ids` written into ``out`` ([N] int64) with one launch (the static
        step's input buffer, where the ids' concatenation and a copy into it took two)."""
        views = self._id_views(parts)
        if len(views) == 1:
            out.copy_(views[0])
        else:
            torch.cat(views, out=out)

    def _id_views(self, parts: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """[n_i] int64 views of the table ids of each part (see :meth:`_part_ids`)."""
        fills = self._id_fills
        for t, k in parts:
            n = k.numel()
            if fills[t].numel() < n:
                size = 1 << (n - 1).bit_length()
                fills[t] = torch.full((size,), t, dtype=torch.int64, device=self.device)
        return [fills[t][: k.numel()] for t, k in parts]

    def _part_ids(self, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """[N] int64: the table id of each key of ``parts``, concatenated.

        They depend only on the parts' (table id, size): a repeated layout (the last one is
        kept) costs no op, another one ``torch.cat`` of slices of per-table buffers filled with
        the table id (one launch, none for one part; a buffer grows to the next power of two
        of a part larger than it). No host sync, no copy from the host.
        """
        layout = tuple((t, k.numel()) for t, k in parts)
        if self._last_ids is None or self._last_ids[0] != layout:
            views = self._id_views(parts)
            self._last_ids = (layout, views[0] if len(views) == 1 else torch.cat(views))
        return self._last_ids[1]

    def lookup(self, parts: list[tuple[int, torch.Tensor]], *, train: bool, score_now: int) -> Plan:
        """Look up the keys of several member tables at once (``parts``: (table id, keys)).

        Negative keys are refused here (:class:`NegativeKeyError`, read in the same host sync
        as the number of distinct keys); the caller names the table. In training the host
        syncs are: distinct keys, hits, the admission counter's hits, admitted keys, and one
        read after the insert (misses to fill, counter keys to erase, the longest run of
        duplicates for backward's segment sum), so that backward needs none. The backend's
        inserts (``exact=False``: padded evictions) and the counter's erase (``count=False``)
        add none on CUDA: their counts settle when a size or counter is next read. With the
        static step enabled and supported, a training lookup reads nothing
        (:mod:`shared.hashtable.static_step`).
        """
        if train and self.static is not None and self.static.why_not() is None:
            plan = self.static.lookup(parts, score_now)
            if plan is not None:
                return plan
        # int64 keys [N]: the parts come checked but in their own integer dtype, converted
        # here once (no op for int64; cat promotes mixed dtypes)
        keys = parts[0][1] if len(parts) == 1 else torch.cat([k for _, k in parts])
        if keys.dtype != torch.int64:
            keys = keys.to(torch.int64)
        tids = self._part_ids(parts)
        try:  # one table: its ids are all equal, the sort by (table id, key) is one by key
            order, starts, counts, inverse, group = self.backend.unique_pairs(
                keys, self._tids(tids), reject_negative=True
            )
        except NegativeKeyError:
            for t, k in parts:
                check_keys(k, f"lookup of {self.names[t]!r}")  # raises, naming key and position
            raise
        first = order[starts]
        uk, ut = keys[first], tids[first]
        rows, valid = self.table.find(uk, self._tids(ut), validate=False)  # keys checked above
        not_admitted: torch.Tensor | None = None
        erase: _PendingErase | None = None
        if train:
            rows, valid, not_admitted, erase = self._train_step(
                uk, ut, counts, rows, valid, score_now
            )
        # rows are -1 where not valid (find's contract, and the insert's for refused keys)
        invalid = ~valid
        reads = [invalid.sum(), counts.max() if counts.numel() else counts.new_zeros(())]
        if erase is not None:
            reads.append(erase.mask.sum())
        n_miss, max_count, *n_erase = torch.stack(reads).tolist()  # the one read after insert
        if erase is not None and n_erase[0]:
            done = compact_positions(erase.mask, n_erase[0])
            assert self.counter is not None
            # valid keys (checked above, or the table's own ids): no count, no host read
            self.counter.erase(erase.keys[done], self._tids(erase.table_ids[done]), count=False)
        out = self.payload.gather(rows, stored=uk.numel() - n_miss)  # [U, dim]
        if n_miss:  # not stored: admission value (train), fresh init (refused), eval value
            self._fill_misses(out, uk, ut, counts, invalid, not_admitted, n_miss)
        for t, k in parts:
            self._lookups[t][0 if train else 1] += k.numel()
        return LookupPlan(
            uk,
            ut,
            rows,
            order,
            starts,
            counts,
            group,
            inverse,
            self.table.generation,
            self.mutations,
            out,
            updated=uk.numel() - n_miss,
            max_count=max_count,
        )

    def prefetch(self, parts: list[tuple[int, torch.Tensor]]) -> None:
        """Bring the rows of ``parts``' stored keys to the device tier before their training
        lookup (a CACHING storage; nothing to do for HBM_ONLY): a find, with no insert, no score
        change and no admission count, so the step's own lookup does all that and hits. Keys
        not stored yet are left to the step (their payload is new). Negative keys are left to
        the step's lookup, which names them.

        Where the next training lookup takes the static step, the eager resolve's host read
        would hold the host until the device caught up: nothing is done (the step reads its
        misses itself), or with prefetching on (``use_static_step(prefetch=True)``) the static
        prefetch runs (:meth:`StaticStep.prefetch`: the same find and fill in fixed shapes, no
        host read, and never the lines of the step in flight, so that it may run beside that
        step's backward on another stream: :meth:`DynamicEmbeddingCollection.prefetch_stream`)."""
        if not self.payload.tiered:
            return
        static = self._next_static()
        if static is not None:
            static.prefetch(parts)  # nothing unless prefetching is on
            return
        keys = parts[0][1] if len(parts) == 1 else torch.cat([k for _, k in parts])
        keys = keys.to(self.device, torch.int64)
        tids = self._part_ids(parts)
        order, starts, _, _, _ = self.backend.unique_pairs(keys, self._tids(tids))
        first = order[starts]
        rows, found = self.table.find(keys[first], self._tids(tids[first]), validate=False)
        self.payload.prefetch(rows[found])

    def _next_static(self) -> StaticLookup | None:
        """The static step, where the next training lookup takes it."""
        return self.static if self.static is not None and self.static.why_not() is None else None

    @property
    def static_prefetches(self) -> bool:
        """Whether :meth:`prefetch` takes the static form (the next training lookup is static,
        with prefetching on): it may then run beside the step in flight."""
        static = self._next_static()
        return static is not None and static.prefetching

    def tier_stats(self) -> dict[str, float]:
        """The payload tier's counters and bytes (:meth:`RowPayload.stats`)."""
        return self.payload.stats()

    def _fill_misses(
        self,
        out: torch.Tensor,
        uk: torch.Tensor,
        ut: torch.Tensor,
        counts: torch.Tensor,
        invalid: torch.Tensor,
        not_admitted: torch.Tensor | None,
        n_miss: int,
    ) -> None:
        """Rows of the ``n_miss`` distinct keys without one into ``out`` [U, dim], and their
        lookups to the misses (and in training, those of keys not admitted to the admission
        rejections: such keys miss too, so a lookup without misses counts nothing here)."""
        miss = compact_positions(invalid, n_miss)
        if not_admitted is None:  # eval
            out[miss] = self._eval_rows(uk[miss], ut[miss], self.dim)
            self._counts[:, _EVAL_MISSES].index_add_(0, ut, counts * invalid)
            return
        which = ut.add(not_admitted, alpha=len(self.specs))[miss]  # index into train_init
        out[miss] = self._train_rows(uk[miss], which, self.dim)
        looked = torch.stack([not_admitted, invalid], 1) * counts.unsqueeze(1)  # [U, 2]
        self._counts[:, _REJECTIONS : _MISSES + 1].index_add_(0, ut, looked)

    def _train_step(
        self,
        uk: torch.Tensor,
        ut: torch.Tensor,
        counts: torch.Tensor,
        rows: torch.Tensor,
        found: torch.Tensor,
        score_now: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _PendingErase | None]:
        """Scores, admission and insertion for one training batch of distinct keys.

        Returns (rows, valid: stored after the step, not_admitted: below the threshold, the
        admission-counter keys to erase: those now stored, for the caller's next host read).
        """
        lfu = self.strategy is ScoreStrategy.LFU
        hit, new = split_mask(found)
        hit_rows = rows[hit]  # also pinned in the insert: the batch's stored keys stay
        if hit.numel():
            old = self.table.scores_of(hit_rows)
            self.table.set_scores(
                hit_rows, old + counts[hit] if lfu else torch.full_like(old, score_now)
            )
        not_admitted = torch.zeros_like(found)
        if new.numel() == 0:
            return rows, found, not_admitted, None
        nk, nt, totals = uk[new], ut[new], counts[new]
        # with_adm: which new keys' tables count admissions (None: every table does)
        with_adm = None if self.all_admission else self.has_admission[nt]
        n_admitted = new.numel()
        if self.counter is not None and (with_adm is None or bool(with_adm.any())):
            totals, admitted, waiting, n_admitted = self._count(nk, nt, totals, with_adm)
            not_admitted[new] = waiting
            if 0 < n_admitted < new.numel():  # the others wait in the counter
                ins = compact_positions(admitted, n_admitted)
                new, nk, nt, totals = new[ins], nk[ins], nt[ins], totals[ins]
                with_adm = None if with_adm is None else with_adm[ins]
        if n_admitted == 0:
            return rows, found, not_admitted, None
        generation = self.table.generation
        self.mutations += 1
        result = self.payload.insert_or_assign(  # new, nk, nt: the admitted keys from here on
            nk,
            self._init_rows(nk, nt, self.dim),
            totals if lfu else torch.full_like(nk, score_now),
            table_ids=self._tids(nt),
            pinned_rows=hit_rows,
            exact=False,  # _account takes padded evictions: no host read for full buckets
        )
        self._account(nt, result.inserted, result.evicted_table_ids)
        erase = None
        if self.counter is not None:
            mask = result.inserted if with_adm is None else result.inserted & with_adm
            erase = _PendingErase(nk, nt, mask)
        if self.table.generation != generation:  # the table grew: every row moved
            rows, found = self.table.find(uk, self._tids(ut), validate=False)
            return rows, found, not_admitted, erase
        rows = rows.index_put((new,), result.rows)  # a new tensor: find's result unchanged
        return rows, rows >= 0, not_admitted, erase

    def _count(
        self,
        nk: torch.Tensor,
        nt: torch.Tensor,
        counts: torch.Tensor,
        with_adm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Count new keys in the admission counter (those of ``with_adm``, all if None).

        Returns ``(totals, admitted, waiting, n_admitted)``: each key's count so far, this
        batch's included (for tables without admission, the batch's count alone), whether it
        reaches its threshold, the negation, and the number admitted (read on the host).
        """
        assert self.counter is not None
        if with_adm is None:
            pending = self.counter.totals(nk, counts, self._tids(nt), validate=False)
            totals = pending.totals
        else:
            sel = torch.nonzero(with_adm).squeeze(1)
            pending = self.counter.totals(nk[sel], counts[sel], self._tids(nt[sel]), validate=False)
            totals = counts.index_put((sel,), pending.totals)
        threshold = self.thresholds[nt] if self._one_threshold is None else self._one_threshold
        admitted = totals >= threshold
        waiting = ~admitted  # their lookups are counted as rejections with the misses
        n_counted, n_admitted = torch.stack([pending.found.sum(), admitted.sum()]).tolist()
        self.counter.remember(pending, n_counted)
        return totals, admitted, waiting, n_admitted

    def _account(
        self,
        tids: torch.Tensor,
        inserted: torch.Tensor,
        evicted_tids: torch.Tensor,
    ) -> None:
        """Add one insert's evictions, admissions and refusals to the device counters.

        ``evicted_tids`` [E] int64 may be padded with -1 (``insert_or_assign(..., exact=False)``):
        the padding lands in the sink row of ``_counts_sink`` (-1 mod rows), not a table's."""
        if evicted_tids.numel():  # (a size known on the host: no sync)
            sink = self._counts_sink
            ones = torch.ones_like(evicted_tids)
            sink[:, _EVICTIONS].index_add_(0, evicted_tids.remainder(sink.shape[0]), ones)
        # refusals and admitted are adjacent columns: one index_add_ of both, rows of _one_hot
        both = self._one_hot[inserted.to(torch.int64)]  # [n, 2]: (1, 0) refused, (0, 1) admitted
        self._counts[:, _REFUSALS : _ADMITTED + 1].index_add_(0, tids, both)

    def _warn_refusals(self, refusals: list[int]) -> None:
        """Warn when a table's refusal total first exceeds 0 and then at each power of two."""
        for t, total in enumerate(refusals):
            before = self._refusals_logged[t]
            if total > before and (before == 0 or total.bit_length() > before.bit_length()):
                self._refusals_logged[t] = total
                logger.warning(
                    "dynamic table %r has refused %d new keys so far: its storage %r (capacity "
                    "%d, max %d, %s) has full buckets, and %s. (Checked when stats are read, "
                    "logged when the total reaches a power of two; see stats()['refusals'].)",
                    self.names[t],
                    total,
                    self.name,
                    self.table.capacity,
                    self.table.max_capacity,
                    self.strategy.value,
                    _REFUSAL_REASONS.get(self.strategy, _REFUSAL_REASONS[None]),
                )

    # ------------------------------------------------------------------ backward

    def apply_part_gradients(self, plan: Plan, grads: Sequence[torch.Tensor]) -> None:
        """:meth:`apply_gradients` of the gradients of a lookup's parts ([n_i, dim] each, in
        order: their concatenation is the [N, dim] gradient). The static step writes them into
        its gradient buffer with one concatenation, where autograd's concatenation of a split's
        gradients and a copy into the buffer took two launches (issue #53)."""
        if not isinstance(plan, LookupPlan):
            assert self.static is not None
            self.static.apply_part_gradients(plan, grads)
            return
        self.apply_gradients(plan, grads[0] if len(grads) == 1 else torch.cat(list(grads)))

    def apply_gradients(self, plan: Plan, grad: torch.Tensor) -> None:
        """Sum the gradients [N, dim] of duplicate keys, then Adagrad the rows in place."""
        if not isinstance(plan, LookupPlan):
            assert self.static is not None
            self.static.apply_gradients(plan, grad)
            return
        if plan.updated == 0:
            return
        g = self.backend.segment_sum_sorted(
            grad.to(torch.float32)[plan.order], plan.starts, plan.counts, plan.group,
            plan.max_count,
        )  # fmt: skip
        upd = compact_positions(plan.rows >= 0, plan.updated)
        rows, g = plan.rows[upd], g[upd]
        keys, tids = plan.keys[upd], plan.table_ids[upd]
        same = self.table.generation == plan.generation
        # rows can only have moved if the table changed since the forward (checked then)
        moved = self.mutations != plan.mutations
        looked_up: torch.Tensor | None = plan.rows  # rows: its entries >= 0, in order
        if not same or (moved and not bool(self._rows_hold(rows, keys, tids).all())):
            rows, found = self.table.find(keys, self._tids(tids), validate=False)  # rows moved
            ok = torch.nonzero(found).squeeze(1)
            rows, g, looked_up = rows[ok], g[ok], None
        self.payload.adagrad(rows, g, self.adagrad, looked_up=looked_up)

    def _rows_hold(
        self, rows: torch.Tensor, keys: torch.Tensor, tids: torch.Tensor
    ) -> torch.Tensor:
        t = self.table
        return (t.row_keys[rows] == keys) & (t.row_table_ids[rows].to(torch.int64) == tids)

    # ------------------------------------------------------------------ state

    def stats(self) -> list[dict[str, float]]:
        """Each member table's statistics (see ``DynamicEmbeddingCollection.stats``), in table-id
        order, from one host read of the device counters: every table at once, because the
        trainer logs them every ``log_step_count_steps`` (one read a table cost 6 % of the
        H200 epoch's main-thread wall, py-spy, 2026-12-02)."""
        n = len(self.specs)
        parts = [self._counts, self.table.table_sizes(n)[:, None]]
        if self.counter is not None:
            parts.append(self.counter.table.table_sizes(n)[:, None])
        if self.static is not None:
            self.static.check()
        rows = torch.cat(parts, 1).tolist()  # the one read of the device counters
        self._warn_refusals([row[_REFUSALS] for row in rows])
        capacity, load = float(self.table.capacity), self.table.load_factor
        out = []
        for tid, row in enumerate(rows):
            mine = dict(zip(_COLUMNS, row, strict=False))
            mine.update(zip(_HOST_COUNTERS, self._lookups[tid], strict=True))
            one = {"size": float(row[len(_COLUMNS)]), "capacity": capacity, "load_factor": load}
            one.update({name: float(mine[name]) for name in COUNTERS})
            if self.counter is not None and self._admits(tid):
                one["counter_size"] = float(row[len(_COLUMNS) + 1])
            out.append(one)
        return out

    def states(self) -> list[TableState]:
        """Each member table's :class:`TableState`, in table-id order, from one export of the
        table and one of the counter (sorted by table id, then key: each table's part is what
        an export of that table alone gives)."""
        rows = self.payload.export()
        assert rows.accumulators is not None
        out = [
            TableState(rows.keys[a:b], rows.values[a:b], rows.scores[a:b], rows.accumulators[a:b])
            for a, b in self._table_spans(rows.table_ids)
        ]
        if self.counter is not None:
            counted = self.counter.table.export()
            for tid, (a, b) in enumerate(self._table_spans(counted.table_ids)):
                if self._admits(tid):
                    out[tid].counter_keys = counted.keys[a:b]
                    out[tid].counter_counts = counted.scores[a:b]
        return out

    def _table_spans(self, sorted_tids: torch.Tensor) -> list[tuple[int, int]]:
        """Each table id's [start, end) in non-decreasing ``sorted_tids`` (one host read)."""
        edges = torch.arange(len(self.specs) + 1, device=sorted_tids.device)
        return list(itertools.pairwise(torch.searchsorted(sorted_tids, edges).tolist()))

    def load_state(self, tid: int, state: TableState) -> None:
        """Replace the content of table ``tid`` by ``state``."""
        self.mutations += 1
        self.table.clear(tid)
        keys = check_keys(state.keys.to(self.device), f"load {self.names[tid]}")
        if keys.numel():
            ids = torch.full_like(keys, tid)
            self.payload.insert_or_assign(
                keys,
                state.values,
                state.scores,
                table_ids=self._tids(ids),
                accumulators=state.accumulators,
            )
        if self.counter is not None:
            self.counter.clear(tid)
            if state.counter_keys is not None and state.counter_keys.numel():
                ck = state.counter_keys.to(self.device)
                assert state.counter_counts is not None
                self.counter.load(ck, state.counter_counts, self._tids(torch.full_like(ck, tid)))
