"""The CUDA backend (the CuPy kernels of shared/hashtable/cuda) against the torch backend.

Each test runs the same calls on two copies of a CUDA table, one with a ``CudaBackend`` and one
with a ``TorchBackend`` (chosen by constructing them), and asks for equal results and equal
tables (every slot, row, key, score and value): find gives identical rows, build and insert
identical key sets and rows. Which path a call took is read from the CUDA backend's ``paths``
counter. Run on the GPU machine: ``python3 -m pytest -q -m gpu tests/shared/hashtable``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable.cuda.backend import CudaBackend
from shared.hashtable.hashing import mix64_int, to_signed
from shared.hashtable.table import HashTable, InsertResult
from shared.hashtable.torch_backend import TorchBackend

from .conftest import CUDA_KERNELS
from .test_table import _unmix64

pytestmark = CUDA_KERNELS

DEVICE = "cuda"  # the device the tables live on (tests call the kernel modules directly)
TORCH = TorchBackend()  # the reference
KERNEL_PATHS = {"insert.fast", "insert.slow", "insert.overflow"}  # the kernels stored the call
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


@pytest.fixture
def kernels() -> CudaBackend:
    """A CUDA backend of the test's own (its ``paths`` count only this test's calls)."""
    return CudaBackend()


def _paths(table: HashTable) -> Counter[str]:
    assert isinstance(table.backend, CudaBackend)
    return table.backend.paths


def _core_table(keys: torch.Tensor, dim: int, bc: int, lf: float, tids=None) -> HashTable:
    """A table filled by the torch backend (and using it): a bulk build, then inserts and
    erases that move rows."""
    n = keys.numel()
    g = torch.Generator().manual_seed(n)
    vals = torch.randn(n, dim, generator=g)
    half = n // 2
    t = HashTable.from_keys_values(
        keys[:half],
        vals[:half],
        bucket_capacity=bc,
        device=DEVICE,
        table_ids=None if tids is None else tids[:half],
        max_load_factor=lf,
        max_capacity=4 * n,
        backend=TORCH,
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
    want_rows, want_found = t.find(query, qt, validate=False)  # the torch backend
    assert 0 < int(want_found.sum()) < query.numel()
    from shared.hashtable.cuda.runtime import FIND_WINDOWS

    for w in FIND_WINDOWS:
        rows, found = _kernel_find(t, query, qt, window=w)
        assert torch.equal(rows.cpu(), want_rows.cpu()), w
        assert torch.equal(found.cpu(), want_found.cpu()), w


def test_find_dispatches_to_the_kernel_on_cuda():
    """A CUDA table gets the CUDA backend by default, and its find the torch backend's rows."""
    keys = _random_keys(1000, seed=5)
    core = _core_table(keys, 2, 128, 0.5)
    t = core.to(DEVICE)
    assert t.backend.name == "cuda" and core.backend is TORCH
    assert "backend=cuda" in repr(t)
    rows, found = t.find(keys)
    want = core.find(keys)
    assert torch.equal(rows, want[0]) and torch.equal(found, want[1])


