"""ROW_WISE dynamic tables: each rank owns the keys ``key % world_size == rank`` of every table.

:class:`ShardedDynamicEmbedding` has the interface of
:class:`~shared.hashtable.embedding.DynamicEmbeddingCollection` (``forward(keys) -> rows``,
``set_step``, ``stats``, ``save``/``load``, ...) and wraps this rank's local collection, which
holds only the keys the rank owns. One ``forward`` serves every table of the step:

1. per table, dedupe the rank's keys (:func:`~shared.hashtable.hashing.unique_pairs`) and order
   the distinct keys by owner (then key);
2. all-to-all a [world, 2 × tables] matrix of split sizes (distinct keys, and their occurrences,
   per owner and table), then one all-to-all of (key, count) pairs for all tables together;
3. the owner expands each received key to its ``count`` occurrences and looks the lot up in its
   local collection in training mode: admission counts, LFU scores and inserts see exactly the
   occurrences one process would see for the global batch; the first row of each received key is
   what goes back (in eval mode there is no expansion and nothing is inserted);
4. one all-to-all of the rows back (:class:`~train.distributed.comm.AllToAllRows`, one flat
   float buffer, so tables of different dims share it); each rank expands them to its
   occurrences.

Backward runs the same path in reverse: each rank sums the gradients of its own duplicates (in
a fixed order: :class:`_ExpandRows`), the summed gradient of each distinct key goes to its owner
in one all-to-all, and the owner's local collection applies its fused Adagrad to the sum of all
ranks' partial sums (one partial per rank that looked the key up, the expanded copies carrying
zeros), i.e. the single-process update up to float summation order.

Costs per training step: three all-to-alls forward (splits, keys, rows), one backward (grads),
one host sync for the split sizes (all-to-all needs them on the host).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.features import TableSpec
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.checkpoint import LoadReport
from shared.hashtable.embedding import DynamicEmbeddingCollection, lookup_by_table
from shared.hashtable.hashing import check_keys, segment_sum_sorted, unique_pairs
from shared.hashtable.storage import COUNTERS, TableState
from train.distributed.comm import AllToAllRows, CommStats, all_to_all
from train.distributed.env import DistEnv

_SUMMED = ("size", "capacity", *COUNTERS)  # every counter of a storage, lookups included


@dataclass
class _TablePlan:
    """One table's keys on the requesting rank."""

    keys: torch.Tensor  # [U] distinct keys in exchange order (owner, then key)
    owners: torch.Tensor  # [U] owner rank of each
    counts: torch.Tensor  # [U] occurrences of each in this rank's batch
    index: torch.Tensor  # [N] exchange position of each occurrence
    order: torch.Tensor  # [N] occurrences sorted by key (stable)
    starts: torch.Tensor  # [U] run starts in `order` (runs in key order, not exchange order)
    runs: torch.Tensor  # [U] run lengths
    group: torch.Tensor  # [N] run of each sorted occurrence
    to_exchange: torch.Tensor  # [U] distinct-key index of each exchange position


def _plan(keys: torch.Tensor, world_size: int) -> _TablePlan:
    order, starts, runs, inverse, group = unique_pairs(keys, None)
    distinct = keys[order[starts]]  # [U] sorted by key
    owners = distinct % world_size
    perm = torch.sort(owners, stable=True).indices  # exchange position → distinct index
    where = torch.empty_like(perm)
    where[perm] = torch.arange(perm.numel(), device=perm.device)  # distinct index → position
    return _TablePlan(
        keys=distinct[perm],
        owners=owners[perm],
        counts=runs[perm],
        index=where[inverse],
        order=order,
        starts=starts,
        runs=runs,
        group=group,
        to_exchange=perm,
    )


@dataclass
class _Splits:
    """Host copies of the split sizes of one exchange, [world, tables] each."""

    send: torch.Tensor  # distinct keys this rank sends to each owner, per table
    recv: torch.Tensor  # distinct keys each source sends here, per table
    recv_occurrences: torch.Tensor  # their occurrences in the sources' batches


