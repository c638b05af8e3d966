"""The bundle's embedding tables on the serving device, and Batch → the dense program's inputs.

Looking each table up on its own launches a handful of small kernels per table and per feature
(~500 launches and a dozen host syncs per batch on a GPU: launch bound). Instead the tables are
fused by embedding dim, each group of equal dim holding

- its dynamic (``is_hashmap``) tables in **one** :class:`~shared.hashtable.lookup.StaticLookupTable`
  (the shared core's read-only table: sorted keys, one ``searchsorted`` per lookup; with
  :attr:`serve.tiers.TierConfig.headroom` free slots, for deltas written in place:
  :meth:`EmbeddingTables.prepare_update`), each table its own key space:
  key' = (table << shift) | key, where ``shift`` = 63 - bit_length(tables), 60 for up to 7
  tables; a table with a key at or above 2**shift gets a group of its own (shift
  63: its keys as they are), and
- its dense (``num_buckets``) tables stacked into **one** [Σrows + 1, dim] matrix (row offsets
  per table; the last row is zeros).

A batch is then, per group (the seed config has one dim: one group): the ids of the user, item
and sequence KJTs whose tables the group holds, each id's table (one ``repeat_interleave`` of a
per-key code), one ``searchsorted``, two gathers, a ``where``, and one
:func:`~shared.dense_inputs.pool_bags` (one index_add) per pooled KJT; the program's inputs are
put together by :func:`~shared.dense_inputs.assemble_dense_inputs`, as in training. A key that is
not in its dynamic table (never seen, or never admitted in training) gets zeros, i.e. the eval
initializer (CONSTANT 0), and counts as a miss. On CUDA nothing is read back to the host::

    tables = EmbeddingTables.from_bundle(bundle, device="cuda")
    inputs = tables.embed(batch, pairs)     # batch on the device → the inputs of dense.pt2
    logits = program(**inputs)              # [B]
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.tiers import (
    KEY_BYTES,
    LINE_BYTES,
    VALUE_BYTES_PER_DIM,
    HostTiers,
    TierConfig,
    TieredRows,
    build_tiered,
    plan_tiers,
    prepare_tiered,
)
from shared.batch import Batch
from shared.bundle import Bundle
from shared.dense_inputs import (
    Pairs,
    assemble_dense_inputs,
    cold_layout,
    cold_rows,
    dense_layout,
    pool_bags,
)
from shared.features import FeatureSet, TableSpec
from shared.hashtable.lookup import StaticLookupTable, TableWrite
from shared.hashtable.placement import StorageMode, describe

log = logging.getLogger(__name__)
CACHING = StorageMode.CACHING

WHOLE_KEY = 63  # the shift of a group of one dynamic table: keys as they are, no table bits
PAD_ID = 0  # the id of padding values (serve.graphs): a valid row of every table
SEQUENCE = 2  # the sequence KJT's position in (user, item, sequence)
MIN_SPARE_ROWS = 1024
# the tiers of tables built without a TierConfig (the bundle's fg.json factors): one per process,
# so that such loads share equal host rows too (serve.tiers, "What a load shares")
DEFAULT_TIERS = TierConfig()


def spare_rows(keys: int, headroom: float) -> int:
    """Free slots of a group's dynamic table of ``keys`` keys (0 with ``headroom`` 0)."""
    return max(math.ceil(keys * headroom), MIN_SPARE_ROWS) if headroom > 0 else 0


class InPlaceUnavailableError(Exception):
    """A delta cannot be written into the live tables (the reason says why): rebuild them."""


@dataclass(frozen=True)
class TableStats:
    name: str
    is_hashmap: bool
    dim: int
    rows: int
    capacity: int
    hits: int  # dynamic tables: keys found (admitted ids)
    misses: int  # dynamic tables: keys not found (zeros returned)
    # storage tiers (serve.tiers): the mode, found keys whose row was read from the host tier
    # (CACHING; hits - host_reads came from HBM), and the bytes of each tier
    mode: str = "HBM_ONLY"
    host_reads: int = 0
    hbm_bytes: int = 0
    host_bytes: int = 0


