"""Full buckets at max capacity on CUDA (kernels.cu ``ht_ins2_over``) against the torch backend.

Each test runs the same inserts on a table with a ``CudaBackend`` and on a copy with a
``TorchBackend`` and asks for equal results (rows, inserted, evicted keys and table ids in
order, refusals) and equal tables (every slot, row, key, table id, score, value, accumulator,
bucket count and counter) after each call. The batches are built bucket by bucket: many buckets
receive more new keys than they hold (up to twice: the staging list), scores come from a small
range (ties between newcomers and stored keys), and stored keys of the batch are pinned. The
last test trains a fused storage at max capacity with a full admission counter (issue #18's
steady state) under both backends. Run on
the GPU machine: ``python3 -m pytest -q -m gpu tests/shared/hashtable/test_cuda_overflow.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.cuda.backend import CudaBackend
from shared.hashtable.hashing import bucket_of, fingerprint
from shared.hashtable.static_insert import DeviceCounts
from shared.hashtable.storage import FusedStorage, LookupPlan
from shared.hashtable.table import HashTable, InsertResult
from shared.hashtable.torch_backend import TorchBackend

from .conftest import CUDA_KERNELS, dyn_table
from .test_cuda_kernels import _assert_scratch_clear
from .test_cuda_unique import PLAN_TENSORS

pytestmark = CUDA_KERNELS

DEVICE = "cuda"
TORCH = TorchBackend()
STATE: tuple[str, ...] = ("_slot_fp", "_slot_row", "_row_key", "_row_tid", "_row_score")
STATE += ("_values", "_accum", "_bucket_count", "_sentinel")
COUNTERS = ("size", "num_buckets", "evictions", "refusals", "generation")
STRATEGIES = [
    ScoreStrategy.LFU,
    ScoreStrategy.STEP,
    ScoreStrategy.TIMESTAMP,
    ScoreStrategy.NO_EVICTION,
]


def _assert_same_table(a: HashTable, b: HashTable) -> None:
    for f in STATE:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), f
    for f in COUNTERS:
        assert getattr(a, f) == getattr(b, f), f
    assert a._any_tid or not b._any_tid  # never lazier than the torch backend (eager is safe)


def _assert_same_result(got: InsertResult, want: InsertResult) -> None:
    for f in ("rows", "inserted", "evicted_keys", "evicted_table_ids"):
        x, y = getattr(got, f), getattr(want, f)
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), f
    assert got.num_refused == want.num_refused


def _new_keys(
    table: HashTable, per_bucket: torch.Tensor, g: torch.Generator, with_tids: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``per_bucket[b]`` random keys (table ids in 0..2 when ``with_tids``) of each bucket ``b``,
    not stored in ``table``, in random order."""
    nb = table.num_buckets
    pool = 8 * int(per_bucket.sum()) + 64 * nb
    keys = torch.randint(0, 1 << 62, (pool,), generator=g)
    tids = torch.randint(0, 3, (pool,), generator=g) if with_tids else None
    keep = ~table.find(keys.to(DEVICE), None if tids is None else tids.to(DEVICE))[1].cpu()
    idx = torch.nonzero(keep).squeeze(1)
    bucket = bucket_of(fingerprint(keys[idx], None if tids is None else tids[idx]), nb)
    order = torch.sort(bucket, stable=True).indices
    idx, bucket = idx[order], bucket[order]
    counts = torch.bincount(bucket, minlength=nb)
    rank = torch.arange(idx.numel()) - (torch.cumsum(counts, 0) - counts)[bucket]
    assert bool((counts >= per_bucket).all()), "pool too small"
    idx = idx[rank < per_bucket[bucket]]
    idx = idx[torch.randperm(idx.numel(), generator=g)]
    return keys[idx], None if tids is None else tids[idx]


Batch = Callable[[HashTable, int, torch.Generator], dict]