class _ExpandRows(torch.autograd.Function):
    """Rows [U, dim] in exchange order → one per occurrence [N, dim]. Backward sums each key's
    occurrences in sorted order (the same float result on every run and device, unlike the
    atomics of ``index_add_`` on CUDA) and returns them in exchange order."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, plan: _TablePlan) -> torch.Tensor:
        ctx.plan = plan
        return rows.index_select(0, plan.index)  # [N, dim]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        p: _TablePlan = ctx.plan
        summed = segment_sum_sorted(grad[p.order], p.starts, p.runs, p.group)  # [U, dim]
        return summed.index_select(0, p.to_exchange), None


def _source_major(per_table: list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """Per table the owner's answers [M_t, ...] (source-rank order, ``counts`` [W, T] of each
    source and table) → one flat buffer ordered by source, then table: what all-to-all sends."""
    w, t = counts.shape
    by_source = [torch.split(x, counts[:, i].tolist()) for i, x in enumerate(per_table)]
    return torch.cat([by_source[i][s].reshape(-1) for s in range(w) for i in range(t)])


def _table_major(back: torch.Tensor, sizes: torch.Tensor) -> list[torch.Tensor]:
    """A buffer received from all ranks (rank, then table; ``sizes`` [W, T] rows of each) →
    per table its rows, in rank order: the owners' answers, or the keys asked of this rank."""
    t = sizes.shape[1]
    parts = torch.split(back, sizes.flatten().tolist())  # (owner, table)
    return [torch.cat(parts[i::t]) for i in range(t)]