def test_find_through_the_driver_and_through_cupy_where_it_cannot():
    """find launches through the driver (cuLaunchKernel from a parameter buffer): the torch
    backend's rows and found flags for each window, with table ids, non-contiguous keys and no
    keys. A Launcher that cannot launch directly (``direct`` False: no current context) passes
    the same arguments to CuPy's RawKernel call: the same results."""
    from shared.hashtable.cuda import runtime as rt
    from shared.hashtable.cuda.find import SIGNATURES, _find_args, find, window

    keys = torch.cat([_random_keys(4000, seed=11), _collision_keys(20)])
    tids = torch.randint(0, 3, keys.shape, generator=torch.Generator().manual_seed(3))
    t = _core_table(keys, 4, 16, 0.7, tids)
    absent = _random_keys(300, seed=12, high=1 << 40) + (1 << 61)
    query = torch.cat([keys, absent, torch.tensor([-1, 0])]).to(DEVICE)
    qt = torch.cat([tids, torch.zeros(302, dtype=torch.int64)]).to(DEVICE)
    cases = [(query, qt), (query[::2], qt[::2]), (query, None), (query[:0], qt[:0])]
    for k, tt in cases:  # query[::2]: non-contiguous keys and ids
        want = t.find(k, tt, validate=False)  # the torch backend
        for w in rt.FIND_WINDOWS:
            rows, found = find(t, k, tt, probe_window=w)
            assert rows.dtype == torch.int64 and found.dtype == torch.bool
            assert torch.equal(rows, want[0]) and torch.equal(found, want[1]), w
            if k.numel() == 0:
                continue
            rows, found = torch.empty_like(rows), torch.empty_like(found)
            kc, tc = k.contiguous(), None if tt is None else tt.contiguous()
            launcher = rt.Launcher(torch.device(DEVICE))
            with launcher:
                assert launcher.direct  # what find above used
                launcher.direct = False
                kernel = launcher.kernel(f"ht_find<{window(t, w)}>", SIGNATURES["ht_find"])
                launcher(kernel, rt.blocks(k.numel()), rt.BLOCK, _find_args(t, kc, tc, rows, found))
            assert torch.equal(rows, want[0]) and torch.equal(found, want[1]), w


def _build_both(kernels: CudaBackend, **kw) -> tuple[HashTable, HashTable]:
    """(the CUDA backend's build, the torch backend's) of the same arguments."""
    want = HashTable.from_keys_values(**kw, backend=TORCH)
    return HashTable.from_keys_values(**kw, backend=kernels), want


@pytest.mark.parametrize("bc", [128, 16, 7])
@pytest.mark.parametrize("extras", [False, True])
def test_build_gives_the_core_table(bc: int, extras: bool, kernels: CudaBackend):
    keys = torch.cat([_random_keys(5000, seed=bc), _collision_keys(30)])
    n = keys.numel()
    g = torch.Generator().manual_seed(3)
    kw: dict = {"keys": keys, "values": torch.randn(n, 5, generator=g), "device": DEVICE}
    kw["bucket_capacity"] = bc
    if extras:
        kw["scores"] = torch.randint(0, 100, (n,), generator=g)
        kw["table_ids"] = torch.randint(0, 4, (n,), generator=g)
        kw["accumulators"] = torch.rand(n, 5, generator=g)
    got, want = _build_both(kernels, **kw)
    assert kernels.paths == Counter({"build.kernel": 1})
    _assert_same_table(got, want)
    assert got._any_tid == want._any_tid
    assert got.backend is kernels and want.backend is TORCH


def test_build_doubles_overflowing_buckets_like_the_core(kernels: CudaBackend):
    keys = _random_keys(4000, seed=7)
    got, want = _build_both(
        kernels,
        keys=keys,
        values=torch.ones(4000, 1),
        device=DEVICE,
        bucket_capacity=4,
        max_load_factor=1.0,
    )
    assert kernels.paths == Counter({"build.kernel": 1})
    assert want.num_buckets > 1000  # 4000 keys / 4 slots, doubled
    _assert_same_table(got, want)


def test_build_reports_the_core_errors(kernels: CudaBackend):
    with pytest.raises(ValueError, match="key 5 appears more than once"):
        HashTable.from_keys_values(
            torch.tensor([5, 6, 5]), torch.zeros(3, 2), device=DEVICE, backend=kernels
        )
    assert kernels.paths == Counter({"build.torch": 1})  # the torch code names the key
    with pytest.raises(ValueError, match="key -3 at position 1 is negative"):
        HashTable.from_keys_values(
            torch.tensor([5, -3]), torch.zeros(2, 2), device=DEVICE, backend=kernels
        )


def test_build_dispatches_to_the_kernel_on_cuda():
    keys = _random_keys(20000, seed=8)
    vals = torch.randn(20000, 16)
    got = HashTable.from_keys_values(keys, vals, device=DEVICE)
    assert got.backend.name == "cuda"
    before = _paths(got)["build.kernel"]
    got = HashTable.from_keys_values(keys, vals, device=DEVICE)
    assert _paths(got)["build.kernel"] == before + 1
    want = HashTable.from_keys_values(keys, vals, device=DEVICE, backend=TORCH)
    _assert_same_table(got, want)