class _Group:
    """Tables of one embedding dim as one lookup: ids [N] with their table codes [N] (each
    id's table as a position in :attr:`names`) → [N, dim]."""

    def __init__(
        self,
        dim: int,
        tables: list[TableSpec],
        shift: int,
        bundle: Bundle,
        device: torch.device,
        seconds: dict[str, float],
        headroom: float = 0.0,
        factors: Mapping[str, float] | None = None,
        host: HostTiers | None = None,
    ) -> None:
        """``factors``: a CACHING group (every table dynamic, :mod:`serve.tiers`), each table's
        share of rows in HBM, its host rows shared through ``host``; None: HBM_ONLY."""
        self.dim = dim
        self.shift = shift
        self.names = [t.name for t in tables]
        self.dynamic = [t.name for t in tables if t.is_dynamic]
        dense = [t.name for t in tables if not t.is_dynamic]
        assert shift < WHOLE_KEY or (len(self.dynamic) == 1 and not dense), self.names

        t0 = time.perf_counter()
        offsets, weights, start = {}, [], 0
        for name in dense:
            w = bundle.dense_tables[name]
            offsets[name] = start
            weights.append(w)
            start += int(w.shape[0])
        weights.append(torch.zeros(1, dim))
        self._zero_row = start
        self.weight = torch.cat(weights).to(device, torch.float32)  # [Σrows + 1, dim]
        seconds["dense_tables"] = seconds.get("dense_tables", 0.0) + time.perf_counter() - t0

        t0 = time.perf_counter()
        self.rows = {name: int(bundle.dense_tables[name].shape[0]) for name in dense}
        self.hash: StaticLookupTable | None = None
        self.tiers: TieredRows | None = None
        self.factors = dict(factors or {})
        if factors is not None:  # keys on the device, values on the host and hot ones in HBM
            assert self.dynamic and not dense and host is not None, self.names
            self.hash, self.tiers = build_tiered(bundle, self.dynamic, shift, factors, device, host)
            self.rows.update({n: int(bundle.hash_tables[n][0].numel()) for n in self.dynamic})
        elif self.dynamic:  # one sorted key array: key' = (table << shift) | key
            keys = [bundle.hash_tables[n][0] for n in self.dynamic]
            # copy each table over, concatenate on the device (no host-side copy of the values)
            fused = torch.cat([((i << shift) | k).to(device) for i, k in enumerate(keys)])
            values = torch.cat([bundle.hash_tables[n][1].to(device) for n in self.dynamic])
            spare = spare_rows(fused.numel(), headroom)
            self.hash = StaticLookupTable.from_keys_values(
                fused, values, device=device, spare=spare
            )
            self.rows.update({n: int(k.numel()) for n, k in zip(self.dynamic, keys, strict=True)})
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        seconds["hash_tables"] = seconds.get("hash_tables", 0.0) + time.perf_counter() - t0

        # per table code: key space (dense tables: n_dyn, which holds no keys), row offset, dense?
        n_dyn = len(self.dynamic)
        tid = [self.dynamic.index(n) if n in self.dynamic else n_dyn for n in self.names]
        self._n_dyn = n_dyn
        self._tid = torch.tensor(tid, dtype=torch.int64, device=device)
        self._off = torch.tensor([offsets.get(n, 0) for n in self.names], device=device)
        self._is_dense = torch.tensor([n in offsets for n in self.names], device=device)
        # per key space: hits, lookups (and with tiers the hits read from the host tier)
        width = 2 if self.tiers is None else 3
        self.counts = torch.zeros(n_dyn + 1, width, dtype=torch.int64, device=device)

    def lookup(self, ids: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] ids of the tables ``codes`` → ([N, dim], [N] bool: the id has a row); missing
        dynamic keys give zeros (and False); ids of dense tables always have a row."""
        is_dense = self._is_dense[codes]  # [N]
        dense_idx = torch.where(is_dense, ids + self._off[codes], self._zero_row)
        emb = self.weight.index_select(0, dense_idx)  # [N, dim]
        if self.hash is None:
            return emb, torch.ones_like(is_dense)
        tid = self._tid[codes]  # [N]; dense ids get the key space with no keys
        space = tid
        if self.shift < WHOLE_KEY:  # an id >= 2**shift cannot be in a table: send it there too
            space = torch.where(ids < (1 << self.shift), tid, self._n_dyn)
        idx, found = self.hash.find((space << self.shift) | ids, check_sign=False)  # [N], [N]
        if self.tiers is not None:
            dyn, in_hbm = self.tiers.gather(idx)  # [N, dim], [N]
            emb = torch.where(found.unsqueeze(1), dyn, emb)
            host = found & ~in_hbm
            counts = torch.stack([found.long(), torch.ones_like(tid), host.long()], 1)
            self.counts.index_add_(0, tid, counts)
            return emb, found | is_dense
        if self.hash.capacity:
            dyn = self.hash.values.index_select(0, idx.clamp(min=0))  # [N, dim]
            emb = torch.where(found.unsqueeze(1), dyn, emb)
        self.counts.index_add_(0, tid, torch.stack([found.long(), torch.ones_like(tid)], 1))
        return emb, found | is_dense

    def pad_on_host(self, name: str) -> bool:
        """Whether id :data:`PAD_ID` of dynamic table ``name`` is read from the host tier (a
        key of a CACHING table without an HBM line; a few host reads, at load)."""
        if self.tiers is None or self.hash is None:
            return False
        key = torch.tensor(
            [(self.dynamic.index(name) << self.shift) | PAD_ID], device=self._tid.device
        )
        idx, found = self.hash.find(key, check_sign=False)
        return bool(found[0]) and not self.tiers.in_hbm(int(idx[0]))

    def table_bytes(self, name: str) -> tuple[int, int]:
        """(HBM bytes, host bytes) of table ``name``: its rows' share of the group's tensors."""
        rows = self.rows[name]
        if name not in self.dynamic:
            return rows * self.dim * 4, 0
        total = sum(self.rows[n] for n in self.dynamic) or 1
        assert self.hash is not None
        keys = self.hash.keys.numel() * 8
        if self.tiers is None:
            return (keys + self.hash.values.numel() * 4) * rows // total, 0
        lines = math.ceil(self.factors[name] * rows)  # as serve.tiers.build_tiered keeps
        hbm = rows * (KEY_BYTES + LINE_BYTES) + lines * self.dim * VALUE_BYTES_PER_DIM
        return hbm, rows * self.dim * VALUE_BYTES_PER_DIM

    def prepare(self, bundle: Bundle) -> list[Callable[[], None]]:
        """Writes that make this group hold ``bundle``'s tables, in its own tensors (computed
        here, off the serving path; each callable writes, between batches), or
        :class:`InPlaceUnavailableError` when they do not fit."""
        if self.tiers is not None:  # every table dynamic: the host tier and its hot lines
            assert self.hash is not None
            return [prepare_tiered(self.hash, self.tiers, bundle, self.dynamic, self.shift)]
        writes: list[Callable[[], None]] = []
        for name, rows in self.rows.items():
            if name in self.dynamic:
                continue
            w = bundle.dense_tables[name].to(self.weight.device, torch.float32)  # [rows, dim]
            if tuple(w.shape) != (rows, self.dim):
                raise InPlaceUnavailableError(f"table {name!r}: {list(w.shape)}, was {rows} rows")
            start = int(self._off[self.names.index(name)])
            changed = torch.nonzero((self.weight[start : start + rows] != w).any(1)).squeeze(1)
            values = w.index_select(0, changed)
            writes.append(_RowWrite(self.weight, changed + start, values).apply)
        if self.hash is not None:
            writes.append(self._prepare_hash(bundle).apply)
        return writes

    def _prepare_hash(self, bundle: Bundle) -> TableWrite:
        assert self.hash is not None
        device = self.hash.device
        keys = [bundle.hash_tables[n][0] for n in self.dynamic]
        for name, k in zip(self.dynamic, keys, strict=True):
            if self.shift < WHOLE_KEY and k.numel() and int(k.max()) >= 1 << self.shift:
                raise InPlaceUnavailableError(
                    f"table {name!r}: key {int(k.max())} is beyond the {self.shift}-bit key space "
                    "it shares with other tables (the rebuild gives it a table of its own)"
                )
        fused = torch.cat([((i << self.shift) | k).to(device) for i, k in enumerate(keys)])
        values = torch.cat([bundle.hash_tables[n][1].to(device) for n in self.dynamic])
        write = self.hash.prepare(fused, values)
        if write is None:
            raise InPlaceUnavailableError(
                f"tables {', '.join(self.dynamic)}: {fused.numel()} keys after the delta, room "
                f"for {self.hash.capacity}"
                + ("" if self.hash.capacity > self.hash.size else " (built without free slots)")
            )
        return write


@dataclass(frozen=True)
class _RowWrite:
    """Rows [M] of a tensor [R, dim] to overwrite with values [M, dim]."""

    tensor: torch.Tensor
    rows: torch.Tensor
    values: torch.Tensor

    def apply(self) -> None:
        self.tensor.index_copy_(0, self.rows, self.values)


def _groups(
    fs: FeatureSet, bundle: Bundle, cached: frozenset[str] = frozenset()
) -> list[tuple[int, list[TableSpec], int, bool]]:
    """(dim, tables, shift, CACHING?) of each group: the tables of one dim share one, except
    dynamic tables with keys beyond the shared key space, which get one each, and the ``cached``
    (CACHING) tables, which share groups of their own (:mod:`serve.tiers`)."""
    out = []
    for dim in dict.fromkeys(t.dim for t in fs.tables.values()):
        tables = [t for t in fs.tables.values() if t.dim == dim]
        tiered = [t for t in tables if t.name in cached]
        tables = [t for t in tables if t.name not in cached]
        for members, is_cached in ((tables, False), (tiered, True)):
            shared, shift = _shared(bundle, [t for t in members if t.is_dynamic])
            alone = [t for t in members if t.is_dynamic and t not in shared]
            rest = [t for t in members if t not in alone]
            out += [(dim, rest, shift, is_cached)] if rest else []
            out += [(dim, [t], WHOLE_KEY, is_cached) for t in alone]
    return out


def _shared(bundle: Bundle, dynamic: list[TableSpec]) -> tuple[list[TableSpec], int]:
    """The dynamic tables that share a key space, and its shift: fewer tables leave more bits
    for the keys, so tables with a key beyond it leave until every key fits."""
    shared = dynamic
    while True:
        shift = WHOLE_KEY - max(len(shared), 1).bit_length()
        wide = [t for t in shared if _max_key(bundle, t.name) >= 1 << shift]
        if not wide:
            return shared, shift
        shared = [t for t in shared if t not in wide]


def _rows(bundle: Bundle, table: str) -> int:
    if table in bundle.hash_tables:
        return int(bundle.hash_tables[table][0].numel())
    return int(bundle.dense_tables[table].shape[0])


def _max_key(bundle: Bundle, table: str) -> int:
    keys = bundle.hash_tables[table][0]
    return int(keys.max()) if keys.numel() else -1


# --------------------------------------------------------------------------- one KJT, one group


@dataclass(frozen=True)
class _Part:
    """The keys of one KJT (0 user, 1 item, 2 sequence) whose tables one group holds."""

    kjt: int
    names: tuple[str, ...]  # their features, in KJT key order
    keys: tuple[int, ...]  # their positions among the KJT's keys
    whole: bool  # every key of the KJT, in order: the KJT's values as they are
    index: torch.Tensor  # [Kg] int64 positions (device)
    code: torch.Tensor  # [Kg] int64 table code within the group (device)
    mean: torch.Tensor | None  # [Kg] bool, keys whose table pools by mean (device); None: all sum

    def size(self, kjt: KeyedJaggedTensor) -> int:
        """How many ids the keys have (host-side lengths: no sync)."""
        if self.whole:
            return kjt.values().numel()
        lens = kjt.length_per_key()
        return sum(lens[k] for k in self.keys)

    def ids(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        """The ids of the keys, as slices of the KJT's values (host offsets: no sync)."""
        if self.whole:
            return [kjt.values()]
        offsets = kjt.offset_per_key()
        return [kjt.values()[offsets[k] : offsets[k + 1]] for k in self.keys]

    def lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """The KJT's bag lengths [K, S] → the keys' [Kg, S]."""
        return lengths if self.whole else lengths.index_select(0, self.index)


