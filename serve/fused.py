"""Fused serving lookups: every id of a batch in one table search and one dense gather.

The per-table path (:class:`serve.sparse.SparseTables`) launches a handful of small kernels per
table and per feature; on a GPU a batch then costs ~500 launches and a dozen host syncs, and the
latency is launch bound. When every table has the same embedding dim (the seed config: 16), this
path instead keeps

- all dynamic tables in **one** :class:`~shared.hashtable.lookup.StaticLookupTable` (the shared
  core's read-only table: sorted keys, one ``searchsorted`` per lookup), each table its own key
  space: key' = (table << shift) | key, where ``shift`` = 60 for up to 7 tables (a bundle with a
  key at or above 2**shift falls back to the per-table path), and
- all dense tables stacked into **one** [Σrows + 1, dim] matrix (row offsets per table; the last
  row is zeros),

so a batch is: concatenate the ids of the user, item and sequence KJTs, map each id to its
table (one ``repeat_interleave`` of a per-key code), one ``searchsorted``, two gathers, a ``where``,
one ``index_add`` per pooled KJT, and one ``cat`` per dense input. The result is identical to
:meth:`SparseTables.embed` (tests check it), which stays the reference and the fallback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.sparse import TableStats
from shared.batch import Batch
from shared.bundle import Bundle
from shared.dense_inputs import dense_layout
from shared.features import FeatureSet, Side
from shared.hashtable.lookup import StaticLookupTable


class NotFusableError(ValueError):
    """The bundle's tables cannot share one lookup (the per-table path serves it instead)."""


def fusable(fs: FeatureSet) -> str | None:
    """Why ``fs`` cannot use the fused path (None: it can)."""
    dims = {t.dim for t in fs.tables.values()}
    if len(dims) != 1:
        return f"tables have different dims {sorted(dims)}"
    pooling = {t.pooling for t in fs.tables.values()}
    if not pooling <= {"sum", "mean"}:
        return f"pooling {sorted(pooling)}"
    lay = dense_layout(fs)
    if any(fs.features[q].side is Side.USER for q in lay.query):
        return "a SEQUENCE-group query feature is user-side"
    return None


@dataclass(frozen=True)
class _KeyPlan:
    """Per KJT key order: the table code of each key and where the dense inputs take keys from."""

    code: torch.Tensor  # [K] int64 table index of each key (device)
    mean: torch.Tensor | None  # [K] bool, keys whose table pools by mean (device); None: all sum