def _insert_pair(
    kernel: HashTable, core: HashTable, used: list[bool], **kw
) -> tuple[InsertResult, InsertResult]:
    """The call on ``kernel`` (a CUDA backend) and on ``core`` (the torch backend); records the
    kernel call's path in PATHS and whether the kernels stored it in ``used``."""
    want = core.insert_or_assign(**kw)
    before = _paths(kernel).copy()
    got = kernel.insert_or_assign(**kw)
    (path,) = _paths(kernel) - before  # the one path this call counted
    used.append(path in KERNEL_PATHS)
    PATHS.append(path.removeprefix("insert."))
    _assert_scratch_clear(kernel)
    return got, want


PATHS: list[str] = []  # the insert paths (fast, slow, overflow, abort, ...) of the current test


@pytest.fixture(autouse=True)
def _clear_paths() -> None:
    PATHS.clear()


def _assert_scratch_clear(table: HashTable) -> None:
    """The kernels leave their cached scratch as the next call needs it (they clear it)."""
    from shared.hashtable.cuda import insert

    sc = insert._scratch.get(table)
    if sc is None:
        return
    assert not sc.dirty
    assert bool((sc.scount == 0).all()), "scount"
    assert bool((sc.win == -1).all()), "win"
    assert bool((sc.stats_of[sc.parity] == 0).all()), "stats"


def _assert_same_result(got: InsertResult, want: InsertResult) -> None:
    for f in ("rows", "inserted", "evicted_keys", "evicted_table_ids"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu()), f
    assert got.num_refused == want.num_refused


Batch = Callable[[int, torch.Generator], dict]


def _run_script(kernel: HashTable, batches: int, make: Batch) -> list[bool]:
    """``batches`` inserts from ``make`` on ``kernel`` (a CUDA backend) and on a copy with the
    torch backend: equal results and tables after each; whether the kernels stored each call."""
    core = kernel.to(kernel.device, backend=TORCH)
    used: list[bool] = []
    g = torch.Generator().manual_seed(11)
    for step in range(batches):
        kw = make(step, g)
        if kw.pop("pin", False):
            tids = kw.get("table_ids")
            head = None if tids is None else tids[:20]
            kw["pinned_rows"] = core.find(kw["keys"][:20], head)[0]
            kw["pinned_rows"] = kw["pinned_rows"][kw["pinned_rows"] >= 0]
        got, want = _insert_pair(kernel, core, used, **kw)
        _assert_same_result(got, want)
        _assert_same_table(kernel, core)
        assert kernel._any_tid or not core._any_tid  # never lazier than the core (eager is safe)
    return used


def _batch(n: int, dim: int, universe: int, g: torch.Generator, **extra) -> dict:
    keys = torch.randint(0, universe, (n,), generator=g) * 7919 + 3  # with duplicates
    return {
        "keys": keys,
        "values": torch.randn(n, dim, generator=g),
        "scores": torch.randint(0, 50, (n,), generator=g),
        **extra,
    }


@pytest.mark.parametrize("bc", [128, 16, 7])
def test_insert_without_growth_gives_the_core_table(bc: int, kernels: CudaBackend):
    t = HashTable(
        4, init_capacity=8192, max_capacity=8192, bucket_capacity=bc, device=DEVICE, backend=kernels
    )
    used = _run_script(t, 6, lambda s, g: _batch(700, 4, 3000, g))
    assert all(used)  # no growth: every call stays on the kernels
    assert set(PATHS) <= {"fast", "overflow"}  # bc 7: a bucket may fill up


@pytest.mark.parametrize("strategy", [ScoreStrategy.STEP, ScoreStrategy.NO_EVICTION])
def test_insert_at_max_capacity_evicts_like_the_core(strategy: ScoreStrategy, kernels: CudaBackend):
    t = HashTable(
        3,
        init_capacity=512,
        max_capacity=512,
        bucket_capacity=16,
        score_strategy=strategy,
        device=DEVICE,
        backend=kernels,
    )
    used = _run_script(t, 8, lambda s, g: _batch(300, 3, 5000, g, pin=s % 2 == 1))
    assert all(used) and t.evictions + t.refusals > 0
    assert "overflow" in PATHS