def _run(
    table: HashTable,
    steps: int,
    make: Batch,
    *,
    want_paths: set[str],
    fast: list[int] | None = None,
) -> list[str]:
    """``steps`` inserts from ``make`` on ``table`` (a CUDA backend) and on a torch-backend
    copy: equal results and tables after each. Returns the CUDA backend's paths, in order;
    ``fast`` gets, for each overflow call, the buckets ``ht_ins2_over``'s fast path took."""
    from shared.hashtable.cuda import insert

    core = table.to(table.device, backend=TORCH)
    backend = table.backend
    assert isinstance(backend, CudaBackend)
    paths: list[str] = []
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        kw = make(core, step, g)
        if kw.pop("pin", False):
            tids = kw.get("table_ids")
            head = None if tids is None else tids[:40]
            rows = core.find(kw["keys"][:40], head)[0]
            kw["pinned_rows"] = rows[rows >= 0]
        want = core.insert_or_assign(**kw)
        before = backend.paths.copy()
        got = table.insert_or_assign(**kw)
        (path,) = backend.paths - before
        paths.append(path.removeprefix("insert."))
        if fast is not None and paths[-1] == "overflow":
            fast.append(int(insert._scratch[table].host[insert.ST_OV_FAST]))
        _assert_scratch_clear(table)
        _assert_same_result(got, want)
        _assert_same_table(table, core)
    assert set(paths) <= want_paths, paths
    return paths


def _table(dim: int, nb: int, bc: int, strategy: ScoreStrategy, accum: bool) -> HashTable:
    return HashTable(
        dim,
        init_capacity=nb * bc,
        max_capacity=nb * bc,
        bucket_capacity=bc,
        score_strategy=strategy,
        with_accumulator=accum,
        initial_accumulator_value=0.5,
        device=DEVICE,
        backend=CudaBackend(),
    )


def _batches(
    bc: int,
    dim: int,
    with_tids: bool,
    accum: bool,
    pin: bool,
    scores: int,
    *,
    full_from: float = 0.5,
    max_new: int | None = None,
) -> Batch:
    """Step 0 fills every bucket to between ``full_from`` and all of its capacity; later steps
    give each bucket 0 .. ``max_new`` (default 2 * bc - 2) new keys (a duplicate of one of
    them), stored keys of the table (the first ones pinned when ``pin``) and scores in 0 ..
    ``scores`` - 1."""

    def make(core: HashTable, step: int, g: torch.Generator) -> dict:
        nb = core.num_buckets
        if step == 0:
            per = torch.randint(int(bc * full_from), bc + 1, (nb,), generator=g)
        else:
            top = 2 * bc - 2 if max_new is None else max_new
            per = torch.randint(0, top + 1, (nb,), generator=g)
        keys, tids = _new_keys(core, per, g, with_tids)
        bucket = bucket_of(fingerprint(keys, tids), nb)
        by_bucket = torch.sort(bucket, stable=True).indices
        sb = bucket[by_bucket]
        first = torch.ones_like(sb, dtype=torch.bool)
        first[1:] = sb[1:] != sb[:-1]
        dup = by_bucket[first][::2]  # one new key of every other bucket with new keys
        live = torch.nonzero(core.row_keys.cpu() >= 0).squeeze(1)
        stored = live[torch.randperm(live.numel(), generator=g)[: min(live.numel(), 3 * nb)]]
        s_keys = core.row_keys.cpu()[stored]
        s_tids = core.row_table_ids.cpu()[stored].to(torch.int64)
        keys = torch.cat([s_keys, keys, keys[dup]])
        if tids is not None:
            tids = torch.cat([s_tids, tids, tids[dup]])
        n = keys.numel()
        out: dict = {
            "keys": keys,
            "values": torch.randn(n, dim, generator=g),
            "scores": torch.randint(0, scores, (n,), generator=g),
            "pin": pin and step % 2 == 1,
        }
        if tids is not None:
            out["table_ids"] = tids
        if accum and step % 2 == 0:
            out["accumulators"] = torch.rand(n, dim, generator=g)
        return out

    return make


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("dim", [0, 16])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "tids+accum"])
def test_full_buckets_give_the_torch_table(
    strategy: ScoreStrategy, pin: bool, dim: int, extras: bool
) -> None:
    bc = 16
    t = _table(dim, 48, bc, strategy, accum=extras and dim > 0)
    make = _batches(bc, dim, with_tids=extras, accum=extras, pin=pin, scores=4)
    paths = _run(t, 6, make, want_paths={"fast", "overflow"})
    assert paths.count("overflow") >= 4
    if strategy is ScoreStrategy.NO_EVICTION:
        assert t.evictions == 0 and t.refusals > 0
    else:
        assert t.evictions > 0 and t.refusals > 0