class ShardedDynamicEmbedding(nn.Module):
    """Dynamic tables sharded ROW_WISE over the ranks of ``env`` (see the module docstring).

    ``forward`` is a collective: all ranks call it together (absent tables count as empty), and
    in training every rank must run the backward of every call (the gradients' all-to-all).
    """

    def __init__(
        self, local: DynamicEmbeddingCollection, env: DistEnv, comm: CommStats | None = None
    ) -> None:
        super().__init__()
        self.local = local
        self.rank, self.world_size = env.rank, env.world_size
        self.group = env.sparse_group
        self.comm = comm  # all-to-all bytes and time (None: not counted)
        self.names = list(local.tables)  # the same order on every rank
        self.dims = [local.tables[n].dim for n in self.names]
        self._anchor = torch.zeros(0, device=local.device, requires_grad=True)

    # ------------------------------------------------------------------ forward

    def forward(self, keys: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Table name → int64 keys [N] ⇒ table name → float32 rows [N, dim] (collective)."""
        return self.lookup(keys, hits=False)[0]

    def lookup(
        self, keys: Mapping[str, torch.Tensor], *, hits: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """:meth:`forward`, and with ``hits`` also table name → [N] bool, whether each key has
        a row after the step (as :meth:`DynamicEmbeddingCollection.lookup`): the owners' answer,
        sent back in one more all-to-all (collective either way)."""
        unknown = [n for n in keys if n not in self.local.tables]
        if unknown:
            raise KeyError(f"unknown dynamic tables {unknown}; known: {', '.join(self.names)}")
        dev = self.local.device
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        # negative keys are refused by the owner's collection (the sign test syncs the host)
        plans = {
            n: _plan(
                check_keys(keys[n].to(dev), f"lookup of {n!r}", check_sign=False)
                if n in keys
                else empty,
                self.world_size,
            )
            for n in self.names
        }
        if self.comm is not None:
            self.comm.lookups += sum(int(p.index.numel()) for p in plans.values())
            self.comm.unique += sum(int(p.keys.numel()) for p in plans.values())
        splits, asked = self._send_keys(list(plans.values()))
        found, stored = self._owner_lookup(asked, splits, hits=hits)
        back = dict(zip(self.names, self._send_rows(found, splits), strict=True))  # [U, dim]
        rows = {n: _ExpandRows.apply(back[n], plans[n]) for n in keys}  # [N, dim]
        if not hits:
            return rows, {}
        answers = dict(zip(self.names, self._send_hits(stored, splits), strict=True))  # [U]
        return rows, {n: answers[n].index_select(0, plans[n].index) for n in keys}  # [N]

    def lookup_parts(
        self, pieces: Sequence[tuple[str, torch.Tensor]], *, hits: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`lookup` of keys in pieces, as :meth:`DynamicEmbeddingCollection.lookup_parts`
        takes them (collective): a table's pieces concatenated, its rows split back."""
        return lookup_by_table(self.lookup, pieces, hits=hits)

    def _send_keys(self, plans: list[_TablePlan]) -> tuple[_Splits, list[torch.Tensor]]:
        """Steps 1-2: split sizes, then (key, count) pairs to the owners. Returns the sizes and,
        per table, the [M_t, 2] pairs this rank owns, in source-rank order."""
        w, t, dev = self.world_size, len(self.names), self.local.device
        cell = torch.cat([p.owners * t + i for i, p in enumerate(plans)])  # [ΣU] owner × table
        sizes = torch.zeros(w * t, dtype=torch.int64, device=dev)
        sizes.index_add_(0, cell, torch.ones_like(cell))
        occ = torch.zeros(w * t, dtype=torch.int64, device=dev)
        occ.index_add_(0, cell, torch.cat([p.counts for p in plans]))
        mine = torch.cat([sizes.view(w, t), occ.view(w, t)], 1)  # [W, 2T]
        theirs = all_to_all(mine, [1] * w, [1] * w, self.group, self.comm, "splits", self.rank)
        host = torch.cat([mine, theirs]).cpu()  # the one host sync of the step
        splits = _Splits(send=host[:w, :t], recv=host[w:, :t], recv_occurrences=host[w:, t:])
        by_owner = torch.sort(cell, stable=True).indices  # owner-major, then table, then key
        pairs = torch.stack(
            [torch.cat([p.keys for p in plans]), torch.cat([p.counts for p in plans])], 1
        )
        got = all_to_all(
            pairs[by_owner],
            splits.send.sum(1).tolist(),
            splits.recv.sum(1).tolist(),
            self.group,
            self.comm,
            "keys",
            self.rank,
        )  # [M, 2] source-major, then table
        return splits, _table_major(got, splits.recv)  # per table, source order

    def _owner_lookup(
        self, asked: list[torch.Tensor], splits: _Splits, *, hits: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step 3: per table, the [M_t, dim] rows of the received keys (autograd into the local
        collection, whose backward applies Adagrad), and with ``hits`` their [M_t] hits."""
        train = self.training
        lookup: dict[str, torch.Tensor] = {}
        first: list[torch.Tensor] = []
        for i, (name, a) in enumerate(zip(self.names, asked, strict=True)):
            if train:  # every occurrence, as one process would see them
                total = int(splits.recv_occurrences[:, i].sum())
                lookup[name] = torch.repeat_interleave(a[:, 0], a[:, 1], output_size=total)
                first.append(torch.cumsum(a[:, 1], 0) - a[:, 1])
            else:
                lookup[name] = a[:, 0]
        rows, stored = self.local.lookup(lookup, hits=hits)

        def firsts(per: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            return [
                per[n].index_select(0, first[i]) if train else per[n]
                for i, n in enumerate(self.names)
            ]

        return firsts(rows), firsts(stored) if hits else []

    def _send_rows(self, found: list[torch.Tensor], splits: _Splits) -> list[torch.Tensor]:
        """Step 4: rows back to the requesters in one flat buffer (tables may differ in dim).
        Returns per table the [U_t, dim] rows of this rank's distinct keys, exchange order."""
        dims = torch.tensor(self.dims, dtype=torch.int64)
        back = AllToAllRows.apply(
            self._anchor,
            _source_major(found, splits.recv),
            (splits.recv * dims).sum(1).tolist(),
            (splits.send * dims).sum(1).tolist(),
            self.group,
            self.comm,
            self.rank,
        )  # [Σ_owner Σ_table send × dim]
        per_table = _table_major(back, splits.send * dims)
        return [rows.view(-1, dim) for rows, dim in zip(per_table, self.dims, strict=True)]

    def _send_hits(self, stored: list[torch.Tensor], splits: _Splits) -> list[torch.Tensor]:
        """The owners' hits [M_t] back to the requesters, as :meth:`_send_rows` sends rows
        (no gradient). Returns per table the [U_t] bool hits of this rank's distinct keys."""
        back = all_to_all(
            _source_major(stored, splits.recv).to(torch.int64),
            splits.recv.sum(1).tolist(),
            splits.send.sum(1).tolist(),
            self.group,
            self.comm,
            "hits",
            self.rank,
        )  # [Σ_owner Σ_table send]
        return [hits.to(torch.bool) for hits in _table_major(back, splits.send)]

    # ------------------------------------------------------------------ delegation

    @property
    def tables(self) -> dict[str, TableSpec]:
        return self.local.tables

    @property
    def storages(self) -> dict[str, list[str]]:
        return self.local.storages

    @property
    def id_mode(self) -> str:
        """The local collection's (the FeatureSet's ``id_mode.value``)."""
        return self.local.id_mode

    def set_step(self, step: int) -> None:
        self.local.set_step(step)

    def set_learning_rate(self, lr: float) -> None:
        self.local.set_learning_rate(lr)  # this rank's shard: its rows are updated here

    @property
    def step(self) -> int:
        """The local collection's STEP score of this step (what id dropout hashes)."""
        return self.local.step

    @property
    def adagrad(self) -> AdagradConfig:
        return self.local.adagrad

    def table_adagrad(self, name: str) -> AdagradConfig:
        return self.local.table_adagrad(name)

    def score_clock(self) -> int:
        return self.local.score_clock()

    def stats(self) -> dict[str, dict[str, float]]:
        """This rank's shard (see :meth:`global_stats` for the whole table)."""
        return self.local.stats()

    def global_stats(self, env: DistEnv) -> dict[str, dict[str, float]]:
        """Collective. Per table: counters summed over ranks; load_factor the largest rank's."""
        ranks = env.all_gather_object(self.local.stats())
        out: dict[str, dict[str, float]] = {}
        for name in self.names:
            per = [r[name] for r in ranks]
            merged = {k: sum(p.get(k, 0.0) for p in per) for k in per[0] if k in _SUMMED}
            merged["load_factor"] = max(p["load_factor"] for p in per)
            if "counter_size" in per[0]:
                merged["counter_size"] = sum(p["counter_size"] for p in per)
            out[name] = merged
        return out

    def export_table(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of table ``name``: (keys [N], values [N, dim]) sorted by key."""
        return self.local.export_table(name)

    def table_state(self, name: str) -> TableState:
        return self.local.table_state(name)

    def table_states(self) -> dict[str, TableState]:
        return self.local.table_states()

    def load_table_state(self, name: str, state: TableState) -> None:
        self.local.load_table_state(name, state)

    def _check_rank(self, rank: int | None, world_size: int | None, what: str) -> None:
        if (rank, world_size) not in ((None, None), (self.rank, self.world_size)):
            raise ValueError(
                f"{what}: this shard is rank {self.rank} of {self.world_size}, not rank {rank} "
                f"of {world_size}; call it without rank/world_size"
            )

    def save(
        self,
        ckpt_dir: str | Path,
        collections: str | Mapping[str, str],
        rank: int | None = None,
        world_size: int | None = None,
    ) -> Path:
        """Write this rank's ``*.rank_R.world_size_W`` files (the keys it owns)."""
        self._check_rank(rank, world_size, "save")
        return self.local.save(ckpt_dir, collections, rank=self.rank, world_size=self.world_size)

    def load(
        self,
        ckpt_dir: str | Path,
        collections: str | Mapping[str, str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        tables: Collection[str] | None = None,
    ) -> LoadReport:
        """Load the keys this rank owns from a checkpoint of any world size (re-sharding)."""
        self._check_rank(rank, world_size, "load")
        return self.local.load(
            ckpt_dir, collections, rank=self.rank, world_size=self.world_size, tables=tables
        )