def test_insert_with_growth_fused_ids_and_accumulators(kernels: CudaBackend):
    t = HashTable(
        2,
        init_capacity=64,
        max_capacity=4096,
        bucket_capacity=16,
        with_accumulator=True,
        initial_accumulator_value=0.25,
        device=DEVICE,
        backend=kernels,
    )

    def make(step: int, g: torch.Generator) -> dict:
        b = _batch(200, 2, 1500, g, table_ids=torch.randint(0, 3, (200,), generator=g))
        if step % 2:
            b["accumulators"] = torch.rand(200, 2, generator=g)
        return b

    used = _run_script(t, 12, make)
    assert any(used) and not all(used)  # growth went to the torch code, the rest to the kernels


def test_insert_of_colliding_fingerprints(kernels: CudaBackend):
    t = HashTable(
        1, init_capacity=1024, max_capacity=1024, bucket_capacity=64, device=DEVICE, backend=kernels
    )
    keys = _collision_keys(60)

    def make(step: int, g: torch.Generator) -> dict:
        k = keys[step::3]
        k = torch.cat([k, k[:7]])  # and duplicates of colliding pairs in the batch
        return {"keys": k, "values": k.float()[:, None], "scores": torch.zeros_like(k)}

    assert all(_run_script(t, 3, make))


def test_insert_rejects_what_the_core_rejects(kernels: CudaBackend):
    t = HashTable(1, init_capacity=64, max_capacity=64, device=DEVICE, backend=kernels)
    with pytest.raises(ValueError, match="negative"):
        t.insert_or_assign(torch.tensor([3, -5]), torch.zeros(2, 1), torch.zeros(2))
    with pytest.raises(ValueError, match="table ids"):
        ids = torch.tensor([0, 1 << 31])
        t.insert_or_assign(torch.tensor([3, 5]), torch.zeros(2, 1), torch.zeros(2), table_ids=ids)
    assert t.size == 0
    _assert_scratch_clear(t)
    t.insert_or_assign(torch.tensor([3, 5]), torch.ones(2, 1), torch.zeros(2))
    assert t.size == 2  # the scratch is usable after a refused call ...
    assert kernels.paths == Counter({"insert.fast": 1})  # ... and the kernels stored the call


def test_insert_slow_path_near_the_load_bound(kernels: CudaBackend):
    """A table that may grow, batches whose occurrences (with duplicates) exceed the load bound
    but whose distinct new keys do not: the kernels decide after counting the pairs (place pass
    1); later batches do grow (the torch code)."""
    t = HashTable(
        4, init_capacity=1024, max_capacity=8192, bucket_capacity=32, device=DEVICE, backend=kernels
    )

    def make(step: int, g: torch.Generator) -> dict:
        keys = torch.randint(0, 60, (400,), generator=g) * 7919 + 3 + step * 1000003
        return {
            "keys": keys,
            "values": torch.randn(400, 4, generator=g),
            "scores": torch.randint(0, 50, (400,), generator=g),
        }

    used = _run_script(t, 12, make)
    assert any(used) and not all(used)
    assert {"slow", "abort"} <= set(PATHS)


def test_insert_of_a_skewed_batch_goes_to_the_core(kernels: CudaBackend):
    """More new occurrences in one bucket than its list holds (2 * bucket_capacity)."""
    t = HashTable(
        4, init_capacity=4096, max_capacity=4096, bucket_capacity=16, device=DEVICE, backend=kernels
    )

    def make(step: int, g: torch.Generator) -> dict:
        keys = torch.cat(
            [torch.full((40,), 12345 + step), torch.randint(0, 10**6, (50,), generator=g)]
        )
        return {
            "keys": keys,
            "values": torch.randn(90, 4, generator=g),
            "scores": torch.randint(0, 50, (90,), generator=g),
        }

    used = _run_script(t, 3, make)
    assert not any(used) and set(PATHS) == {"abort"}


