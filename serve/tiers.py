"""Serving tables larger than the device: every row in host memory, the hottest in HBM (issue #52).

Where each dynamic table's rows live is planned once per load (:func:`plan_tiers`), as training
plans it (:mod:`shared.hashtable.placement`: its :class:`TablePlacement` lines and
:class:`PlacementError`), from the serving layout's bytes: a table's ``cache_load_factor`` is the
share of its rows whose values stay in HBM. The factor of a table comes from, first to last:

1. ``TierConfig.factors`` (``--cache-load-factor TABLE=F``): the operator's, for this server;
2. the bundle's fg.json (the config's ``cache_load_factor``, which training honoured too);
3. the HBM budget (``TierConfig.hbm_budget``, ``--hbm-budget-gib``): when the tables do not fit
   it HBM-only, one common factor for every table that 1 and 2 leave unset, as tzrec's planner
   does; a budget that cannot hold even a 1 % cache is refused, naming the biggest table;
4. otherwise 1.0: HBM_ONLY, today's path, unchanged.

A table below 1.0 is CACHING, and its lookup group (:mod:`serve.lookup`) is a :class:`TieredRows`:

- **A static hot set, not an LRU cache.** Serving reads only: rows change at a swap or a delta,
  never because of a lookup. So the cache needs no find/insert/evict on the request path, no
  write-back and no host sync; the hottest ``ceil(factor * rows)`` rows of each table are chosen
  once, at load, by the hotness the bundle carries (its ``.scores`` tensors: the training
  table's STEP/TIMESTAMP/LFU score, :meth:`shared.bundle.Bundle.hotness`); a bundle without
  them keeps its first rows, and the log says so.
- **The keys stay on the device** (sorted, ``searchsorted``, as HBM_ONLY: 8 bytes a row), with a
  row → HBM line map (int32, -1: not cached; 4 bytes a row): a lookup needs no host access to
  know where a row is, and the 12 bytes a row are a tenth of a dim-16 row's 64 + 64 bytes of
  values on both tiers. Keeping the index on the host would make every lookup a host round trip.
- **The values of every row live in the host tier**, a
  :class:`~shared.hashtable.host_store.TensorHostStore` (page-locked in place and mapped into
  the device's address space on CUDA), in the sorted keys' order; the HBM matrix holds the hot
  rows' copies, ``[lines, dim]``.
- **Misses are read inside the batch**: one kernel (:mod:`shared.hashtable.cuda.tier_gather`)
  gathers each looked-up row from its HBM line or straight from host memory through UVA, with
  16-byte loads; no copy launched, no host round trip, so the batch stays one CUDA graph. On CPU
  both tiers are RAM and the miss path is an ``index_select`` of the host rows. The rows are
  copies of the same values: scores equal the all-in-HBM server's bit for bit.

What a load shares: one host copy of equal rows per server. The host tiers of every version a
server holds (the served one, the spare of ``--reuse-graphs``, :mod:`serve.spare`, one still
retiring, :mod:`serve.versions`, a delta's rebuild) are known to one :class:`HostTiers`, the
server's (``TierConfig.host``: made with the config, so every load of one server sees it). A
new group's host rows are built as before, then compared bit for bit with every store held:
an equal one is used, the built copy dropped, so two versions of one bundle (the startup
spare is a second load of the first version) or a rebuild whose group the delta left alone
hold one :class:`~shared.hashtable.host_store.TensorHostStore` (pinned and mapped once). The
comparison is by content, not by path or version, so nothing can share rows it does not have;
its price is the built copy during the load (the peak of a load, as before, not the steady
state). A store lives as long as a version holds it (the registry holds versions weakly) and is
freed with the last one. Sharing is per group and all or nothing: a version whose rows differ
in one row holds its own copy (an overlay of changed rows over a shared base would share more,
at the cost of a third source in the gather; not built).

Writes are copy-on-write (:func:`prepare_tiered`): a group whose store no other version holds
is written in place as before, after :meth:`HostTiers.claim` took the store out of sharing (a
load meanwhile cannot pick it up); one whose store is shared gets its own store instead, the
new version's host rows that the update builds anyway, page-locked off the serving path, and
the write between batches swaps it in: the store and, on CUDA, the device cell the gather
kernel reads the rows' address from (``TieredRows.host_at``: a CUDA graph captured the cell,
not the address, so a swap needs no new capture). The other version keeps reading the shared
rows untouched, so a request never sees another version's rows. A store written in place is
not shared again (simple, and a later load of that version only holds a copy of its own, as
before). :attr:`HostTiers.nbytes` is
the host memory of all versions, each store counted once
(``dynrec_serving_host_tier_bytes``); a table's ``host`` bytes are what the served version
reads, shared or not.

Updates (:meth:`serve.lookup.EmbeddingTables.prepare_update`: deltas, and a new version written
into a spare): new values of the same keys are written in place (copy-on-write where the host
tier is shared, above), each changed row into the host tier and, when it has an HBM line, into
that line too (:func:`prepare_tiered`; the hot set stays as chosen at load). An update that adds
or drops keys is refused in place (``InPlaceUnavailableError``): a delta then takes the
rebuild, which builds the patched bundle's tables anew (its hot set the first rows, since the
merged bundle has no scores), and a new version is loaded in full.

Example::

    tiers = TierConfig.from_flags(["user_id_emb=0.1"], hbm_budget_gib=8)
    tables = EmbeddingTables.from_bundle(bundle, device="cuda", tiers=tiers)
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shared.bundle import Bundle
from shared.features import FeatureSet, TableSpec
from shared.hashtable.hashing import check_keys
from shared.hashtable.host_store import TensorHostStore
from shared.hashtable.lookup import StaticLookupTable
from shared.hashtable.placement import (
    GIB,
    MIN_PLANNED_FACTOR,
    PlacementError,
    StorageMode,
    TablePlacement,
)

log = logging.getLogger(__name__)

KEY_BYTES = 8  # a sorted int64 key a row, on the device in both modes
LINE_BYTES = 4  # a CACHING row's int32 HBM line (-1: on the host only)
VALUE_BYTES_PER_DIM = 4  # float32 values (serving holds no optimizer state)


class HostTiers:
    """The host tiers of every version one server holds, so that equal rows are held once
    (module docstring, "What a load shares"). Thread-safe: loads, updates and scrapes may run
    on different threads. Versions are held weakly: a dropped version's store is freed with it
    (with the last version holding it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: weakref.WeakSet[TieredRows] = weakref.WeakSet()
        self._claimed: weakref.WeakSet[TensorHostStore] = weakref.WeakSet()  # written in place

    def attach(
        self, holder: TieredRows, rows: torch.Tensor, *, pin: bool, mapped: bool
    ) -> TensorHostStore:
        """Set ``holder.store`` to a store of rows bit-equal to ``rows`` [C, dim] float32 (one
        held and not claimed: shared), else to a new one over ``rows`` (pinned and mapped as
        asked); under the lock, so no :meth:`claim` misses the holder."""
        with self._lock:
            bits = rows.view(torch.int32)  # bit for bit: -0.0 is not 0.0 here
            for store in self._stores():
                held = store.rows
                if (
                    store not in self._claimed
                    and store.pin == pin
                    and store.mapped == mapped
                    and held.shape == rows.shape
                    and torch.equal(held.view(torch.int32), bits)
                ):
                    break
            else:
                store = TensorHostStore.holding(rows, pin=pin, mapped=mapped)
            holder.store = store
            self._tiers.add(holder)
            return store

    def claim(self, holder: TieredRows) -> bool:
        """Whether ``holder`` may write its store in place: no other version holds it. Then it
        is shared no more (a later load does not pick it up, even before the write)."""
        with self._lock:
            store = holder.store
            if self._holders(store) > 1:
                return False
            self._claimed.add(store)
            return True

    def holders(self, store: TensorHostStore) -> int:
        """How many groups of loaded versions read ``store``."""
        with self._lock:
            return self._holders(store)

    def _holders(self, store: TensorHostStore) -> int:
        """:meth:`holders`, under the lock the caller holds."""
        return sum(t.store is store for t in self._tiers)

    @property
    def copies(self) -> int:
        """Distinct host stores held."""
        with self._lock:
            return len(self._stores())

    @property
    def nbytes(self) -> int:
        """Host bytes of every version's tiers, each store counted once."""
        with self._lock:
            return sum(s.nbytes for s in self._stores())

    def _stores(self) -> list[TensorHostStore]:
        """Each store held once, in the order first held (under the lock)."""
        return list({id(t.store): t.store for t in list(self._tiers)}.values())


# free slots of each HBM_ONLY group's dynamic table, for deltas written in place (serve.delta):
# 10% of its keys by default, at least 1024. A delta is relative to the base, so its new keys are
# those since the base, less the evicted ones (the bench's deltas add 0.5% and evict 0.5%: net
# 0); 10% lasts for many deltas at +10% of the hash tables' memory (and one mask op per lookup).
# A delta that needs more takes the rebuild, which makes new tables with new free slots beside
# the serving version (and captures its CUDA graphs again). A server that follows a trainer from
# its first steps sees its keys grow many times over: --key-headroom.
KEY_HEADROOM = 0.10


@dataclass(frozen=True)
class TierConfig:
    """Where a server's dynamic tables live: per-table factors (beat the bundle's fg.json) and
    a budget of HBM bytes for all tables (None: no budget); ``headroom``: the HBM_ONLY tables'
    free slots for new keys, a fraction of their keys at each build (:data:`KEY_HEADROOM`);
    ``host``: the server's host tiers (:class:`HostTiers`, one per config: the loads made with
    one config share equal rows)."""

    factors: Mapping[str, float] = field(default_factory=dict)
    hbm_budget: int | None = None
    headroom: float = KEY_HEADROOM
    host: HostTiers = field(default_factory=HostTiers, compare=False, repr=False)

    @classmethod
    def from_flags(
        cls,
        factors: Sequence[str],
        hbm_budget_gib: float | None,
        key_headroom: float = KEY_HEADROOM,
    ) -> TierConfig:
        """From ``--cache-load-factor TABLE=F`` (repeated), ``--hbm-budget-gib`` and
        ``--key-headroom``; ValueError naming the bad flag value."""
        parsed: dict[str, float] = {}
        for item in factors:
            name, sep, value = item.partition("=")
            try:
                factor = float(value) if sep and name else math.nan
            except ValueError:
                factor = math.nan
            if not 0.0 < factor <= 1.0:  # also NaN
                raise ValueError(
                    f"--cache-load-factor {item!r}: expected TABLE=F with 0 < F <= 1 (the share "
                    "of the table's rows kept in HBM), e.g. user_id_emb=0.1"
                )
            if name in parsed:
                raise ValueError(f"--cache-load-factor: table {name!r} is given twice")
            parsed[name] = factor
        budget = None
        if hbm_budget_gib is not None:
            if not hbm_budget_gib > 0:
                raise ValueError(f"--hbm-budget-gib must be > 0, got {hbm_budget_gib}")
            budget = int(hbm_budget_gib * GIB)
        if not 0.0 <= key_headroom <= 1000.0:  # also NaN
            raise ValueError(
                f"--key-headroom must be in [0, 1000] (free slots for new keys, a fraction of "
                f"the keys at load), got {key_headroom}"
            )
        return cls(parsed, budget, key_headroom)


def _placement(
    t: TableSpec, rows: int, factor: float, *, planned: bool, headroom: float
) -> TablePlacement:
    """One dynamic table's serving bytes at ``factor``: HBM_ONLY holds its keys and values in
    HBM with the group's free slots for deltas (``headroom``); CACHING its keys and line map in
    HBM, ``ceil(factor * rows)`` rows of values there and every row on the host."""
    caching = factor < 1.0
    slots = rows if caching else rows + math.ceil(rows * headroom)
    return TablePlacement(
        table=t.name,
        mode=StorageMode.CACHING if caching else StorageMode.HBM_ONLY,
        cache_load_factor=factor,
        planned=planned,
        slots=slots,
        dim=t.dim,
        index_bytes=slots * (KEY_BYTES + (LINE_BYTES if caching else 0)),
        value_bytes=slots * t.dim * VALUE_BYTES_PER_DIM,
        counter_bytes=0,  # admission counters stay in training
    )


def plan_tiers(
    fs: FeatureSet,
    rows: Mapping[str, int],
    config: TierConfig,
    *,
    dense_bytes: int,
    headroom: float,
) -> list[TablePlacement]:
    """Every dynamic table's serving placement (module doc for which factor wins). ``rows``:
    keys per dynamic table; ``dense_bytes``: the dense tables' HBM bytes (always on the device,
    counted against the budget). Raises :class:`PlacementError` naming the table and bytes."""
    unknown = sorted(set(config.factors) - {t.name for t in fs.dynamic_tables})
    if unknown:
        raise PlacementError(
            f"--cache-load-factor names {', '.join(map(repr, unknown))}, not a dynamic table of "
            f"the bundle (dynamic tables: {', '.join(t.name for t in fs.dynamic_tables)})"
        )
    plans: list[TablePlacement] = []
    free: list[TableSpec] = []  # tables whose factor the budget may plan
    for t in fs.dynamic_tables:
        assert t.dynamic is not None
        factor = config.factors.get(t.name, t.dynamic.cache_load_factor)
        if factor is None:
            free.append(t)
        plans.append(_placement(t, rows[t.name], factor or 1.0, planned=False, headroom=headroom))
    budget = config.hbm_budget
    total = dense_bytes + sum(p.hbm_bytes for p in plans)
    if budget is None or total <= budget:
        return plans
    fixed = dense_bytes + sum(p.hbm_bytes for p in plans if p.table not in {t.name for t in free})
    cached = {t.name: _placement(t, rows[t.name], 0.0, planned=True, headroom=0) for t in free}
    fixed += sum(p.index_bytes for p in cached.values())
    tiered = sum(p.value_bytes for p in cached.values())
    room = budget - fixed - len(free)  # each table's cached bytes round up by < 1 byte
    factor = math.floor(room / tiered * 100) / 100 if tiered else 0.0
    if factor < MIN_PLANNED_FACTOR:
        biggest = max(plans, key=lambda p: p.hbm_bytes)
        floor = fixed + math.ceil(tiered * MIN_PLANNED_FACTOR)
        raise PlacementError(
            f"the serving tables need {total / GIB:.3f} GiB of HBM as planned and at least "
            f"{floor / GIB:.3f} GiB with a {MIN_PLANNED_FACTOR:.0%} cache of the tables without "
            f"a factor ({len(free)}; dense tables {dense_bytes / GIB:.3f} GiB), but "
            f"--hbm-budget-gib is {budget / GIB:.3f} GiB; the biggest is {biggest.line()}. "
            "Raise the budget, or lower a table's --cache-load-factor"
        )
    by_name = {t.name: t for t in free}
    return [
        _placement(by_name[p.table], rows[p.table], factor, planned=True, headroom=headroom)
        if p.table in by_name
        else p
        for p in plans
    ]


@dataclass(frozen=True)
class _Sorted:
    """A group's fused keys sorted on the device, and every row's values in that order on the
    host, with each table's bundle rows → sorted positions."""

    keys: torch.Tensor  # [C] int64, sorted (device)
    host: torch.Tensor  # [C, dim] float32 (CPU)
    positions: dict[str, torch.Tensor]  # table → [rows] int64 sorted positions of its rows (CPU)


def _sorted_rows(bundle: Bundle, names: Sequence[str], shift: int, device: torch.device) -> _Sorted:
    where = f"tables {', '.join(names)}"
    keys = [bundle.hash_tables[n][0] for n in names]
    fused = check_keys(
        torch.cat([((i << shift) | k).to(device) for i, k in enumerate(keys)]), where
    )
    sorted_keys, order = torch.sort(fused)
    if sorted_keys.numel() > 1:
        dup = torch.nonzero(sorted_keys[1:] == sorted_keys[:-1]).squeeze(1)
        if dup.numel():
            raise ValueError(f"{where}: key {int(sorted_keys[dup[0]])} appears more than once")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    inverse = inverse.cpu()  # bundle row → sorted position
    dim = bundle.hash_tables[names[0]][1].shape[1]
    host = torch.empty(order.numel(), dim, dtype=torch.float32)  # [C, dim]: the host tier
    positions, start = {}, 0
    for name, k in zip(names, keys, strict=True):
        positions[name] = inverse[start : start + k.numel()]
        host.index_copy_(0, positions[name], bundle.hash_tables[name][1].to(torch.float32))
        start += k.numel()
    return _Sorted(sorted_keys, host, positions)


def build_tiered(
    bundle: Bundle,
    names: Sequence[str],
    shift: int,
    factors: Mapping[str, float],
    device: torch.device,
    host: HostTiers,
) -> tuple[StaticLookupTable, TieredRows]:
    """A lookup group's CACHING tables ``names``: their fused keys (key' = (table << shift) |
    key) sorted on ``device`` as a keys-only :class:`StaticLookupTable`, and their values in a
    :class:`TieredRows` in that order, each table's ``ceil(factor * rows)`` hottest in HBM, the
    host rows shared through ``host`` with any version holding the same."""
    rows = _sorted_rows(bundle, names, shift, device)
    hot = [
        rows.positions[n][hot_rows(bundle, n, math.ceil(factors[n] * rows.positions[n].numel()))]
        for n in names
    ]
    index = StaticLookupTable(rows.keys, torch.empty(rows.keys.numel(), 0, device=device))
    return index, TieredRows(rows.host, torch.cat(hot), device, host)


def prepare_tiered(
    index: StaticLookupTable,
    tiers: TieredRows,
    bundle: Bundle,
    names: Sequence[str],
    shift: int,
) -> Callable[[], None]:
    """The writes that make a CACHING group hold ``bundle``'s rows of its tables ``names``:
    each changed row into the host tier and, when it has an HBM line, into that line too (the
    hot set stays as chosen at load). A host tier another version holds is not written: the
    group gets a store of its own, the new rows (copy-on-write, module docstring). Computed
    here, off the serving path; the returned function only writes, between batches. Only for
    the same keys: a bundle that adds or drops a key raises :class:`InPlaceUnavailableError`
    (the tables are rebuilt)."""
    from serve.lookup import InPlaceUnavailableError

    new = _sorted_rows(bundle, names, shift, index.device)
    if new.keys.numel() != index.keys.numel() or not torch.equal(new.keys, index.keys):
        raise InPlaceUnavailableError(
            f"tables {', '.join(names)} are served from the host tier with an HBM cache "
            "(cache_load_factor < 1): rows are written in place there only when the keys stay "
            f"the same, and this update has {new.keys.numel()} keys where {index.keys.numel()} "
            "were, or other ones; the tables are rebuilt"
        )
    changed = torch.nonzero((tiers.store.rows != new.host).any(1)).squeeze(1)  # [M] rows
    values = new.host.index_select(0, changed)  # [M, dim]
    lines = tiers.line_of_row.index_select(0, changed.to(tiers.device)).long()  # [M]
    hot = lines >= 0
    hot_lines, hot_values = lines[hot], values.to(tiers.device)[hot]
    own = None if tiers.host.claim(tiers) else tiers.own_store(new.host)

    def write() -> None:
        if own is None:
            tiers.store.write(changed, values)
        else:
            tiers.use(*own)
        tiers.hot.index_copy_(0, hot_lines, hot_values)

    return write


def hot_rows(bundle: Bundle, table: str, lines: int) -> torch.Tensor:
    """The ``lines`` hottest rows of ``table`` (positions in its bundle order, int64): by the
    bundle's scores (ties: the earlier row), or its first rows when it has none (logged)."""
    scores = bundle.hotness(table)
    if scores is None:
        log.warning(
            "table %s: the bundle has no row scores (exported before them, or a delta changed "
            "its keys): its HBM cache holds its first %d rows, not its hottest",
            table,
            lines,
        )
        return torch.arange(lines, dtype=torch.int64)
    return torch.argsort(scores, descending=True, stable=True)[:lines]


class TieredRows:
    """The values of a lookup group's CACHING tables: every row on the host (sorted-key order),
    the hot rows' copies in an HBM matrix, and the row → line map on the device.

    :meth:`gather` takes each looked-up position's row (-1: no key) and returns its values from
    whichever tier holds them, and whether that was HBM; one kernel on CUDA, two gathers and a
    ``where`` on CPU."""

    def __init__(
        self, host_rows: torch.Tensor, hot: torch.Tensor, device: torch.device, host: HostTiers
    ) -> None:
        """``host_rows`` [C, dim] float32 on the CPU (kept as they are, page-locked on CUDA,
        unless ``host`` holds equal rows: then those); ``hot`` [H] int64 the rows to keep in
        HBM (distinct)."""
        self.device = device
        self.dim = host_rows.shape[1]
        self.host = host
        cuda = device.type == "cuda"
        if cuda:
            from shared.hashtable.cuda import runtime

            reason = runtime.unavailable_reason()
            if reason is not None:
                raise PlacementError(
                    f"a CACHING table on {device} reads its host rows with a CUDA kernel, which "
                    f"cannot run here: {reason}; or serve every table from HBM "
                    "(--cache-load-factor TABLE=1)"
                )
            from shared.hashtable.cuda import tier_gather

            # now, not at the first lookup (which may be inside a graph capture)
            runtime.compile_modules(device, [tier_gather.SOURCE])
        self.store: TensorHostStore  # set by attach, under the registry's lock
        host.attach(self, host_rows, pin=cuda, mapped=cuda)
        # the host rows' device address, in a cell the gather kernel reads (and a CUDA graph
        # captures): a store swapped in (copy-on-write) is one write of the cell, no capture
        self.host_at = self._address(self.store)  # [1] int64 (device); CPU: unused
        hot = torch.sort(hot).values  # lines in row order: neighbouring rows, neighbouring lines
        self.lines = hot.numel()
        self.line_of_row = torch.full((host_rows.shape[0],), -1, dtype=torch.int32, device=device)
        self.line_of_row[hot.to(device)] = torch.arange(
            self.lines, dtype=torch.int32, device=device
        )
        # at least one row, so that a gather of line 0 (clamped misses) is in bounds
        hot_values = host_rows.index_select(0, hot) if self.lines else torch.zeros(1, self.dim)
        self.hot = hot_values.to(device)  # [max(H, 1), dim]

    def _address(self, store: TensorHostStore) -> torch.Tensor:
        """[1] int64 on the device: ``store``'s rows' device address (0 on the CPU)."""
        ptr = store.device_pointer() if self.device.type == "cuda" else 0
        return torch.tensor([ptr], dtype=torch.int64, device=self.device)

    def own_store(self, rows: torch.Tensor) -> tuple[TensorHostStore, torch.Tensor]:
        """A store of this group's own over ``rows`` [C, dim] float32 (page-locked and mapped
        on CUDA) and its address cell, for :meth:`use`: made off the serving path."""
        cuda = self.device.type == "cuda"
        store = TensorHostStore.holding(rows.contiguous(), pin=cuda, mapped=cuda)
        return store, self._address(store)

    def use(self, store: TensorHostStore, address: torch.Tensor) -> None:
        """Read ``store`` from now on (from :meth:`own_store`; between batches): the CPU path
        reads :attr:`store`, the CUDA kernel the address in :attr:`host_at`."""
        self.store = store
        self.host_at.copy_(address)

    @property
    def hbm_bytes(self) -> int:
        """The HBM lines and the line map (the keys are the lookup table's)."""
        return self.lines * self.dim * VALUE_BYTES_PER_DIM + self.line_of_row.numel() * LINE_BYTES

    @property
    def host_bytes(self) -> int:
        return self.store.nbytes

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` [N] int64 → (values [N, dim], [N] bool: the row was in HBM). A position
        with no key (-1) gets zeros on CUDA, row 0's values on CPU: the caller masks it. No host
        sync."""
        row = idx.clamp(min=0)
        line = self.line_of_row.index_select(0, row)  # [N] int32
        in_hbm = line >= 0
        if self.device.type == "cuda":
            from shared.hashtable.cuda import tier_gather

            out = torch.empty(idx.numel(), self.dim, device=self.device)
            tier_gather.gather(self.hot, self.host_at, idx, self.line_of_row, out)
            return out, in_hbm
        hot = self.hot.index_select(0, line.clamp(min=0).long())  # [N, dim]
        cold = self.store.rows.index_select(0, row)  # [N, dim]: the same RAM
        return torch.where(in_hbm.unsqueeze(1), hot, cold), in_hbm

    def in_hbm(self, row: int) -> bool:
        """Whether row ``row`` has an HBM line (a host read; for bookkeeping, not lookups)."""
        return bool(self.line_of_row[row] >= 0)
