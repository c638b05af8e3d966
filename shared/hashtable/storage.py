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

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.features import InitializerSpec, ScoreStrategy, TableSpec
from shared.hashtable.adagrad import AdagradConfig, adagrad_update
from shared.hashtable.admission import FrequencyCounter
from shared.hashtable.hashing import check_keys, count_ids, segment_sum_sorted, unique_pairs
from shared.hashtable.initializers import KeyedInitializer
from shared.hashtable.table import HashTable

logger = logging.getLogger(__name__)


@dataclass
class TableCounters:
    """Cumulative per-table counters (training lookups only)."""

    evictions: int = 0  # stored keys removed to make room
    admission_rejections: int = 0  # lookups of keys not yet admitted
    refusals: int = 0  # admitted keys that could not be stored
    admitted: int = 0  # keys inserted into the table


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
    out: torch.Tensor = field(repr=False)  # [U, dim] forward values of the distinct keys


def compatibility_key(spec: TableSpec) -> tuple[int, ScoreStrategy, int]:
    """Tables fuse only when they agree on what one storage cannot mix."""
    assert spec.dynamic is not None
    return spec.dim, spec.dynamic.score_strategy, spec.dynamic.bucket_capacity


class FusedStorage:
    """Dynamic tables sharing one hash table; table ``specs[i]`` has table id ``i``."""

    def __init__(
        self,
        name: str,
        specs: list[TableSpec],
        *,
        adagrad: AdagradConfig,
        seed: int,
        device: torch.device,
        max_load_factor: float = 0.5,
    ) -> None:
        dyn = [s.dynamic for s in specs if s.dynamic is not None]
        assert len(dyn) == len(specs) and len({compatibility_key(s) for s in specs}) == 1
        self.name = name
        self.specs = specs
        self.names = [s.name for s in specs]
        self.dim = specs[0].dim
        self.adagrad = adagrad
        self.device = device
        first = dyn[0]
        self.strategy = first.score_strategy
        self.table = HashTable(
            self.dim,
            init_capacity=sum(d.init_capacity for d in dyn),
            max_capacity=sum(d.max_capacity for d in dyn),
            bucket_capacity=first.bucket_capacity,
            score_strategy=self.strategy,
            max_load_factor=max_load_factor,
            with_accumulator=True,
            initial_accumulator_value=adagrad.initial_accumulator_value,
            device=device,
        )
        adm = [d.admission for d in dyn]
        self.counter: FrequencyCounter | None = None
        if any(adm):
            self.counter = FrequencyCounter(
                sum(a.counter_capacity for a in adm if a),
                max(a.counter_bucket_capacity for a in adm if a),
                device=device,
            )
        self.has_admission = torch.tensor([a is not None for a in adm], device=device)
        self.thresholds = torch.tensor([a.threshold if a else 1 for a in adm], device=device)

        def keyed(init: InitializerSpec, table: str) -> KeyedInitializer:
            return KeyedInitializer(init, seed=seed, table=table)

        pairs = list(zip(self.names, dyn, strict=True))
        self.init = [keyed(d.initializer, n) for n, d in pairs]
        self.eval_init = [keyed(d.eval_initializer, n) for n, d in pairs]
        self.admission_init = [
            keyed(d.admission.initializer, n) if d.admission else None for n, d in pairs
        ]
        self.counters = [TableCounters() for _ in specs]

    # ------------------------------------------------------------------ forward

    def _tids(self, table_ids: torch.Tensor) -> torch.Tensor | None:
        """Table ids as passed to the HashTable: None for a single-table storage."""
        return table_ids if len(self.specs) > 1 else None

    def _fill(
        self, inits: Sequence[KeyedInitializer | None], keys: torch.Tensor, tids: torch.Tensor
    ) -> torch.Tensor:
        """[n, dim] values from the per-table initializers ``inits`` (one loop per table)."""
        out = torch.empty(keys.numel(), self.dim, device=self.device)
        for t, init in enumerate(inits):
            sel = torch.nonzero(tids == t).squeeze(1)
            if sel.numel():
                assert init is not None
                out[sel] = init(keys[sel], self.dim)
        return out

    def lookup(
        self, parts: list[tuple[int, torch.Tensor]], *, train: bool, score_now: int
    ) -> LookupPlan:
        """Look up the keys of several member tables at once (``parts``: (table id, keys))."""
        keys = torch.cat([k for _, k in parts])
        tids = torch.cat([torch.full_like(k, t) for t, k in parts])
        order, starts, counts, inverse, group = unique_pairs(keys, tids)
        first = order[starts]
        uk, ut = keys[first], tids[first]
        rows, valid = self.table.find(uk, self._tids(ut))
        not_admitted = torch.zeros_like(valid)
        if train:
            rows, valid, not_admitted = self._train_step(uk, ut, counts, rows, valid, score_now)
        out = self.table.values[rows.clamp(min=0)]  # [U, dim]
        miss = torch.nonzero(~valid).squeeze(1)
        if miss.numel():  # not stored: admission value (train), fresh init (refused), eval value
            na = not_admitted[miss]
            fills: list[tuple[torch.Tensor, Sequence[KeyedInitializer | None]]] = (
                [(miss[na], self.admission_init), (miss[~na], self.init)]
                if train
                else [(miss, self.eval_init)]
            )
            for sel, inits in fills:
                if sel.numel():
                    out[sel] = self._fill(inits, uk[sel], ut[sel])
        rows = torch.where(valid, rows, torch.full_like(rows, -1))
        return LookupPlan(
            uk, ut, rows, order, starts, counts, group, inverse, self.table.generation, out
        )

    def _train_step(
        self,
        uk: torch.Tensor,
        ut: torch.Tensor,
        counts: torch.Tensor,
        rows: torch.Tensor,
        found: torch.Tensor,
        score_now: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores, admission and insertion for one training batch of distinct keys.

        Returns (rows, valid: stored after the step, not_admitted: below the threshold).
        """
        lfu = self.strategy is ScoreStrategy.LFU
        hit = torch.nonzero(found).squeeze(1)
        if hit.numel():
            old = self.table.scores_of(rows[hit])
            self.table.set_scores(
                rows[hit], old + counts[hit] if lfu else torch.full_like(old, score_now)
            )
        new = torch.nonzero(~found).squeeze(1)
        not_admitted = torch.zeros_like(found)
        if new.numel() == 0:
            return rows, found, not_admitted
        nk, nt, totals = uk[new], ut[new], counts[new]
        admitted = torch.ones_like(nk, dtype=torch.bool)
        with_adm = self.has_admission[nt]
        if self.counter is not None and bool(with_adm.any()):
            sel = torch.nonzero(with_adm).squeeze(1)
            totals = totals.clone()
            totals[sel] = self.counter.add(nk[sel], counts[new][sel], self._tids(nt[sel]))
            admitted = totals >= self.thresholds[nt]
            waiting = ~admitted
            for t, counter in enumerate(self.counters):  # lookups of keys still below threshold
                counter.admission_rejections += int(counts[new][waiting & (nt == t)].sum())
        not_admitted[new] = ~admitted
        ins = torch.nonzero(admitted).squeeze(1)
        if ins.numel() == 0:
            return rows, found, not_admitted
        ik, it = nk[ins], nt[ins]
        scores = totals[ins] if lfu else torch.full_like(ik, score_now)
        generation = self.table.generation
        result = self.table.insert_or_assign(
            ik,
            self._fill(self.init, ik, it),
            scores,
            table_ids=self._tids(it),
            pinned_rows=rows[hit],
        )
        self._account(it, result.inserted, result.evicted_table_ids)
        if self.counter is not None:
            done = torch.nonzero(result.inserted & with_adm[ins]).squeeze(1)
            if done.numel():
                self.counter.erase(ik[done], self._tids(it[done]))
        if self.table.generation != generation:  # the table grew: every row moved
            rows, found = self.table.find(uk, self._tids(ut))
            return rows, found, not_admitted
        rows = rows.clone()
        rows[new[ins]] = result.rows
        return rows, rows >= 0, not_admitted

    def _account(
        self,
        tids: torch.Tensor,
        inserted: torch.Tensor,
        evicted_tids: torch.Tensor,
    ) -> None:
        n = len(self.specs)
        ev = count_ids(evicted_tids, n).tolist()
        ref = count_ids(tids[~inserted], n).tolist()
        adm = count_ids(tids[inserted], n).tolist()
        for t in range(n):
            c = self.counters[t]
            c.evictions += ev[t]
            c.admitted += adm[t]
            if ref[t]:
                before = c.refusals
                c.refusals += ref[t]
                if before == 0 or (c.refusals.bit_length() > before.bit_length()):
                    logger.warning(
                        "dynamic table %r refused %d new keys in this step (%d in total): its "
                        "storage %r (capacity %d, max %d, %s) has full buckets. Raise "
                        "max_capacity, or use an evicting score_strategy. (Logged when the "
                        "total reaches a power of two; see stats()['refusals'].)",
                        self.names[t],
                        ref[t],
                        c.refusals,
                        self.name,
                        self.table.capacity,
                        self.table.max_capacity,
                        self.strategy.value,
                    )

    # ------------------------------------------------------------------ backward

    def apply_gradients(self, plan: LookupPlan, grad: torch.Tensor) -> None:
        """Sum the gradients [N, dim] of duplicate keys, then Adagrad the rows in place."""
        g = segment_sum_sorted(
            grad.to(torch.float32)[plan.order], plan.starts, plan.counts, plan.group
        )
        upd = torch.nonzero(plan.rows >= 0).squeeze(1)
        if upd.numel() == 0:
            return
        rows, g = plan.rows[upd], g[upd]
        keys, tids = plan.keys[upd], plan.table_ids[upd]
        same = self.table.generation == plan.generation
        if not same or not bool(self._rows_hold(rows, keys, tids).all()):
            rows, found = self.table.find(keys, self._tids(tids))  # rows moved since forward
            ok = torch.nonzero(found).squeeze(1)
            rows, g = rows[ok], g[ok]
        accum = self.table.accumulators
        assert accum is not None
        adagrad_update(self.table.values, accum, rows, g, self.adagrad)

    def _rows_hold(
        self, rows: torch.Tensor, keys: torch.Tensor, tids: torch.Tensor
    ) -> torch.Tensor:
        t = self.table
        return (t.row_keys[rows] == keys) & (t.row_table_ids[rows].to(torch.int64) == tids)

    # ------------------------------------------------------------------ state

    def stats(self, tid: int) -> dict[str, float]:
        sizes = self.table.table_sizes(len(self.specs))
        c = self.counters[tid]
        out = {
            "size": float(sizes[tid]),
            "capacity": float(self.table.capacity),
            "load_factor": self.table.load_factor,
            "evictions": float(c.evictions),
            "admission_rejections": float(c.admission_rejections),
            "refusals": float(c.refusals),
            "admitted": float(c.admitted),
        }
        if self.counter is not None and bool(self.has_admission[tid]):
            out["counter_size"] = float(self.counter.table.table_sizes(len(self.specs))[tid])
        return out

    def state(self, tid: int) -> TableState:
        rows = self.table.export(tid)
        assert rows.accumulators is not None
        state = TableState(rows.keys, rows.values, rows.scores, rows.accumulators)
        if self.counter is not None and bool(self.has_admission[tid]):
            state.counter_keys, state.counter_counts = self.counter.export(tid)
        return state

    def load_state(self, tid: int, state: TableState) -> None:
        """Replace the content of table ``tid`` by ``state``."""
        self.table.clear(tid)
        keys = check_keys(state.keys.to(self.device), f"load {self.names[tid]}")
        if keys.numel():
            ids = torch.full_like(keys, tid)
            self.table.insert_or_assign(
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