def test_insert_at_max_capacity_with_ids_accumulators_pins_and_dim_16(kernels: CudaBackend):
    """dim 16: the float4 copies of values and accumulators; fused ids and pins at eviction."""
    t = HashTable(
        16,
        init_capacity=256,
        max_capacity=256,
        bucket_capacity=8,
        with_accumulator=True,
        initial_accumulator_value=0.5,
        device=DEVICE,
        backend=kernels,
    )

    def make(step: int, g: torch.Generator) -> dict:
        ids = torch.randint(0, 2, (120,), generator=g)
        b = _batch(120, 16, 900, g, table_ids=ids, pin=step % 2 == 0)
        if step % 3 == 0:
            b["accumulators"] = torch.rand(120, 16, generator=g)
        return b

    assert all(_run_script(t, 10, make))
    assert "overflow" in PATHS


def test_insert_dispatch_uses_the_kernels_and_growth_renews_the_scratch():
    """HashTable.insert_or_assign on CUDA (the default backend): the kernels, the torch code on
    growth (the table's scratch then follows the new size), and assigning every stored key."""
    t = HashTable(16, init_capacity=4096, max_capacity=1 << 16, bucket_capacity=128, device=DEVICE)
    assert t.backend.name == "cuda"
    core = t.to(DEVICE, backend=TORCH)
    before = _paths(t).copy()
    g = torch.Generator().manual_seed(3)
    keys = _random_keys(20000, seed=4)
    for s in range(0, 20000, 5000):
        k = keys[s : s + 5000]
        v, sc = torch.randn(5000, 16, generator=g), torch.randint(0, 9, (5000,), generator=g)
        got = t.insert_or_assign(k, v, sc)
        want = core.insert_or_assign(k, v, sc)
        _assert_same_result(got, want)
        _assert_same_table(t, core)
    assert t.num_buckets > 32  # it grew
    v = torch.randn(20000, 16, generator=g)
    got = t.insert_or_assign(keys.flip(0), v, torch.arange(20000))
    want = core.insert_or_assign(keys.flip(0), v, torch.arange(20000))
    _assert_same_result(got, want)
    _assert_same_table(t, core)
    _assert_scratch_clear(t)
    counted = _paths(t) - before
    assert counted["insert.abort"] > 0 and counted["insert.fast"] > 0


# ------------------------------------------------------------------ any dim, erase


DIMS = [0, 1, 3, 16, 17, 64]


@pytest.mark.parametrize("dim", DIMS)
def test_insert_of_any_dim_gives_the_core_table(dim: int, kernels: CudaBackend):
    """No growth: duplicates, table ids, accumulators every other call, assigns of stored keys;
    place writes the new rows (float4 or float copies, 2**gshift lanes a row)."""
    t = HashTable(
        dim,
        init_capacity=8192,
        max_capacity=8192,
        bucket_capacity=32,
        with_accumulator=dim > 0,
        initial_accumulator_value=0.5,
        device=DEVICE,
        backend=kernels,
    )

    def make(step: int, g: torch.Generator) -> dict:
        b = _batch(600, dim, 2500, g, table_ids=torch.randint(0, 3, (600,), generator=g))
        if step % 2 and dim:
            b["accumulators"] = torch.rand(600, dim, generator=g)
        return b

    assert all(_run_script(t, 6, make))
    assert "fast" in PATHS and set(PATHS) <= {"fast", "overflow"}


@pytest.mark.parametrize("dim", DIMS)
def test_insert_growth_and_eviction_of_any_dim(dim: int, kernels: CudaBackend):
    """Growth (the torch code), the slow path near the load bound, then eviction at max
    capacity with pins (the torch code's overflow, then ht_ins2_gather)."""
    t = HashTable(
        dim,
        init_capacity=64,
        max_capacity=1024,
        bucket_capacity=16,
        with_accumulator=dim > 0,
        device=DEVICE,
        backend=kernels,
    )

    def make(step: int, g: torch.Generator) -> dict:
        ids = torch.randint(0, 2, (150,), generator=g)
        b = _batch(150, dim, 3000, g, table_ids=ids, pin=step % 2 == 1)
        if step % 3 == 0 and dim:
            b["accumulators"] = torch.rand(150, dim, generator=g)
        return b

    used = _run_script(t, 16, make)
    assert any(used) and not all(used)
    assert t.num_buckets == 64 and t.evictions > 0 and "overflow" in PATHS


