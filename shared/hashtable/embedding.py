"""DynamicEmbeddingCollection: hash-table embeddings for training, with Adagrad in the backward.

One module holds every dynamic table of a model. ``forward`` takes, per table, the 1-D int64
keys of all its lookups in the step (pooled and sequence lookups concatenated, duplicates
included) and returns one float32 row per key; :meth:`DynamicEmbeddingCollection.lookup_parts`
takes the lookups as they are, several of a table allowed, and returns each one's rows. Example::

    dec = DynamicEmbeddingCollection(fs.dynamic_tables, fs.fusion_groups, lr=0.001)
    dec.set_step(step)
    rows = dec({"user_id_emb": user_keys, "adgroup_id_emb": ad_keys})   # name → [N, 16]
    loss(rows).backward()    # Adagrad updates the looked-up rows in place; no optimizer step

Training mode (``module.train()``): keys not in the table are counted for admission; once
admitted they are inserted with the table's initializer; scores follow the score strategy
(STEP: the step from :meth:`set_step`, or the number of training forwards if it is never
called; TIMESTAMP: the clock in microseconds; LFU: use count, shifted right at the steps of
the table's ``lfu_decay`` if it has one, :meth:`FusedStorage.decay_scores`). Keys not (yet)
stored get the admission initializer's value and no update. Eval mode (``module.eval()``): nothing is
inserted, counted or re-scored; keys not stored get ``eval_initializer`` values.

Backward sums the gradients of duplicate keys (in a fixed order, so the same on CPU and CUDA)
and applies torch.optim.Adagrad's update to the rows and their accumulators in place. The
module has no ``nn.Parameter``: the autograd graph hangs on a private zero-size tensor, so a
dense optimizer built from ``model.parameters()`` never sees these tables. Calling backward
twice through the same lookup applies the update twice. The tables live on ``device``;
``module.to()`` does not move them.

A table's ``init_table`` (config) is not read here: ``python -m train.tools init-ckpt`` turns
it into a checkpoint, which training loads with ``--fine_tune_checkpoint``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from shared.features import IdMode, ScoreStrategy, TableSpec
from shared.hashtable import checkpoint
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.backend import Backend
from shared.hashtable.hashing import check_key_tensor, check_keys
from shared.hashtable.layout import RowArrays
from shared.hashtable.static_step import StaticStep
from shared.hashtable.storage import (
    FusedStorage,
    Plan,
    StorageKey,
    TableState,
    compatibility_key,
)

T = TypeVar("T")

logger = logging.getLogger(__name__)


def _factors(members: Sequence[TableSpec], override: Mapping[str, float]) -> list[float]:
    """Each member's cache_load_factor: ``override``'s, else its spec's (unset: 1.0)."""
    out = []
    for t in members:
        assert t.dynamic is not None
        own = t.dynamic.cache_load_factor
        out.append(override.get(t.name, 1.0 if own is None else own))
    return out


def _row_arrays(members: Sequence[TableSpec], where: Mapping[str, RowArrays]) -> RowArrays:
    """A storage's row arrays: on the host when any member's plan puts them there (a plan never
    gives an HBM_ONLY table HOST, so the members that did not ask use less HBM than planned)."""
    host = any(where.get(t.name) is RowArrays.HOST for t in members)
    return RowArrays.HOST if host else RowArrays.DEVICE


def default_clock() -> int:
    """Microseconds since the epoch (TIMESTAMP scores)."""
    return time.time_ns() // 1000


def _checked_keys(
    pieces: Sequence[tuple[str, torch.Tensor]], device: torch.device, *, check_sign: bool
) -> list[torch.Tensor]:
    """Every piece's keys (table name, keys) on ``device``, checked 1-D integer tensors in
    their own dtype (the storage converts them to int64 with its one concatenation,
    ``FusedStorage.lookup``); with ``check_sign``, refused if negative, with one host sync for
    all pieces. Without it the storage refuses them in its first host sync, which is enough
    when one storage takes every key: no storage has changed anything before the refusal."""
    out = [
        check_key_tensor(k if k.device == device else k.to(device), f"lookup of {n!r}")
        for n, k in pieces
    ]
    negative = [(k < 0).any() for k in out if k.numel()] if check_sign else []
    if negative and bool(torch.stack(negative).any()):
        for (n, _), k in zip(pieces, out, strict=True):
            check_keys(k, f"lookup of {n!r}")  # raises, naming the table, key and position
    return out


