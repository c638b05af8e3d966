"""The CuPy kernels (shared/hashtable/cuda) against the torch core on the same inputs.

Each test runs the kernel and the torch core (``cuda.disabled()``) on the same CUDA tables and
asks for equal results and equal tables (every slot, row, key, score and value): find gives
identical rows, build and insert identical key sets and rows. Run on the GPU machine:
``python3 -m pytest -q -m gpu tests/shared/hashtable``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable import cuda
from shared.hashtable.hashing import mix64_int, to_signed
from shared.hashtable.table import HashTable, InsertResult

from .test_table import _unmix64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        cuda.unavailable_reason() is not None,
        reason=f"needs CUDA and CuPy: {cuda.unavailable_reason()}",
    ),
]

DEVICE = "cuda"  # the device the tables live on (tests call the kernel modules directly)
STATE = ("_slot_fp", "_slot_row", "_row_key", "_row_tid", "_row_score", "_values", "_accum")
STATE += ("_bucket_count",)
COUNTERS = ("size", "num_buckets", "evictions", "refusals", "generation", "_max_buckets")


def _assert_same_table(a: HashTable, b: HashTable) -> None:
    for f in STATE:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), f
    for f in COUNTERS:
        assert getattr(a, f) == getattr(b, f), f


def _random_keys(n: int, seed: int, high: int = 1 << 62) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keys = torch.unique(torch.randint(0, high, (n + n // 10 + 10,), generator=g))
    return keys[torch.randperm(keys.numel(), generator=g)[:n]]


def _collision_keys(count: int) -> torch.Tensor:
    """Pairs of keys with one fingerprint (their mixes differ only in the lowest bit)."""
    out: list[int] = []
    k1 = 1000
    while len(out) < 2 * count:
        k2 = _unmix64(mix64_int(k1) ^ 1)
        if k2 < 1 << 63:
            out += [k1, to_signed(k2)]
        k1 += 1
    return torch.tensor(out)


def _core_table(keys: torch.Tensor, dim: int, bc: int, lf: float, tids=None) -> HashTable:
    """A table filled by the torch core: a bulk build, then inserts and erases that move rows."""
    n = keys.numel()
    g = torch.Generator().manual_seed(n)
    vals = torch.randn(n, dim, generator=g)
    half = n // 2
    with cuda.disabled():
        t = HashTable.from_keys_values(
            keys[:half],
            vals[:half],
            bucket_capacity=bc,
            device=DEVICE,
            table_ids=None if tids is None else tids[:half],
            max_load_factor=lf,
            max_capacity=4 * n,
        )
        t.insert_or_assign(
            keys[half:],
            vals[half:],
            torch.arange(n - half),
            table_ids=None if tids is None else tids[half:],
        )
        t.erase(keys[: n // 8], None if tids is None else tids[: n // 8])
    return t


def _kernel_find(t: HashTable, keys, tids=None, window=None):
    k, tt = t._prepare(keys, tids, "test", validate=False)
    from shared.hashtable.cuda.find import find

    return find(t, k, tt, probe_window=window)


@pytest.mark.parametrize("bc,lf", [(128, 0.5), (128, 0.9), (16, 0.7), (7, 0.5), (1, 0.5)])
@pytest.mark.parametrize("fused", [False, True])
def test_find_gives_the_core_rows(bc: int, lf: float, fused: bool):
    keys = torch.cat([_random_keys(3000, seed=bc), _collision_keys(50)])
    tids = torch.randint(0, 3, keys.shape, generator=torch.Generator().manual_seed(2))
    t = _core_table(keys, 4, bc, lf, tids if fused else None)
    absent = _random_keys(500, seed=99, high=1 << 40) + (1 << 61)
    query = torch.cat([keys, absent, keys.flip(0), torch.tensor([-1, -5, 0])])
    qt = torch.cat([tids, torch.zeros(500, dtype=torch.int64), tids.flip(0), tids[:3]])
    qt = qt if fused else None
    with cuda.disabled():
        want_rows, want_found = t.find(query, qt, validate=False)
    assert 0 < int(want_found.sum()) < query.numel()
    from shared.hashtable.cuda.runtime import FIND_WINDOWS

    for w in FIND_WINDOWS:
        rows, found = _kernel_find(t, query, qt, window=w)
        assert torch.equal(rows.cpu(), want_rows.cpu()), w
        assert torch.equal(found.cpu(), want_found.cpu()), w


def test_find_dispatches_to_the_kernel_on_cuda():
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("dispatch needs a CUDA table")
    keys = _random_keys(1000, seed=5)
    t = _core_table(keys, 2, 128, 0.5)
    rows, found = t.find(keys)
    with cuda.disabled():
        want = t.find(keys)
    assert torch.equal(rows, want[0]) and torch.equal(found, want[1])


def _build_both(**kw) -> tuple[HashTable | None, HashTable]:
    from shared.hashtable.cuda.build import from_keys_values

    with cuda.disabled():
        want = HashTable.from_keys_values(**kw)
    kw = dict(kw)
    kw.setdefault("bucket_capacity", 128)
    kw.setdefault("scores", None)
    kw.setdefault("table_ids", None)
    kw.setdefault("accumulators", None)
    kw.setdefault("max_load_factor", 0.5)
    kw.setdefault("max_capacity", None)
    kw.setdefault("score_strategy", ScoreStrategy.STEP)
    kw["device"] = torch.device(kw["device"])
    return from_keys_values(HashTable, **kw), want


@pytest.mark.parametrize("bc", [128, 16, 7])
@pytest.mark.parametrize("extras", [False, True])
def test_build_gives_the_core_table(bc: int, extras: bool):
    keys = torch.cat([_random_keys(5000, seed=bc), _collision_keys(30)])
    n = keys.numel()
    g = torch.Generator().manual_seed(3)
    kw: dict = {"keys": keys, "values": torch.randn(n, 5, generator=g), "device": DEVICE}
    kw["bucket_capacity"] = bc
    if extras:
        kw["scores"] = torch.randint(0, 100, (n,), generator=g)
        kw["table_ids"] = torch.randint(0, 4, (n,), generator=g)
        kw["accumulators"] = torch.rand(n, 5, generator=g)
    got, want = _build_both(**kw)
    assert got is not None
    _assert_same_table(got, want)
    assert got._any_tid == want._any_tid


def test_build_doubles_overflowing_buckets_like_the_core():
    keys = _random_keys(4000, seed=7)
    got, want = _build_both(
        keys=keys, values=torch.ones(4000, 1), device=DEVICE, bucket_capacity=4, max_load_factor=1.0
    )
    assert got is not None and want.num_buckets > 1000  # 4000 keys / 4 slots, doubled
    _assert_same_table(got, want)


def test_build_reports_the_core_errors():
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("dispatch needs CUDA")
    with pytest.raises(ValueError, match="key 5 appears more than once"):
        HashTable.from_keys_values(torch.tensor([5, 6, 5]), torch.zeros(3, 2), device=DEVICE)
    with pytest.raises(ValueError, match="key -3 at position 1 is negative"):
        HashTable.from_keys_values(torch.tensor([5, -3]), torch.zeros(2, 2), device=DEVICE)


def test_build_dispatches_to_the_kernel_on_cuda():
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("dispatch needs CUDA")
    keys = _random_keys(20000, seed=8)
    vals = torch.randn(20000, 16)
    got = HashTable.from_keys_values(keys, vals, device=DEVICE)
    with cuda.disabled():
        want = HashTable.from_keys_values(keys, vals, device=DEVICE)
    _assert_same_table(got, want)


def _insert_pair(
    kernel: HashTable, core: HashTable, used: list[bool], **kw
) -> tuple[InsertResult, InsertResult]:
    from shared.hashtable.cuda.insert import insert_or_assign

    with cuda.disabled():
        want = core.insert_or_assign(**kw)
    got = insert_or_assign(
        kernel,
        kw["keys"],
        kw["values"],
        kw["scores"],
        table_ids=kw.get("table_ids"),
        accumulators=kw.get("accumulators"),
        pinned_rows=kw.get("pinned_rows"),
    )
    used.append(got is not None)
    if got is None:  # the kernel path hands growth and skewed batches to the torch core
        with cuda.disabled():
            got = kernel.insert_or_assign(**kw)
    return got, want


def _assert_same_result(got: InsertResult, want: InsertResult) -> None:
    for f in ("rows", "inserted", "evicted_keys", "evicted_table_ids"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu()), f
    assert got.num_refused == want.num_refused


Batch = Callable[[int, torch.Generator], dict]


def _run_script(table: HashTable, batches: int, make: Batch) -> list[bool]:
    kernel, core = table, copy.deepcopy(table)
    used: list[bool] = []
    g = torch.Generator().manual_seed(11)
    for step in range(batches):
        kw = make(step, g)
        if kw.pop("pin", False):
            with cuda.disabled():
                kw["pinned_rows"] = core.find(kw["keys"][:20], kw.get("table_ids", None))[0]
            kw["pinned_rows"] = kw["pinned_rows"][kw["pinned_rows"] >= 0]
        got, want = _insert_pair(kernel, core, used, **kw)
        _assert_same_result(got, want)
        _assert_same_table(kernel, core)
    return used


def _batch(n: int, dim: int, universe: int, g: torch.Generator, **extra) -> dict:
    keys = torch.randint(0, universe, (n,), generator=g) * 7919 + 3  # with duplicates
    return {
        "keys": keys,
        "values": torch.randn(n, dim, generator=g),
        "scores": torch.randint(0, 50, (n,), generator=g),
        **extra,
    }


@pytest.mark.parametrize("bc", [128, 16])
def test_insert_without_growth_gives_the_core_table(bc: int):
    t = HashTable(4, init_capacity=8192, max_capacity=8192, bucket_capacity=bc, device=DEVICE)
    used = _run_script(t, 6, lambda s, g: _batch(700, 4, 3000, g))
    assert all(used)  # never full: every call stays on the kernels


@pytest.mark.parametrize("strategy", [ScoreStrategy.STEP, ScoreStrategy.NO_EVICTION])
def test_insert_at_max_capacity_evicts_like_the_core(strategy: ScoreStrategy):
    t = HashTable(
        3,
        init_capacity=512,
        max_capacity=512,
        bucket_capacity=16,
        score_strategy=strategy,
        device=DEVICE,
    )
    used = _run_script(t, 8, lambda s, g: _batch(300, 3, 5000, g, pin=s % 2 == 1))
    assert all(used) and t.evictions + t.refusals > 0


def test_insert_with_growth_fused_ids_and_accumulators():
    t = HashTable(
        2,
        init_capacity=64,
        max_capacity=4096,
        bucket_capacity=16,
        with_accumulator=True,
        initial_accumulator_value=0.25,
        device=DEVICE,
    )

    def make(step: int, g: torch.Generator) -> dict:
        b = _batch(200, 2, 1500, g, table_ids=torch.randint(0, 3, (200,), generator=g))
        if step % 2:
            b["accumulators"] = torch.rand(200, 2, generator=g)
        return b

    used = _run_script(t, 12, make)
    assert any(used) and not all(used)  # growth went to the core, the rest to the kernels


def test_insert_of_colliding_fingerprints():
    t = HashTable(1, init_capacity=1024, max_capacity=1024, bucket_capacity=64, device=DEVICE)
    keys = _collision_keys(60)

    def make(step: int, g: torch.Generator) -> dict:
        k = keys[step::3]
        return {"keys": k, "values": k.float()[:, None], "scores": torch.zeros_like(k)}

    assert all(_run_script(t, 3, make))


def test_insert_rejects_what_the_core_rejects():
    from shared.hashtable.cuda.insert import insert_or_assign

    t = HashTable(1, init_capacity=64, max_capacity=64, device=DEVICE)
    with pytest.raises(ValueError, match="negative"):
        insert_or_assign(
            t,
            torch.tensor([3, -5]),
            torch.zeros(2, 1),
            torch.zeros(2),
            table_ids=None,
            accumulators=None,
            pinned_rows=None,
        )
    assert t.size == 0