def test_insert_of_unaligned_values_uses_float_copies(kernels: CudaBackend):
    from shared.hashtable.cuda import insert

    n, dim = 500, 16
    t = HashTable(
        dim,
        init_capacity=4096,
        max_capacity=4096,
        with_accumulator=True,
        device=DEVICE,
        backend=kernels,
    )

    def make(step: int, g: torch.Generator) -> dict:
        b = _batch(n, dim, 2000, g)
        flat = torch.randn(n * dim + 1, generator=g).to(DEVICE)
        b["values"] = flat[1:].view(n, dim)  # 4 bytes past a 16-byte boundary
        b["accumulators"] = torch.rand(n * dim + 1, generator=g).to(DEVICE)[1:].view(n, dim)
        assert insert._row_layout(dim, [b["values"]]) == (False, 4)
        return b

    assert all(_run_script(t, 4, make))


def _erase_pair(kernel: HashTable, core: HashTable, keys: torch.Tensor, tids) -> int:
    """The erase on ``kernel`` (a CUDA backend) and on ``core`` (the torch backend; equal tables
    before): the kernels did it, equal counts and tables after."""
    want = core.erase(keys, tids)
    before = _paths(kernel)["erase.kernel"]
    got = kernel.erase(keys, tids)
    assert _paths(kernel)["erase.kernel"] == before + 1 and got == want
    _assert_same_table(kernel, core)
    _assert_scratch_clear(kernel)
    return got


@pytest.mark.parametrize("bc", [128, 16, 7, 1])
@pytest.mark.parametrize("fused", [False, True])
def test_erase_gives_the_core_table(bc: int, fused: bool, kernels: CudaBackend):
    """Present, absent and duplicate keys (colliding fingerprints among them), then inserts
    into the freed slots, several rounds."""
    keys = torch.cat([_random_keys(3000, seed=bc), _collision_keys(40)])
    tids = torch.randint(0, 3, keys.shape, generator=torch.Generator().manual_seed(4))
    core = _core_table(keys, 3, bc, 0.5, tids if fused else None)
    kernel = core.to(DEVICE, backend=kernels)
    g = torch.Generator().manual_seed(5)
    absent = _random_keys(300, seed=77, high=1 << 40) + (1 << 61)
    total = 0
    for step in range(4):
        pick = torch.randint(0, keys.numel(), (700,), generator=g)  # duplicates too
        k = torch.cat([keys[pick], absent[step * 50 : step * 50 + 50], keys[pick[:30]]])
        t = None
        if fused:
            t = torch.cat([tids[pick], torch.zeros(50, dtype=torch.int64), tids[pick[:30]]])
        total += _erase_pair(kernel, core, k, t)
        used: list[bool] = []
        back = keys[pick[:200]]
        kw = {
            "keys": back,
            "values": torch.randn(200, 3, generator=g),
            "scores": torch.arange(200),
            "table_ids": None if not fused else tids[pick[:200]],
        }
        got, want = _insert_pair(kernel, core, used, **kw)
        _assert_same_result(got, want)
        _assert_same_table(kernel, core)
    assert total > 0
    assert _erase_pair(kernel, core, absent, None) == 0
    assert _erase_pair(kernel, core, keys[:0], None) == 0


def test_erase_rejects_what_the_core_rejects(kernels: CudaBackend):
    keys = _random_keys(500, seed=9)
    before = _core_table(keys, 2, 16, 0.5)
    t = before.to(DEVICE, backend=kernels)
    with pytest.raises(ValueError, match="negative"):
        t.erase(torch.cat([keys[:10], torch.tensor([-4])]))
    with pytest.raises(ValueError, match="table ids"):
        t.erase(keys[:3], torch.tensor([0, 1 << 31, 0]))
    _assert_same_table(t, before)  # nothing erased: the marks were cleared, not applied
    _assert_scratch_clear(t)
    _erase_pair(t, before, keys[:100], None)  # the scratch is usable after a refused call