def lookup_by_table(
    lookup: Callable[..., tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    pieces: Sequence[tuple[str, torch.Tensor]],
    *,
    hits: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``lookup_parts`` through a collection's ``lookup(keys, hits=)`` (table name → keys):
    the pieces of a table concatenated, in order, and its rows (and hits) split back (the
    sharded collection's; :meth:`DynamicEmbeddingCollection.lookup_parts` hands its storages
    the pieces themselves)."""
    positions: dict[str, list[int]] = {}
    for i, (name, _keys) in enumerate(pieces):
        positions.setdefault(name, []).append(i)
    keys = {
        n: torch.cat([pieces[i][1] for i in idx]) if len(idx) > 1 else pieces[idx[0]][1]
        for n, idx in positions.items()
    }
    rows, found = lookup(keys, hits=hits)
    out: list[torch.Tensor | None] = [None] * len(pieces)
    stored: list[torch.Tensor | None] = [None] * len(pieces)
    for n, idx in positions.items():
        sizes = [int(pieces[i][1].numel()) for i in idx]
        chunks = torch.split(rows[n], sizes) if len(idx) > 1 else (rows[n],)
        for i, chunk in zip(idx, chunks, strict=True):
            out[i] = chunk  # [n_i, dim]
        if hits:
            flags = torch.split(found[n], sizes) if len(idx) > 1 else (found[n],)
            for i, chunk in zip(idx, flags, strict=True):
                stored[i] = chunk  # [n_i] bool
    return out, (stored if hits else [])  # type: ignore[return-value]


class _DynamicLookup(torch.autograd.Function):
    """Rows of the distinct keys expanded to every occurrence, split into the lookup's parts
    ([n_i, dim] each); backward runs sparse Adagrad on the parts' gradients. The split is the
    node's own, so its backward hands the storage the parts' gradients as they are (the static
    step concatenates them into its buffer in one launch) where a split after the node added a
    concatenation of its own (issue #53)."""

    @staticmethod
    def forward(
        ctx: Any, dummy: torch.Tensor, storage: FusedStorage, plan: Plan, sizes: list[int]
    ) -> tuple[torch.Tensor, ...]:
        ctx.storage = storage
        ctx.plan = plan
        rows = plan.expanded()  # [N, dim]
        return (rows,) if len(sizes) == 1 else tuple(torch.split(rows, sizes))  # [n_i, dim]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.storage.apply_part_gradients(ctx.plan, grads)  # [n_i, dim] each
        return None, None, None, None


def plan_storages(
    tables: Sequence[TableSpec], fusion_groups: Mapping[str, Sequence[str]]
) -> list[tuple[str, list[TableSpec]]]:
    """Storages to build: each fusion group (split where members cannot share a storage:
    different dim, score strategy, bucket capacity or LFU decay), then each table of no group
    alone."""
    by_name = {t.name: t for t in tables}
    placed: set[str] = set()
    out: list[tuple[str, list[TableSpec]]] = []
    for group, names in fusion_groups.items():
        parts: dict[StorageKey, list[TableSpec]] = {}
        for name in names:
            if name not in by_name:
                raise ValueError(
                    f"fusion group {group!r} names table {name!r}, which is not among the "
                    f"dynamic tables given ({', '.join(by_name) or 'none'}); pass its TableSpec "
                    "or drop it from the group"
                )
            if name in placed:
                raise ValueError(f"table {name!r} is in two fusion groups; keep it in one")
            placed.add(name)
            parts.setdefault(compatibility_key(by_name[name]), []).append(by_name[name])
        if len(parts) > 1:
            logger.info(
                "fusion group %r split into %d storages (dim/strategy/bucket/lfu_decay differ)",
                group,
                len(parts),
            )
        for i, members in enumerate(parts.values()):
            out.append((group if len(parts) == 1 else f"{group}/{i}", members))
    out.extend((t.name, [t]) for t in tables if t.name not in placed)
    return out


def _checked_scales(scales: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """``scales`` checked: ValueError for a table not given or a scale not > 0."""
    for name, scale in scales.items():
        if name not in names:
            raise ValueError(
                f"lr_scales names table {name!r}, which is not among the dynamic tables given "
                f"({', '.join(names)})"
            )
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"lr_scales[{name!r}] = {scale}: give a finite scale > 0")
    return {name: float(scale) for name, scale in scales.items()}


def _without(
    fusion_groups: Mapping[str, Sequence[str]], alone: Collection[str]
) -> dict[str, list[str]]:
    """``fusion_groups`` without the tables ``alone`` (each then gets a storage of its own)."""
    return {g: [n for n in names if n not in alone] for g, names in fusion_groups.items()}


class DynamicEmbeddingCollection(torch.nn.Module):
    """Dynamic hash-table embeddings of several tables (see the module docstring)."""

    _ahead: Any = None  # torch.cuda.Stream: the prefetches' (prefetch_stream), once made
    _looked_up: Any = None  # torch.cuda.Event after the last training lookups (prefetch_stream)

    def __init__(
        self,
        tables: Sequence[TableSpec],
        fusion_groups: Mapping[str, Sequence[str]],
        *,
        lr: float,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        clock: Callable[[], int] | None = None,
        max_load_factor: float = 0.5,
        backend: Backend | None = None,
        id_mode: str = IdMode.DYNREC.value,
        lr_scales: Mapping[str, float] | None = None,
        cache_load_factors: Mapping[str, float] | None = None,
        row_arrays: Mapping[str, RowArrays] | None = None,
    ) -> None:
        """``backend``: every storage's hash-table backend (default: ``backend_for`` the
        device; e.g. ``TorchBackend()`` for the torch code on a GPU). ``id_mode``: the
        :class:`~shared.features.IdMode` value the keys are made in (``fs.id_mode.value``);
        checkpoints record it and a load refuses another. ``lr_scales``: table name → its
        Adagrad rate as a multiple of ``lr`` (and of every rate :meth:`set_learning_rate` sets
        later); such a table, at any scale (1 too), leaves its fusion group for a storage of
        its own (a storage has one rate), and so holds its own ``max_capacity``, not a share
        of the group's. ``cache_load_factors``: table name → the share of its rows cached in
        device memory (a plan's, :mod:`shared.hashtable.placement`), over the specs' own
        ``cache_load_factor``; a storage with a factor below 1 is CACHING
        (:mod:`shared.hashtable.row_cache`), its results the same as HBM_ONLY's. ``row_arrays``:
        table name → where its storage's per-row index arrays live (a plan's, default
        ``DEVICE``; ``HOST`` for CACHING tables only: :class:`FusedStorage`)."""
        super().__init__()
        modes = [m.value for m in IdMode]
        if id_mode not in modes:
            raise ValueError(f"id_mode {id_mode!r} is not one of {modes} (IdMode values)")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"DynamicEmbeddingCollection: duplicate table names in {names}")
        for t in tables:
            if t.dynamic is None:
                raise ValueError(
                    f"table {t.name!r} is not dynamic (num_rows={t.num_rows}); pass only "
                    "FeatureSet.dynamic_tables"
                )
        self.tables: dict[str, TableSpec] = {t.name: t for t in tables}
        for what, given in (("cache_load_factors", cache_load_factors), ("row_arrays", row_arrays)):
            stray = sorted(set(given or {}) - set(self.tables))
            if stray:
                raise ValueError(
                    f"{what} name tables {stray} that are not dynamic tables here "
                    f"({', '.join(self.tables)}); pass {what} of these tables only"
                )
        self.adagrad = AdagradConfig(lr, eps, initial_accumulator_value)
        self.lr_scales = _checked_scales(lr_scales or {}, names)
        self.id_mode = id_mode
        self.device = torch.device(device)
        self.seed = seed
        self._clock = clock or default_clock
        self._step = 0
        self._auto_step = True
        self._storages = [
            FusedStorage(
                name,
                members,
                adagrad=self.table_adagrad(members[0].name),
                seed=seed,
                device=self.device,
                max_load_factor=max_load_factor,
                backend=backend,
                cache_load_factors=_factors(members, cache_load_factors or {}),
                row_arrays=_row_arrays(members, row_arrays or {}),
            )
            for name, members in plan_storages(tables, _without(fusion_groups, self.lr_scales))
        ]
        self._where: dict[str, tuple[FusedStorage, int]] = {
            n: (s, i) for s in self._storages for i, n in enumerate(s.names)
        }
        # autograd anchor: not a Parameter/buffer, so no optimizer or state_dict sees it
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)

    def extra_repr(self) -> str:
        return ", ".join(repr(s) for s in self._storages)

    # ------------------------------------------------------------------ configuration

    @property
    def storages(self) -> dict[str, list[str]]:
        """Storage name → its tables (table fusion as built)."""
        return {s.name: list(s.names) for s in self._storages}

    def set_step(self, step: int) -> None:
        """The training step used as STEP score (call once per step before forward)."""
        self._step = int(step)
        self._auto_step = False

    def set_clock(self, clock: Callable[[], int]) -> None:
        """The integer clock used as TIMESTAMP score (tests inject a fake one)."""
        self._clock = clock

    def set_learning_rate(self, lr: float) -> None:
        """Adagrad's rate from the next update on, in every storage (a learning-rate schedule:
        :mod:`train.lr_schedule`). Written on the device, so a captured static step sees it;
        ``adagrad``, the configured settings that checkpoints record, stays as it is."""
        for s in self._storages:
            s.adagrad = s.adagrad.with_lr(lr * self.lr_scales.get(s.names[0], 1.0))

    def table_adagrad(self, name: str) -> AdagradConfig:
        """The configured Adagrad settings of table ``name``: :attr:`adagrad` at its rate
        (``lr_scales``), what checkpoints record of it."""
        scale = self.lr_scales.get(name)
        return self.adagrad if scale is None else replace(self.adagrad, lr=self.adagrad.lr * scale)

    @property
    def step(self) -> int:
        """The STEP score of this step (:meth:`set_step`)."""
        return self._step

    def score_clock(self) -> int:
        """The TIMESTAMP clock now (µs); checkpoints store ages against it."""
        return self._clock()

    def use_static_step(self, *, capture: bool, prefetch: bool = False) -> None:
        """Training lookups of every storage take the static step whenever its table is at
        max capacity (:mod:`shared.hashtable.static_step`), replayed from CUDA graphs with
        ``capture`` (CUDA tables); the eager lookup otherwise (the default). ``prefetch``: a
        CACHING storage's :meth:`prefetch` then takes the static form
        (:meth:`StaticStep.prefetch`, beside the step in flight on CUDA); without it a storage
        on the static step prefetches nothing (its step reads its misses itself). Opt-in: on
        the H200 on 2026-12-07 it made the embedding step alone slower (``bench_tiers
        --prefetch``: dim 16 at 10 %, 11.45 against 10.13 ms), since it repeats the next
        lookup's unique and find and has only the backward to run beside."""
        for s in self._storages:
            s.static = StaticStep(s, capture=capture, prefetch=prefetch)

    def move_cache_rows_with_cores(self, threads: int) -> list[str]:
        """Every CACHING storage's rows moved between its tiers by ``threads`` host threads in
        the static step (``StaticCacheLines.move_rows_with_cores``; CUDA storages with mapped
        host tiers and a C compiler, else ValueError or RuntimeError saying why). Returns the
        storages it applies to (none without a cache)."""
        names = []
        for s in self._storages:
            move = getattr(s.payload, "move_rows_with_cores", None)
            if move is not None:
                move(threads)
                names.append(s.name)
        return names

    def reserve_max_capacity(self) -> None:
        """Every storage's table at its max capacity now (``HashTable.reserve_max_capacity``).
        The static step runs only there: growing during training takes eager steps until then
        (on the seed config's full data, the first 128 steps at about twice the step time)."""
        for s in self._storages:
            if s.payload.reserve_max_capacity():
                s.mutations += 1  # the rows moved
                t = s.table
                mib = s.tier_stats()["hbm_payload_bytes"] / 2**20
                logger.info("dynamic storage %r: %d rows allocated (its max capacity, "
                            "%.0f MiB of values and accumulators on the device, %s)", s.name,
                            t.capacity, mib, s.payload.name)  # fmt: skip

    def static_stats(self) -> dict[str, dict[str, int]]:
        """Storage name → the static step's captures, replays and eager runs (empty: off)."""
        return {s.name: dict(s.static.stats) for s in self._storages if s.static is not None}

    # ------------------------------------------------------------------ forward

    def forward(self, keys: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Table name → int64 keys [N] ⇒ table name → float32 rows [N, dim] (see module doc)."""
        return self.lookup(keys, hits=False)[0]

    def lookup(
        self, keys: Mapping[str, torch.Tensor], *, hits: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """:meth:`forward`, and with ``hits`` also table name → [N] bool: whether each key has
        a row after the step (stored, or inserted now); False for keys not admitted, refused,
        or (eval) not stored, which got an initializer's value. Not differentiable."""
        rows, found = self.lookup_parts(list(keys.items()), hits=hits)
        return dict(zip(keys, rows, strict=True)), dict(zip(keys, found, strict=False))

    def lookup_parts(
        self, pieces: Sequence[tuple[str, torch.Tensor]], *, hits: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`lookup` of keys given in pieces, several of a table allowed (table name,
        keys [n_i]): [n_i, dim] rows per piece, in order, and with ``hits`` [n_i] bool per
        piece (else ``[]``). A table's pieces are one lookup of their concatenation, in
        order: each storage takes its tables' pieces as they are (its own concatenation of
        the keys is the one a caller's would be), and the rows come back in one split a
        storage, where a caller concatenating a table's pieces first and splitting its rows
        back paid a concatenation and a split a table, and a backward node of its own
        (issue #53: 3 launches and 3 nodes a step of the cold-ids config)."""
        unknown = sorted({n for n, _ in pieces if n not in self._where})
        if unknown:
            raise KeyError(f"unknown dynamic tables {unknown}; known: {', '.join(self._where)}")
        train = self.training
        if train and self._auto_step:
            self._step += 1
        if train:  # LFU decay at its steps, before the step's counts (every storage that has it)
            for s in self._storages:
                s.decay_scores(self._step)
        now = self._clock() if train else 0
        # each storage's pieces in the caller's order, not grouped by table: the storage sorts
        # its keys by (table id, key) stably, so its results are the same for any order that
        # keeps a table's pieces in order, and its rows and hits come back in the caller's
        # order (pool_and_flag_features then joins adjacent pieces' hits without a copy)
        tables_of: dict[FusedStorage, list[int]] = {}  # the storages these keys use, in order
        for i, (n, _keys) in enumerate(pieces):
            tables_of.setdefault(self._where[n][0], []).append(i)
        # several storages: one sign check for all (a host sync), unless each takes its static
        # step, which refuses a negative key itself (no row, no update; raised within
        # CHECK_EVERY lookups) as a single storage's does: a table at its own rate (a storage
        # of its own) then costs no sync a step (issue #53)
        static = train and all(
            s.static is not None and s.static.why_not() is None for s in tables_of
        )
        checked = _checked_keys(pieces, self.device, check_sign=len(tables_of) > 1 and not static)
        out: list[torch.Tensor | None] = [None] * len(pieces)
        found: list[torch.Tensor | None] = [None] * len(pieces)
        if train and self._ahead is not None:  # a prefetch may start once these are done
            self._looked_up = None
        for storage, idx in tables_of.items():
            parts = [(self._where[pieces[i][0]][1], checked[i]) for i in idx]
            score = now if storage.strategy is ScoreStrategy.TIMESTAMP else self._step
            plan = storage.lookup(parts, train=train, score_now=score)
            sizes = [k.numel() for _, k in parts]
            if train and torch.is_grad_enabled():
                chunks = _DynamicLookup.apply(self._anchor, storage, plan, sizes)
            else:
                chunks = torch.split(plan.expanded(), sizes)
            for i, chunk in zip(idx, chunks, strict=True):
                out[i] = chunk  # [n_i, dim]
            if hits:
                stored = plan.stored()  # [N]
                for i, chunk in zip(idx, torch.split(stored, sizes), strict=True):
                    found[i] = chunk  # [n_i] bool
        if train and self._ahead is not None:
            self._looked_up = torch.cuda.Event()
            self._looked_up.record()
        return out, (found if hits else [])  # type: ignore[return-value]

    @contextlib.contextmanager
    def prefetch_stream(self) -> Iterator[None]:
        """The stream the next batch's :meth:`prefetch` (and the ops that make its keys) should
        be issued on, inside the ``with``: on CUDA, when every CACHING storage's next lookup is
        static (:attr:`FusedStorage.static_prefetches`), a side stream that starts once this
        step's lookups are done (not its backward: the static prefetch never takes the lines
        of the step in flight), so that its reads of the host tier run beside the rest of the
        step; the current stream waits for it on exit, so that the next lookup, and anything
        else, comes after it. Elsewhere (CPU, an eager storage) the current stream: the eager
        resolve must come after the step's backward, which it would race on another stream."""
        tiered = [s for s in self._storages if s.payload.tiered]
        if self.device.type != "cuda" or not tiered or not all(s.static_prefetches for s in tiered):
            yield
            return
        if self._ahead is None:
            self._ahead = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        if self._looked_up is not None:
            self._ahead.wait_event(self._looked_up)
        else:  # no training lookup yet (or since a load): after everything queued
            self._ahead.wait_stream(current)
        try:
            with torch.cuda.stream(self._ahead):
                yield
        finally:
            current.wait_stream(self._ahead)

    def prefetch(self, keys: Mapping[str, torch.Tensor]) -> None:
        """Bring the rows of a coming training batch's stored keys (table name → keys, as
        :meth:`forward` takes them) into the device tier of every CACHING storage, so that the
        batch's own lookup hits (:meth:`FusedStorage.prefetch`: a find, no insert, no score or
        admission change). Nothing to do, and no op, where every storage is HBM_ONLY."""
        if not self.tiered:
            return
        tables_of: dict[FusedStorage, list[str]] = {}
        for n in keys:
            if n in self._where:
                tables_of.setdefault(self._where[n][0], []).append(n)
        for storage, names in tables_of.items():
            if storage.payload.tiered:
                parts = [(self._where[n][1], keys[n].to(self.device)) for n in names]
                storage.prefetch(parts)

    @property
    def tiered(self) -> bool:
        """Whether some storage is CACHING (rows off the device: :meth:`prefetch` pays)."""
        return any(s.payload.tiered for s in self._storages)

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Storage name → its payload tier's counters and bytes (cache hit rate, evictions,
        write-backs, HBM and host bytes)."""
        return {s.name: s.tier_stats() for s in self._storages}

    # ------------------------------------------------------------------ inspection

    def export_table(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [N] int64, values [N, dim] float32) of the admitted keys, sorted by key."""
        state = self.table_state(name)
        return state.keys, state.values

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table: size, capacity and load_factor (of its shared storage), evictions,
        admission_rejections (lookups of keys not yet admitted), refusals (admitted keys that
        found no room, e.g. under NO_EVICTION), admitted, lookups and misses (keys looked up in
        training, and those with no row after the step: a backoff's share), eval_lookups and
        eval_misses (the same in eval mode), and counter_size with admission."""
        return self._per_table(FusedStorage.stats)  # one read of each storage's counters

    def table_state(self, name: str) -> TableState:
        storage, tid = self._lookup_table(name)
        return storage.states()[tid]

    def table_states(self) -> dict[str, TableState]:
        """:meth:`table_state` of every table, each storage exported once."""
        return self._per_table(FusedStorage.states)

    def _per_table(self, of_storage: Callable[[FusedStorage], list[T]]) -> dict[str, T]:
        """Table name → its entry of ``of_storage(storage)``, called once per storage."""
        per = {s: of_storage(s) for s in self._storages}
        return {n: per[s][t] for n, (s, t) in self._where.items()}

    def load_table_state(self, name: str, state: TableState) -> None:
        storage, tid = self._lookup_table(name)
        storage.load_state(tid, state)

    def _lookup_table(self, name: str) -> tuple[FusedStorage, int]:
        if name not in self._where:
            raise KeyError(f"unknown dynamic table {name!r}; known: {', '.join(self._where)}")
        return self._where[name]

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        ckpt_dir: str | Path,
        collections: str | Mapping[str, str],
        rank: int = 0,
        world_size: int = 1,
    ) -> Path:
        """See :func:`shared.hashtable.checkpoint.save`."""
        return checkpoint.save(self, ckpt_dir, collections, rank=rank, world_size=world_size)

    def load(
        self,
        ckpt_dir: str | Path,
        collections: str | Mapping[str, str] | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        tables: Collection[str] | None = None,
    ) -> checkpoint.LoadReport:
        """See :func:`shared.hashtable.checkpoint.load`."""
        return checkpoint.load(
            self, ckpt_dir, collections, rank=rank, world_size=world_size, tables=tables
        )