@pytest.mark.parametrize("bc", [7, 33, 128])
def test_full_buckets_of_other_capacities(bc: int) -> None:
    """Capacities that are not whole warps, and the trainer's 128 (dim 8: float4 copies)."""
    t = _table(8, 24, bc, ScoreStrategy.STEP, accum=True)
    make = _batches(bc, 8, with_tids=True, accum=True, pin=True, scores=3)
    assert _run(t, 5, make, want_paths={"fast", "overflow"}).count("overflow") >= 3


def test_full_buckets_of_the_admission_counter() -> None:
    """dim 0 and bucket capacity 1024 (the counter's default): 93 KiB of shared memory a block,
    above the default 48 KiB (the opt-in), 1024 threads a block."""
    bc = 1024
    t = _table(0, 4, bc, ScoreStrategy.LFU, accum=False)
    make = _batches(bc, 0, with_tids=False, accum=False, pin=True, scores=5)
    assert _run(t, 4, make, want_paths={"fast", "overflow"}).count("overflow") >= 2


@pytest.mark.parametrize("bc, nb", [(1024, 6), (16, 48)])
@pytest.mark.parametrize("strategy", [ScoreStrategy.LFU, ScoreStrategy.NO_EVICTION], ids=str)
def test_full_buckets_with_few_newcomers_take_the_fast_path(
    bc: int, nb: int, strategy: ScoreStrategy
) -> None:
    """Training's steady state: full buckets that each get a few new keys (up to 80 in buckets
    of 1024: some past HT_OVER_FAST_M = 64 take the general path in the same call), score ties,
    pinned keys. ht_ins2_over's fast path (no block sorts) gives the torch table too."""
    dim = 0 if bc == 1024 else 16
    t = _table(dim, nb, bc, strategy, accum=dim > 0)
    top = min(80, 2 * bc - 2)  # the staging list holds 2 * bc - 1
    make = _batches(bc, dim, with_tids=True, accum=dim > 0, pin=True, scores=3, full_from=1.0,
                    max_new=top)  # fmt: skip
    fast: list[int] = []
    paths = _run(t, 6, make, want_paths={"fast", "overflow"}, fast=fast)
    assert paths.count("overflow") >= 4
    assert sum(fast) > 0, fast  # some buckets took the fast path
    if bc == 1024:  # and some the general one: buckets past 64 newcomers, the calls' total
        assert sum(fast) < nb * paths.count("overflow"), fast


def test_equal_fingerprints_and_scores() -> None:
    """Stored keys and newcomers sharing a fingerprint (and a score): the merge's last tie-break
    (torch's stable column order) decides who stays and the slot order."""
    from .test_cuda_kernels import _collision_keys

    pairs = _collision_keys(200)  # keys 2i and 2i + 1 share a fingerprint
    t = _table(2, 16, 4, ScoreStrategy.STEP, accum=False)

    def make(core: HashTable, step: int, g: torch.Generator) -> dict:
        if step == 0:
            keys = pairs[0::2][:40]
        elif step == 1:
            keys = pairs[1::2][:40]
        else:
            keys = pairs[torch.randperm(pairs.numel(), generator=g)[:60]]
        n = keys.numel()
        return {
            "keys": keys,
            "values": torch.randn(n, 2, generator=g),
            "scores": torch.full((n,), 1) if step < 2 else torch.randint(0, 2, (n,), generator=g),
            "pin": step == 3,
        }

    paths = _run(t, 6, make, want_paths={"fast", "overflow", "abort"})
    assert "overflow" in paths


def test_the_torch_fallback_where_shared_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """_hand_over's fallback (an ht_ins2_over block that does not fit): the torch backend's
    insert_overflow, the same table."""
    from shared.hashtable.cuda import insert

    monkeypatch.setattr(insert, "_over_smem", lambda bc, S: 1 << 30)
    t = _table(4, 16, 16, ScoreStrategy.STEP, accum=True)
    make = _batches(16, 4, with_tids=True, accum=True, pin=True, scores=3)
    assert _run(t, 4, make, want_paths={"fast", "overflow"}).count("overflow") >= 2