def test_erase_dispatch_and_clear_on_cuda():
    """HashTable.erase / clear on CUDA (the default backend) use the kernels; a full erase
    empties the table."""
    keys = _random_keys(4000, seed=12)
    tids = torch.randint(0, 2, keys.shape, generator=torch.Generator().manual_seed(1))
    core = _core_table(keys, 4, 128, 0.5, tids)
    t = core.to(DEVICE)
    assert t.backend.name == "cuda"
    before = _paths(t)["erase.kernel"]
    assert t.clear(1) == core.clear(1)
    _assert_same_table(t, core)
    assert t.erase(keys, tids) == core.erase(keys, tids)
    _assert_same_table(t, core)
    assert t.size == 0 and _paths(t)["erase.kernel"] == before + 2


def test_erase_without_count_reads_nothing_until_the_size_is_needed(kernels: CudaBackend):
    """count=False (the storage's erase of admitted counter keys): no host sync at the call
    (torch's sync-debug mode raises on one, and no event is waited for); the count reaches the
    size when it is read, or before the scratch is used again; the table equals the core's."""
    keys = _random_keys(4000, seed=31)
    tids = torch.randint(0, 3, keys.shape, generator=torch.Generator().manual_seed(2))
    core = _core_table(keys, 2, 16, 0.5, tids)
    kernel = core.to(DEVICE, backend=kernels)
    waits = []
    real_wait = torch.cuda.Event.synchronize

    def wait(self: torch.cuda.Event) -> None:
        waits.append(self)
        real_wait(self)

    gone = [(keys[i : i + 700].to(DEVICE), tids[i : i + 700].to(DEVICE)) for i in (0, 500)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda.Event, "synchronize", wait)
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert kernel.erase(*gone[0], count=False) is None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert waits == [] and len(kernel._pending) == 1
        assert kernel._settled_size == core.size  # not counted yet
        core.erase(*gone[0])
        assert kernel.size == core.size and kernel._pending == [] and len(waits) == 1
        assert kernel.erase(*gone[1], count=False) is None  # overlaps the first: some absent
        assert len(kernel._pending) == 1 and len(waits) == 1
    core.erase(*gone[1])
    assert _paths(kernel)["erase.deferred"] == 2 and "erase.kernel" not in _paths(kernel)
    used: list[bool] = []
    back = {"keys": keys[:300], "values": torch.ones(300, 2), "scores": torch.arange(300)}
    got, want = _insert_pair(kernel, core, used, table_ids=tids[:300], **back)  # settles first
    assert kernel._pending == [] and all(used)
    _assert_same_result(got, want)
    _assert_same_table(kernel, core)
    _assert_scratch_clear(kernel)


def test_frequency_counter_on_the_kernels_gives_the_core_counts(kernels: CudaBackend):
    """The admission counter (dim 0, 1024 slots a bucket: place opts in to more shared memory,
    LFU eviction at capacity): add and erase through the kernels, equal to the torch code."""
    from shared.hashtable.admission import FrequencyCounter

    kernel = FrequencyCounter(4096, 1024, device=DEVICE, backend=kernels)
    core = FrequencyCounter(4096, 1024, device=DEVICE, backend=TORCH)
    g = torch.Generator().manual_seed(21)
    for step in range(6):
        keys = _random_keys(1500, seed=100 + step, high=1 << 14)  # repeats across steps
        tids = torch.randint(0, 2, keys.shape, generator=g)
        counts = torch.randint(1, 4, keys.shape, generator=g)
        got = kernel.add(keys, counts, tids)
        want = core.add(keys, counts, tids)
        assert torch.equal(got.cpu(), want.cpu())
        _assert_same_table(kernel.table, core.table)
        gone, gone_t = keys[: 200 + step], tids[: 200 + step]
        assert kernel.erase(gone, gone_t) == core.erase(gone, gone_t)
        _assert_same_table(kernel.table, core.table)
    assert {"insert.fast", "insert.overflow"} & set(kernels.paths) and kernel.evictions > 0
    assert kernels.paths["erase.kernel"] == 6 and "erase.torch" not in kernels.paths
    _assert_scratch_clear(kernel.table)