# --------------------------------------------------------------------------- the tables


class EmbeddingTables:
    """All tables of a bundle on one device, fused by dim, and :meth:`embed`: Batch → the dense
    program's inputs; hit and miss counts per dynamic table in :meth:`stats`."""

    def __init__(
        self,
        bundle: Bundle,
        device: torch.device,
        *,
        headroom: float | None = None,
        tiers: TierConfig | None = None,
    ) -> None:
        """``headroom``: free slots of the dynamic tables, a fraction of their keys
        (:func:`spare_rows`; 0: none, a delta is then written in place only if its key count
        is the same; None: the tiers' :attr:`~serve.tiers.TierConfig.headroom`). ``tiers``:
        where the dynamic tables live (:mod:`serve.tiers`; None: the bundle's fg.json factors,
        no budget); the plan is logged one line per table, and a
        plan that does not fit raises :class:`~shared.hashtable.placement.PlacementError`."""
        self.fs = bundle.feature_set
        self.device = device
        self.layout = dense_layout(self.fs)
        self.cold_layout = cold_layout(self.fs, self.layout)
        self.build_seconds: dict[str, float] = {}  # dense_tables, hash_tables
        self.tiers = tiers  # as given: a rebuild of these tables (serve.delta) passes it on
        self.host_tiers = (tiers or DEFAULT_TIERS).host  # the server's host tiers (serve.tiers)
        if headroom is None:
            headroom = (tiers or DEFAULT_TIERS).headroom
        dense_bytes = sum(w.numel() * 4 for w in bundle.dense_tables.values())
        rows = {t.name: _rows(bundle, t.name) for t in self.fs.dynamic_tables}
        self.placements = {
            p.table: p
            for p in plan_tiers(
                self.fs, rows, tiers or DEFAULT_TIERS, dense_bytes=dense_bytes, headroom=headroom
            )
        }
        for line in describe(list(self.placements.values())):
            log.info("serving tables: %s", line)
        cached = {n: p.cache_load_factor for n, p in self.placements.items() if p.mode is CACHING}
        self._groups = [
            _Group(
                dim,
                tables,
                shift,
                bundle,
                device,
                self.build_seconds,
                0.0 if is_cached else headroom,
                cached if is_cached else None,
                self.host_tiers,
            )
            for dim, tables, shift, is_cached in _groups(self.fs, bundle, frozenset(cached))
        ]
        # table → (its group, its code there)
        self._place = {
            n: (g, i) for g, grp in enumerate(self._groups) for i, n in enumerate(grp.names)
        }
        self._counts_base = [torch.zeros_like(g.counts) for g in self._groups]
        # lookups of padding (serve.graphs pads batches with id 0): left out of the stats
        self._zero_hits = {  # whether id 0 is a key of each dynamic table (padding hits)
            t.name: bool((bundle.hash_tables[t.name][0] == PAD_ID).any())
            for t in self.fs.dynamic_tables
        }
        # whether id 0 is a key read from the host tier (CACHING tables: padding's host reads)
        self._zero_on_host = {
            n: self._zero_hits[n] and self._groups[g].pad_on_host(n)
            for n, (g, _) in self._place.items()
            if n in self._zero_hits
        }
        self._padding = dict.fromkeys(self._zero_hits, 0)
        self._plans: dict[tuple[tuple[str, ...], ...], list[tuple[_Group, list[_Part]]]] = {}

    @classmethod
    def from_bundle(
        cls,
        bundle: Bundle,
        *,
        device: torch.device | str,
        headroom: float | None = None,
        tiers: TierConfig | None = None,
    ) -> EmbeddingTables:
        """Every table of ``bundle`` on ``device``; build times in :attr:`build_seconds`."""
        return cls(bundle, torch.device(device), headroom=headroom, tiers=tiers)

    def prepare_update(self, bundle: Bundle) -> Callable[[], None]:
        """A function that makes these tables hold ``bundle``'s (the same feature set: a base
        bundle with a delta merged in) in their own tensors, to call between batches (it only
        writes: every comparison and sort is done here, off the serving path). Raises
        :class:`InPlaceUnavailableError` (with the reason) when that is impossible: a dynamic
        group without room for its new keys, a key beyond its shared key space."""
        if bundle.feature_set.tables.keys() != self.fs.tables.keys():
            raise InPlaceUnavailableError("the bundle has other tables than the serving one")
        writes = [w for group in self._groups for w in group.prepare(bundle)]
        rows = [{n: _rows(bundle, n) for n in group.rows} for group in self._groups]
        zero_hits = {n: bool((bundle.hash_tables[n][0] == PAD_ID).any()) for n in self._zero_hits}

        def apply() -> None:
            for write in writes:
                write()
            for group, counts in zip(self._groups, rows, strict=True):
                group.rows = counts
            self._zero_hits = zero_hits

        return apply

    # ----------------------------------------------------------------------- lookups

    def _plan(self, keys: tuple[tuple[str, ...], ...]) -> list[tuple[_Group, list[_Part]]]:
        """Per group, the keys of the user, item and sequence KJTs (``keys``) whose tables it
        holds (groups with none left out; cached per key order)."""
        plan = self._plans.get(keys)
        if plan is None:
            parts: list[list[_Part]] = [[] for _ in self._groups]
            for j, kjt_keys in enumerate(keys):
                tables = [self.fs.tables[self.fs.features[k].table] for k in kjt_keys]
                by_group: dict[int, list[int]] = {}
                for k, t in enumerate(tables):
                    by_group.setdefault(self._place[t.name][0], []).append(k)
                for g, positions in by_group.items():
                    parts[g].append(self._part(j, kjt_keys, tables, positions))
            plan = [(group, p) for group, p in zip(self._groups, parts, strict=True) if p]
            self._plans[keys] = plan
        return plan

    def _part(
        self, kjt: int, keys: tuple[str, ...], tables: list[TableSpec], positions: list[int]
    ) -> _Part:
        mean = [tables[k].pooling == "mean" for k in positions]
        code = [self._place[tables[k].name][1] for k in positions]
        return _Part(
            kjt=kjt,
            names=tuple(keys[k] for k in positions),
            keys=tuple(positions),
            whole=len(positions) == len(keys),
            index=torch.tensor(positions, dtype=torch.int64, device=self.device),
            code=torch.tensor(code, dtype=torch.int64, device=self.device),
            mean=torch.tensor(mean, device=self.device) if any(mean) else None,
        )

    def embed(
        self, batch: Batch, pairs: Pairs | None = None, *, cold: bool = False
    ) -> dict[str, torch.Tensor]:
        """The dense program's inputs for ``batch`` (on :attr:`device`; KJTs with cached
        ``length_per_key``, as feature generation and :func:`concat_batches` make them), with
        ``pairs`` (on :attr:`device`) as ``pair_segment``/``pair_element`` if given, and with
        ``cold`` the cold masks of the dynamic features (``user_cold``, ``item_cold``,
        ``seq_cold``: programs of bundle format 4; :func:`~shared.dense_inputs.cold_rows`)."""
        kjts = (batch.user, batch.item, batch.sequence)
        plan = self._plan(tuple(tuple(kjt.keys()) for kjt in kjts))
        strides = [kjt.stride() for kjt in kjts]  # U, B, U
        lengths = [
            kjt.lengths().view(len(kjt.keys()), s) for kjt, s in zip(kjts, strides, strict=True)
        ]  # [K, S] per KJT
        pooled: dict[str, torch.Tensor] = {}  # [S, dim] per feature
        sequences: dict[str, torch.Tensor] = {}  # [T, dim] per sequence feature
        flags: dict[str, torch.Tensor] = {}  # [S] or [T] bool per feature: cold
        for group, parts in plan:
            sizes = [p.size(kjts[p.kjt]) for p in parts]
            bags = [p.lengths(lengths[p.kjt]) for p in parts]  # [Kg, S] per part
            ids = torch.cat([x for p in parts for x in p.ids(kjts[p.kjt])])  # [N]
            codes = torch.cat(
                [
                    torch.repeat_interleave(p.code, b.sum(1), output_size=n)
                    for p, b, n in zip(parts, bags, sizes, strict=True)
                ]
            )  # [N] table code of each id
            emb, found = group.lookup(ids, codes)  # [N, dim], [N]
            split = (torch.split(emb, sizes), torch.split(found, sizes))
            for p, b, rows, hits in zip(parts, bags, *split, strict=True):
                if p.kjt == SEQUENCE:  # jagged: each feature's [T, dim] as it is
                    lens = batch.sequence.length_per_key()
                    seq = torch.split(rows, [lens[k] for k in p.keys])
                    sequences.update(zip(p.names, seq, strict=True))
                    if cold:
                        misses = torch.split(~hits, [lens[k] for k in p.keys])
                        flags.update(zip(p.names, misses, strict=True))
                else:  # one bag per row: [Kg, S, dim]
                    s = strides[p.kjt]
                    mean = None if p.mean is None else p.mean.repeat_interleave(s)  # [Kg * S]
                    out = pool_bags(rows, b.reshape(-1), mean).view(len(p.keys), s, group.dim)
                    pooled.update(zip(p.names, out.unbind(0), strict=True))
                    if cold:
                        none = cold_rows(hits, b.reshape(-1)).view(len(p.keys), s)  # [Kg, S]
                        flags.update(zip(p.names, none.unbind(0), strict=True))
        return assemble_dense_inputs(
            self.fs,
            batch,
            pooled,
            sequences,
            layout=self.layout,
            pairs=pairs,
            cold=flags if cold else None,
            cold_columns=self.cold_layout,
        )

    # ----------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        """Count hits and misses from now on (e.g. after warm-up, whose ids are synthetic)."""
        self._counts_base = [g.counts.clone() for g in self._groups]
        self._padding = dict.fromkeys(self._padding, 0)

    def discount_padding(self, lookups: dict[str, int]) -> None:
        """Leave ``lookups[table]`` lookups of :data:`PAD_ID` out of the stats: ids that a padded
        batch (:mod:`serve.graphs`) added, counted on the device with the real ones. Host-side
        integers only; tables without stats (dense ones) are ignored."""
        for name, n in lookups.items():
            if name in self._padding:
                self._padding[name] += n

    def stats(self) -> list[TableStats]:
        """Per table in FeatureSet order: rows, bytes per tier, and for dynamic tables hits,
        misses and (CACHING) the hits read from the host tier."""
        since = [g.counts - base for g, base in zip(self._groups, self._counts_base, strict=True)]
        counts = [c.tolist() for c in since]  # a host read a group: per key space its counts
        out = []
        for name, t in self.fs.tables.items():
            g, _ = self._place[name]
            group = self._groups[g]
            rows = group.rows[name]  # a static table holds exactly its keys
            hits, misses, host = 0, 0, 0
            if t.is_dynamic:
                row = counts[g][group.dynamic.index(name)]
                hits, lookups = row[0], row[1]
                pad = self._padding[name]
                hits, lookups = hits - pad * self._zero_hits[name], lookups - pad
                misses = lookups - hits
                if group.tiers is not None:
                    host = row[2] - pad * self._zero_on_host[name]
            hbm, host_bytes = group.table_bytes(name)
            mode = self.placements[name].mode.value if t.is_dynamic else "HBM_ONLY"
            out.append(
                TableStats(
                    name, t.is_dynamic, t.dim, rows, rows, hits, misses, mode, host, hbm, host_bytes
                )
            )
        return out