class FusedTables:
    """All tables of a bundle as one static lookup table + one dense matrix on ``device``."""

    def __init__(self, fs: FeatureSet, bundle: Bundle, device: torch.device) -> None:
        reason = fusable(fs)
        if reason is not None:
            raise NotFusableError(f"cannot fuse the tables: {reason}")
        self.fs = fs
        self.device = device
        self.layout = dense_layout(fs)
        self.dim = next(iter(fs.tables.values())).dim
        self.build_seconds: dict[str, float] = {}
        self._names = list(fs.tables)  # table index → name
        index = {name: i for i, name in enumerate(self._names)}
        dynamic = [t.name for t in fs.dynamic_tables]
        dense = [t.name for t in fs.dense_tables]
        self._index = index

        t0 = time.perf_counter()
        offsets, weights, start = {}, [], 0
        for name in dense:
            w = bundle.dense_tables[name]
            offsets[name] = start
            weights.append(w)
            start += int(w.shape[0])
        weights.append(torch.zeros(1, self.dim))
        self._zero_row = start
        self.weight = torch.cat(weights).to(device, torch.float32)  # [Σrows + 1, dim]
        self.build_seconds["dense_tables"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.rows = {name: int(bundle.dense_tables[name].shape[0]) for name in dense}
        # dynamic tables share one sorted key array: key' = (table << shift) | key
        self._shift = 63 - max(len(dynamic), 1).bit_length()
        self.hash: StaticLookupTable | None = None
        if dynamic:
            keys = [bundle.hash_tables[n][0] for n in dynamic]
            limit = 1 << self._shift
            for name, k in zip(dynamic, keys, strict=True):
                if k.numel() and int(k.max()) >= limit:
                    raise NotFusableError(f"table {name!r} has keys >= 2**{self._shift}")
            # copy each table over, concatenate on the device (no host-side copy of the values)
            fused = torch.cat([((i << self._shift) | k).to(device) for i, k in enumerate(keys)])
            values = torch.cat([bundle.hash_tables[n][1].to(device) for n in dynamic])
            self.hash = StaticLookupTable.from_keys_values(fused, values, device=device)
            self.rows.update({n: int(k.numel()) for n, k in zip(dynamic, keys, strict=True)})
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self.build_seconds["hash_tables"] = time.perf_counter() - t0

        # per table index: hash key space (dynamic) or dummy id; dense row offset; is dense
        n_dyn = len(dynamic)
        tid = [dynamic.index(n) if n in dynamic else n_dyn for n in self._names]
        off = [offsets.get(n, 0) for n in self._names]
        self._n_dyn = n_dyn
        self._tid = torch.tensor(tid, dtype=torch.int64, device=device)
        self._off = torch.tensor(off, dtype=torch.int64, device=device)
        self._is_dense = torch.tensor([n in offsets for n in self._names], device=device)
        self._counts = torch.zeros(n_dyn + 1, 2, dtype=torch.int64, device=device)  # hits, lookups
        self._counts_base = torch.zeros_like(self._counts)
        self._plans: dict[tuple[str, ...], _KeyPlan] = {}

    # ----------------------------------------------------------------------- lookups

    def _plan(self, keys: list[str]) -> _KeyPlan:
        plan = self._plans.get(tuple(keys))
        if plan is None:
            tables = [self.fs.tables[self.fs.features[k].table] for k in keys]
            code = torch.tensor([self._index[t.name] for t in tables], dtype=torch.int64)
            mean = [t.pooling == "mean" for t in tables]
            plan = _KeyPlan(
                code.to(self.device), torch.tensor(mean, device=self.device) if any(mean) else None
            )
            self._plans[tuple(keys)] = plan
        return plan

    def _codes(self, kjt: KeyedJaggedTensor, plan: _KeyPlan) -> torch.Tensor:
        """[N] table index of every value of ``kjt`` (no host sync)."""
        k = len(kjt.keys())
        n = kjt.values().numel()
        if k == 0:
            return plan.code.new_zeros(0)
        per_key = kjt.lengths().view(k, -1).sum(1)  # [K]
        return torch.repeat_interleave(plan.code, per_key, output_size=n)

    def _lookup(self, ids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """[N] ids of tables ``codes`` → [N, dim]; missing dynamic keys give zeros."""
        is_dense = self._is_dense[codes]  # [N]
        dense_idx = torch.where(is_dense, ids + self._off[codes], self._zero_row)
        emb = self.weight.index_select(0, dense_idx)  # [N, dim]
        if self.hash is None:
            return emb
        tid = self._tid[codes]  # [N]; dense ids get the key space with no keys
        # an id >= 2**shift cannot be in a table (all keys are below): send it there too
        space = torch.where(ids < (1 << self._shift), tid, self._n_dyn)
        # StaticLookupTable.find without its key check, which reads a flag (any negative key?)
        # back from the device: a host sync per batch. Feature generation gives ids >= 0; a
        # negative id of a dynamic table would only miss (no key is negative).
        keys = (space << self._shift) | ids
        table = self.hash.keys  # sorted ascending
        if table.numel() == 0:
            found = torch.zeros_like(ids, dtype=torch.bool)
            dyn = emb
        else:
            pos = torch.searchsorted(table, keys).clamp_(max=table.numel() - 1)
            found = table.index_select(0, pos) == keys
            dyn = self.hash.values.index_select(0, pos)  # [N, dim]
        self._counts.index_add_(0, tid, torch.stack([found.long(), torch.ones_like(tid)], 1))
        return torch.where(found.unsqueeze(1), dyn, emb)

    def _pool(self, kjt: KeyedJaggedTensor, emb: torch.Tensor, plan: _KeyPlan) -> torch.Tensor:
        """[K, S, dim]: per key and row, the pooled embedding of the bag (empty → zeros)."""
        k, s = len(kjt.keys()), kjt.stride()
        lengths = kjt.lengths()
        bags = torch.arange(k * s, device=emb.device)
        bag = torch.repeat_interleave(bags, lengths, output_size=emb.shape[0])  # [N]
        out = emb.new_zeros(k * s, self.dim).index_add_(0, bag, emb)  # [K*S, dim]
        if plan.mean is not None:
            mean = plan.mean.repeat_interleave(s)  # [K*S]
            out = out / torch.where(mean, lengths.clamp(min=1), 1).unsqueeze(1).to(out.dtype)
        return out.view(k, s, self.dim)

    def embed(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The dense program's inputs for ``batch`` (on :attr:`device`; KJTs with cached
        ``length_per_key``, as feature generation and :func:`concat_batches` make them)."""
        kjts = (batch.user, batch.item, batch.sequence)
        keys = [kjt.keys() for kjt in kjts]
        plans = [self._plan(k) for k in keys]
        ids = torch.cat([kjt.values() for kjt in kjts])  # [N]
        codes = torch.cat([self._codes(kjt, p) for kjt, p in zip(kjts, plans, strict=True)])
        emb = self._lookup(ids, codes)  # [N, dim]
        user_e, item_e, seq_e = torch.split(emb, [kjt.values().numel() for kjt in kjts])
        user = self._pool(batch.user, user_e, plans[0])  # [Ku, U, dim]
        item = self._pool(batch.item, item_e, plans[1])  # [Ki, B, dim]
        seq = dict(zip(keys[2], torch.split(seq_e, batch.sequence.length_per_key()), strict=True))
        pos_u = {n: i for i, n in enumerate(keys[0])}
        pos_i = {n: i for i, n in enumerate(keys[1])}
        lay = self.layout
        u, b = batch.num_users, batch.batch_size

        def cat(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
            return torch.cat(parts, dim=1) if parts else emb.new_zeros(rows, 0)

        if lay.sequence:
            first = keys[2].index(lay.sequence[0])
            seq_lengths = batch.sequence.lengths().view(len(keys[2]), -1)[first]  # [U]
        else:
            seq_lengths = torch.zeros(u, dtype=torch.int64, device=emb.device)
        return {
            "user_deep": cat([user[pos_u[n]] for n in lay.user_deep], u),  # [U, Du]
            "item_deep": cat([item[pos_i[n]] for n in lay.item_deep], b),  # [B, Di]
            "query": cat([item[pos_i[n]] for n in lay.query], b),  # [B, Dq]
            "seq_values": cat([seq[n] for n in lay.sequence], int(seq_e.shape[0])),  # [T, Dq]
            "seq_lengths": seq_lengths.to(torch.int64),  # [U]
            "user_index": batch.user_index.to(torch.int64),  # [B]
        }

    # ----------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        self._counts_base = self._counts.clone()

    def stats(self) -> list[TableStats]:
        counts = (self._counts - self._counts_base).tolist()  # one host read
        dynamic = [t.name for t in self.fs.dynamic_tables]
        out = []
        for name in self._names:
            t = self.fs.tables[name]
            if t.is_dynamic:
                hits, lookups = counts[dynamic.index(name)]
                rows = self.rows[name]  # a static table holds exactly its keys
                out.append(TableStats(name, True, t.dim, rows, rows, hits, lookups - hits))
            else:
                out.append(TableStats(name, False, t.dim, self.rows[name], self.rows[name], 0, 0))
        return out