def test_the_overflow_kernel_is_one_extra_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert with full buckets reads the host twice (the stats after place, then the
    overflow stats) and never runs the torch backend's insert_overflow."""
    from shared.hashtable.cuda import insert

    def boom(*args: object, **kw: object) -> None:
        raise AssertionError("the torch insert_overflow ran")

    t = _table(4, 16, 16, ScoreStrategy.STEP, accum=False)
    backend = t.backend
    assert isinstance(backend, CudaBackend)
    monkeypatch.setattr(CudaBackend, "insert_overflow", boom)
    syncs: list[int] = []
    real = torch.cuda.Event.synchronize

    def counted(self: torch.cuda.Event) -> None:
        syncs.append(1)
        real(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    make = _batches(16, 4, with_tids=False, accum=False, pin=False, scores=3)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        kw = make(t, step, g)
        kw.pop("pin")
        syncs.clear()
        before = backend.paths.copy()
        t.insert_or_assign(**kw)
        (path,) = backend.paths - before
        assert len(syncs) == (2 if path == "insert.overflow" else 1), path
    assert backend.paths["insert.overflow"] >= 1
    assert insert.SIGNATURES["ht_ins2_over"]  # the launch's signature (checked on CPU too)


def _full_storage(backend: CudaBackend | TorchBackend, strategy: ScoreStrategy) -> FusedStorage:
    """3 fused tables (2304 rows at most in all, buckets of 64) with admission (threshold 2)
    and a counter of 768 slots: both fill up within a few steps of :func:`_train_step`."""
    specs = [
        dyn_table(f"t{i}", dim=8, max_capacity=512 + 256 * i, init_capacity=256,
                  bucket_capacity=64, strategy=strategy, threshold=2, counter_capacity=256)
        for i in range(3)
    ]  # fmt: skip
    return FusedStorage(
        "g", specs, adagrad=AdagradConfig(0.05), seed=3, device=torch.device(DEVICE),
        backend=backend,
    )  # fmt: skip


def _train_step(storage: FusedStorage, step: int) -> LookupPlan:
    """One training lookup and backward: 3000 skewed keys a step over 3 tables, drifting."""
    g = torch.Generator().manual_seed(step)
    sizes = [1500, 1000, 500]
    parts = [
        (t, (torch.randint(0, 20000, (n,), generator=g) ** 2 // 20000 + 41 * step).to(DEVICE))
        for t, n in enumerate(sizes)
    ]
    plan = storage.lookup(parts, train=True, score_now=step)
    storage.apply_gradients(plan, torch.randn(sum(sizes), storage.dim, generator=g).to(DEVICE))
    return plan


@pytest.mark.parametrize("strategy", [ScoreStrategy.LFU, ScoreStrategy.STEP], ids=lambda s: s.name)
def test_training_at_max_capacity_with_a_full_counter(strategy: ScoreStrategy) -> None:
    """Issue #18's steady state: a full table evicting, a full admission counter; the counter's
    erase of admitted keys (count=False) and the overflow of both (exact=False) read nothing on
    the host in the lookup: their counts are still pending after it, and reach the sizes and
    counters when read. Every plan, table, counter table, size, counter and stats() equals the
    torch backend's."""
    kernels = CudaBackend()
    got, want = _full_storage(kernels, strategy), _full_storage(TORCH, strategy)
    deferred = pending_table = 0
    for step in range(24):
        w, x = _train_step(want, step), _train_step(got, step)
        for f in PLAN_TENSORS:
            assert torch.equal(getattr(x, f), getattr(w, f)), (step, f)
        assert (x.updated, x.max_count, x.generation) == (w.updated, w.max_count, w.generation)
        assert got.counter is not None and want.counter is not None
        erased = kernels.paths["erase.deferred"] - deferred
        deferred += erased
        # not read yet: the counter's erase (its overflow was settled when the erase used the
        # scratch), the table's overflow
        assert erased <= 1 and len(got.counter.table._pending) in ({1} if erased else {0, 1})
        assert len(got.table._pending) <= 1
        pending_table += len(got.table._pending)
        assert "erase.kernel" not in kernels.paths and "erase.torch" not in kernels.paths
        _assert_same_table(got.table, want.table)
        _assert_same_table(got.counter.table, want.counter.table)  # reads the size: settled
        assert got.counter.table._pending == []
        assert got.counter.evictions == want.counter.evictions
        assert torch.equal(got._counts.cpu(), want._counts.cpu()) and got._lookups == want._lookups
    for t in range(3):
        assert got.stats()[t] == want.stats()[t], t
    assert got.table.num_buckets == got.table._max_buckets and got.table.evictions > 0
    assert got.counter.evictions > 0 and got.counter.size > got.counter.capacity // 2
    assert deferred >= 12 and pending_table >= 12 and kernels.paths["insert.overflow"] >= 12


def test_padded_evictions_read_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """exact=False (the storage's inserts): the overflow's stats are not read (one event wait,
    the place stats'); the evictions come padded with -1, num_refused -1, the counts pending
    until read; what remains equals the torch backend's exact result and table."""
    t = _table(4, 16, 16, ScoreStrategy.STEP, accum=False)
    core = t.to(t.device, backend=TORCH)
    backend = t.backend
    assert isinstance(backend, CudaBackend)
    syncs: list[int] = []
    real = torch.cuda.Event.synchronize

    def counted(self: torch.cuda.Event) -> None:
        syncs.append(1)
        real(self)

    make = _batches(16, 4, with_tids=True, accum=False, pin=True, scores=3)
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        kw = make(core, step, g)
        if kw.pop("pin"):
            rows = core.find(kw["keys"][:40], kw["table_ids"][:40])[0]
            kw["pinned_rows"] = rows[rows >= 0]
        want = core.insert_or_assign(**kw)
        before = backend.paths.copy()
        with monkeypatch.context() as mp:
            mp.setattr(torch.cuda.Event, "synchronize", counted)
            syncs.clear()
            got = t.insert_or_assign(**kw, exact=False)
            (path,) = backend.paths - before
            assert len(syncs) == 1, path  # the place stats only: none for the overflow
        over = path == "insert.overflow"
        assert len(t._pending) == over and got.num_refused == (-1 if over else want.num_refused)
        n = want.evicted_keys.numel()
        for f in ("evicted_keys", "evicted_table_ids"):
            x, y = getattr(got, f), getattr(want, f)
            assert torch.equal(x[:n], y) and bool((x[n:] == -1).all()), f
        _assert_same_result(
            InsertResult(got.rows, got.inserted, want.evicted_keys, want.evicted_table_ids,
                         want.num_refused), want,
        )  # fmt: skip
        _assert_scratch_clear(t)
        _assert_same_table(t, core)  # reads size, evictions, refusals: settled
        assert t._pending == []
    assert backend.paths["insert.overflow"] >= 3 and t.evictions > 0


def _selected_batch(
    core: HashTable, bc: int, dim: int, g: torch.Generator, with_tids: bool
) -> dict[str, torch.Tensor]:
    """A static call's inputs: new distinct keys (0 .. 2 * bc - 1 a bucket) interleaved with
    keys that must take no part (stored keys, copies of the new ones), ``sel`` the new ones."""
    per = torch.randint(0, 2 * bc, (core.num_buckets,), generator=g)
    new, new_tids = _new_keys(core, per, g, with_tids)
    live = torch.nonzero(core.row_keys.cpu() >= 0).squeeze(1)
    stored = live[torch.randperm(live.numel(), generator=g)[:64]]
    s_tids = core.row_table_ids.cpu()[stored].to(torch.int64)
    keys = torch.cat([new, core.row_keys.cpu()[stored], new[:32]])
    tids = None if new_tids is None else torch.cat([new_tids, s_tids, new_tids[:32]])
    sel = torch.zeros(keys.numel(), dtype=torch.bool)
    sel[: new.numel()] = True
    perm = torch.randperm(keys.numel(), generator=g)
    n = keys.numel()
    out = {
        "keys": keys[perm],
        "sel": sel[perm],
        "values": torch.randn(n, dim, generator=g),
        "scores": torch.randint(0, 4, (n,), generator=g),
        "pinned": stored[: live.numel() // 8],  # rows that must not be evicted
    }
    if tids is not None:
        out["table_ids"] = tids[perm]
    return out


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize(
    "strategy", [ScoreStrategy.LFU, ScoreStrategy.STEP, ScoreStrategy.NO_EVICTION],
    ids=lambda s: s.name,
)  # fmt: skip
@pytest.mark.parametrize("dim, extras", [(0, False), (16, True)], ids=["counter", "tids+accum"])
def test_the_static_insert_gives_the_torch_table(
    strategy: ScoreStrategy, dim: int, extras: bool, captured: bool
) -> None:
    """insert.insert_selected (a captured training step's insert: a mask, no host read) on a
    table at max capacity = the torch backend's insert_or_assign of the selected keys: rows,
    inserted, the table, its size, evictions (and their table ids) and refusals; replayed from
    a CUDA graph with new inputs each step when ``captured``."""
    from shared.hashtable.cuda import insert

    bc, nb = 16, 48
    table = _table(dim, nb, bc, strategy, accum=extras)
    core = table.to(table.device, backend=TORCH)
    g = torch.Generator().manual_seed(11)
    fill = _batches(bc, dim, with_tids=extras, accum=False, pin=False, scores=4)(core, 0, g)
    for t in (core, table):
        t.insert_or_assign(**{k: v for k, v in fill.items() if k != "pin"})
    batches = [_selected_batch(core, bc, dim, g, extras) for _ in range(4)]
    n = max(b["keys"].numel() for b in batches)
    buf = {  # a graph's inputs: fixed tensors, each step copied in (padding unselected)
        "keys": torch.zeros(n, dtype=torch.int64, device=DEVICE),
        "table_ids": torch.zeros(n, dtype=torch.int64, device=DEVICE) if extras else None,
        "values": torch.zeros(n, dim, device=DEVICE),
        "scores": torch.zeros(n, dtype=torch.int64, device=DEVICE),
        "sel": torch.zeros(n, dtype=torch.bool, device=DEVICE),
        "pinned": torch.zeros(table.capacity, dtype=torch.bool, device=DEVICE),
    }

    counts = DeviceCounts(table)  # the table's counts arrive as a static step's do

    def call() -> object:
        out = insert.insert_selected(
            table, buf["keys"], buf["table_ids"], buf["values"], buf["scores"], buf["sel"],
            buf["pinned"],
        )  # fmt: skip
        if out is not None:
            counts.add(*out.counts.unbind())
        return out

    graph, out = None, None
    for step, bt in enumerate(batches):
        m = bt["keys"].numel()
        for name in ("keys", "values", "scores", "sel", "table_ids"):
            if buf[name] is not None:
                buf[name].zero_()
                buf[name][:m].copy_(bt[name])
        buf["pinned"].zero_()
        buf["pinned"][bt["pinned"].to(DEVICE)] = True
        sel = bt["sel"]
        kw = {"table_ids": bt["table_ids"][sel]} if extras else {}
        counts.register()  # pending: the call must not settle it (a host read)
        want = core.insert_or_assign(
            bt["keys"][sel], bt["values"][sel], bt["scores"][sel],
            pinned_rows=bt["pinned"].to(DEVICE), **kw,
        )  # fmt: skip
        if not captured:
            out = call()
        elif graph is None:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = call()
            graph.replay()  # capturing ran nothing
        else:
            graph.replay()
            counts.register()  # the replay added on the device
        assert out is not None, f"step {step}: the kernels did not take the call"
        rows, inserted, _, ev_tids, failed = out  # type: ignore[misc]
        assert not bool(failed)
        assert torch.equal(rows[:m][sel.to(DEVICE)].cpu(), want.rows.cpu()), f"step {step} rows"
        assert bool((rows[:m][~sel.to(DEVICE)] == -1).all()) and bool((rows[m:] == -1).all())
        assert torch.equal(inserted[:m][sel.to(DEVICE)].cpu(), want.inserted.cpu())
        assert not bool(inserted[:m][~sel.to(DEVICE)].any())
        got = (table.size, table.evictions, table.refusals)
        assert got == (core.size, core.evictions, core.refusals), f"step {step} counts"
        got_tids = torch.sort(ev_tids[ev_tids >= 0].cpu()).values
        assert torch.equal(got_tids, torch.sort(want.evicted_table_ids.cpu()).values)
        for f in STATE:
            x, y = getattr(table, f), getattr(core, f)
            assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), f"step {step} {f}"
        _assert_scratch_clear(table)
        sc = insert._scratch[table]
        assert bool((sc.stats == 0).all())
    assert strategy is ScoreStrategy.NO_EVICTION or core.evictions > 0
    assert core.refusals > 0
