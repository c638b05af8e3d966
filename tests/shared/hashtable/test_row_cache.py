"""CACHING (RowCache over a host tier) equals HBM_ONLY step by step, bit for bit on CPU.

A cache of a few lines, through growth, each score strategy, admission, prefetch, checkpoints
at W = 1, 2, 3 and export; ``cache_load_factor`` changes placement, not results. The same
scripts run on CUDA (``gpu``), compared within the CUDA tests' tolerances. The static step on a
cache (shared.hashtable.row_cache_static): ``test_row_cache_static.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from shared.features import ScoreStrategy, TableSpec
from shared.hashtable import cuda
from shared.hashtable.adagrad import AdagradConfig, adagrad_update
from shared.hashtable.backend import TorchBackend
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.host_store import TensorHostStore
from shared.hashtable.row_cache import RowCache
from shared.hashtable.table import HashTable

from .conftest import dyn_table

FIELDS = ("keys", "values", "scores", "accumulators", "counter_keys", "counter_counts")
STRATEGIES = list(ScoreStrategy)


def _cached(t: TableSpec, factor: float | None) -> TableSpec:
    assert t.dynamic is not None
    return dataclasses.replace(t, dynamic=dataclasses.replace(t.dynamic, cache_load_factor=factor))


def _tables(strategy: ScoreStrategy, factor: float | None) -> list[TableSpec]:
    """Two fused tables that grow (16 -> 256 slots) and evict, one with admission."""
    kw = dict(init_capacity=16, bucket_capacity=8, max_capacity=256, strategy=strategy)
    tables = [dyn_table("a_emb", **kw), dyn_table("b_emb", threshold=2, **kw)]  # type: ignore[arg-type]
    return [_cached(t, factor) for t in tables]


def _dec(
    strategy: ScoreStrategy, factor: float | None, device: str = "cpu"
) -> DynamicEmbeddingCollection:
    clock = itertools.count(1000, 7)
    dec = DynamicEmbeddingCollection(
        _tables(strategy, factor), {"g": ["a_emb", "b_emb"]}, lr=0.03,
        initial_accumulator_value=0.1, device=device, clock=lambda: next(clock),
    )  # fmt: skip
    return dec


def _batches(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{t: torch.randint(0, 400, (300,), generator=g) for t in ("a_emb", "b_emb")} for _ in range(steps)]  # fmt: skip


def _run(
    dec: DynamicEmbeddingCollection,
    steps: int = 8,
    *,
    prefetch: bool = False,
    between: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """The script's outputs; with ``prefetch`` each next batch prefetched after the backward
    (``between``: between the forward and the backward, which may evict the step's rows)."""
    g = torch.Generator().manual_seed(1)
    batches = _batches(steps)
    outs = []
    for step, batch in enumerate(batches):
        dec.set_step(step)
        dev = {t: k.to(dec.device) for t, k in batch.items()}
        out = dec(dev)
        coef = {t: torch.randn(300, 4, generator=g).to(dec.device) for t in batch}
        loss = sum((out[t] * coef[t]).sum() for t in batch)
        fetch = prefetch and step + 1 < steps
        if fetch and between:
            dec.prefetch(batches[step + 1])
        loss.backward()  # type: ignore[union-attr]
        if fetch and not between:
            dec.prefetch(batches[step + 1])
        outs.append({t: v.detach().cpu() for t, v in out.items()})
        if step == steps // 2:  # an eval lookup between training steps reads the same rows
            dec.eval()
            outs.append({t: v.cpu() for t, v in dec(dev).items()})
            dec.train()
    return outs


def _assert_equal(a: DynamicEmbeddingCollection, b: DynamicEmbeddingCollection) -> None:
    sa, sb = a.table_states(), b.table_states()
    for t in sa:
        for f in FIELDS:
            x, y = getattr(sa[t], f), getattr(sb[t], f)
            assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), (t, f)
    assert a.stats() == b.stats()


def _lines(dec: DynamicEmbeddingCollection) -> int:
    return int(dec.tier_stats()["g"]["cache_lines"])


@pytest.mark.parametrize("strategy", STRATEGIES, ids=[s.value for s in STRATEGIES])
def test_a_cache_of_a_few_rows_equals_hbm_only_step_by_step(strategy: ScoreStrategy) -> None:
    hbm, cached = _dec(strategy, None), _dec(strategy, 0.01)
    assert _lines(cached) == 6 and cached.tiered and not hbm.tiered
    for o1, o2 in zip(_run(hbm), _run(cached), strict=True):
        for t in o1:
            assert torch.equal(o1[t], o2[t]), t
    _assert_equal(hbm, cached)
    table = cached._storages[0].table
    assert table.generation > 0  # the script grows the table
    stats = cached.tier_stats()["g"]
    assert stats["cache_evictions"] > 0 and stats["cache_writebacks"] > 0
    assert stats["cache_bypassed"] > 0  # a batch needs more rows than 6 lines
    if strategy is not ScoreStrategy.NO_EVICTION:
        assert hbm.stats()["a_emb"]["evictions"] > 0  # and evicts keys
    else:
        assert hbm.stats()["a_emb"]["refusals"] > 0


@pytest.mark.parametrize("factor", [0.05, 0.3, 0.99])
def test_cache_load_factor_changes_placement_not_results(factor: float) -> None:
    hbm, cached = _dec(ScoreStrategy.LFU, None), _dec(ScoreStrategy.LFU, factor)
    assert _lines(cached) == 2 * math.ceil(factor * 256)  # ceil(factor * max_capacity) a table
    for o1, o2 in zip(_run(hbm), _run(cached), strict=True):
        for t in o1:
            assert torch.equal(o1[t], o2[t]), t
    _assert_equal(hbm, cached)
    s = cached.tier_stats()["g"]
    assert s["hbm_payload_bytes"] < s["host_payload_bytes"] or factor > 0.9
    assert hbm.tier_stats()["g"].keys() == {"hbm_payload_bytes"}


def test_prefetch_changes_nothing_and_the_next_lookup_hits() -> None:
    plain, fetched = _dec(ScoreStrategy.STEP, 0.5), _dec(ScoreStrategy.STEP, 0.5)
    for o1, o2 in zip(_run(plain), _run(fetched, prefetch=True), strict=True):
        for t in o1:
            assert torch.equal(o1[t], o2[t]), t
    _assert_equal(plain, fetched)
    assert fetched.tier_stats()["g"]["cache_prefetched"] > 0
    # prefetch of a batch, then its lookup: every stored key's row is already a line
    batch = _batches(1, seed=5)[0]
    fetched.prefetch(batch)
    before = fetched.tier_stats()["g"]
    fetched.set_step(99)
    fetched.eval()  # no insert: only stored rows are read
    fetched(batch)
    after = fetched.tier_stats()["g"]
    assert (
        after["cache_misses"] == before["cache_misses"]
        and after["cache_hits"] > before["cache_hits"]
    )


def test_prefetch_is_no_op_without_a_cache() -> None:
    hbm = _dec(ScoreStrategy.STEP, None)
    _run(hbm, 2)
    before = hbm.table_states()
    hbm.prefetch(_batches(1, seed=3)[0])
    after = hbm.table_states()
    for t in before:
        assert torch.equal(before[t].scores, after[t].scores)


def test_the_backward_reuses_the_forwards_lines_unless_a_line_left_its_row() -> None:
    """A step's Adagrad takes the lines its lookup resolved (no second resolve: the hits are
    the lookup's alone); a prefetch between the two that evicts lines makes it resolve again,
    with the same results either way."""
    plain, between = _dec(ScoreStrategy.STEP, 0.99), _dec(ScoreStrategy.STEP, 0.3)
    hbm = _dec(ScoreStrategy.STEP, None)
    plain.set_step(0)
    batch = _batches(1, seed=7)[0]
    out = plain(batch)
    forward = plain.tier_stats()["g"]
    sum(o.sum() for o in out.values()).backward()  # type: ignore[union-attr]
    after = plain.tier_stats()["g"]
    assert forward["cache_misses"] > 0 and forward["cache_bypassed"] == 0
    assert after["cache_hits"] == forward["cache_hits"]  # not resolved again
    outs = _run(hbm), _run(between, prefetch=True, between=True)
    for o1, o2 in zip(*outs, strict=True):
        for t in o1:
            assert torch.equal(o1[t], o2[t]), t
    _assert_equal(hbm, between)
    assert between.tier_stats()["g"]["cache_evictions"] > 0


def _bare_cache(
    *, lines: int, keys: int
) -> tuple[RowCache, TensorHostStore, torch.Tensor, torch.Tensor]:
    """A cache of ``lines`` lines over a bare 64-row index of dim 2 holding keys 0 ..
    ``keys - 1`` with values ``arange`` (scores 0): (the cache, its host tier, the keys' rows,
    their values [keys, 2])."""
    table = HashTable(0, init_capacity=64, max_capacity=64, bucket_capacity=8)
    store = TensorHostStore(2, capacity=64, pin=False)
    cache = RowCache(
        table, TorchBackend(), dim=2, lines=lines, store=store, initial_accumulator_value=0.5
    )
    init = torch.arange(2 * keys, dtype=torch.float32).reshape(keys, 2)
    zeros = torch.zeros(keys, dtype=torch.int64)
    rows = cache.insert_or_assign(torch.arange(keys), init, zeros, table_ids=None).rows
    return cache, store, rows, init


@pytest.mark.parametrize("evict", [False, True], ids=["reused", "evicted"])
def test_adagrad_takes_the_lookups_lines_only_while_they_hold_its_rows(evict: bool) -> None:
    """gather, then adagrad of the same rows (``looked_up``: the tensor gather got): the lines
    are reused, unless a call in between evicted lines (here a prefetch that takes both of
    them); the update lands on the rows either way."""
    cache, store, rows, init = _bare_cache(lines=4, keys=6)
    given = torch.cat([rows[:2], torch.tensor([-1])])  # a lookup's rows: -1 for no key
    cache.gather(given)  # lines 0, 1
    if evict:
        cache.prefetch(rows[2:6])  # lines 2, 3, then the window's 0 and 1
        assert int(cache.line_of_row[rows[0]]) == -1 and int(cache.line_of_row[rows[1]]) == -1
    hits = cache.counters.hits
    config, grads = AdagradConfig(0.1, 1e-10, 0.5), torch.ones(2, 2)
    cache.adagrad(rows[:2], grads, config, looked_up=given)
    assert cache.counters.hits == hits  # reused, or resolved again as two misses
    assert cache.counters.misses == (2 + 4 + 2 if evict else 2)
    want_v, want_a = init[:2].clone(), torch.full((2, 2), 0.5)
    adagrad_update(want_v, want_a, torch.tensor([0, 1]), grads, config)
    exported = cache.export()
    assert exported.values is not None and exported.accumulators is not None
    at = exported.keys < 2
    assert torch.equal(exported.values[at], want_v[exported.keys[at]])
    assert torch.equal(exported.accumulators[at], want_a[exported.keys[at]])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_checkpoints_round_trip_between_tiers_at_any_world_size(tmp_path, world_size: int) -> None:
    """The same files whichever tier wrote them; loading into a cached table at rank r of W
    keeps key mod W == r, as an HBM_ONLY table does."""
    hbm, cached = _dec(ScoreStrategy.LFU, None), _dec(ScoreStrategy.LFU, 0.02)
    _run(hbm)
    _run(cached)
    for rank in range(world_size):
        hbm.save(tmp_path / "h", "sparse", rank=rank, world_size=world_size)
        cached.save(tmp_path / "c", "sparse", rank=rank, world_size=world_size)
    for name in sorted(p.name for p in (tmp_path / "h" / "dynamicemb" / "sparse").iterdir()):
        a = (tmp_path / "h" / "dynamicemb" / "sparse" / name).read_bytes()
        b = (tmp_path / "c" / "dynamicemb" / "sparse" / name).read_bytes()
        assert a == b, name
    for rank in range(world_size):
        into_cached, into_hbm = _dec(ScoreStrategy.LFU, 0.02), _dec(ScoreStrategy.LFU, None)
        into_cached.load(tmp_path / "h", "sparse", rank=rank, world_size=world_size)
        into_hbm.load(tmp_path / "c", "sparse", rank=rank, world_size=world_size)
        _assert_equal(into_hbm, into_cached)
        # and they train on alike
        for o1, o2 in zip(_run(into_hbm, 3), _run(into_cached, 3), strict=True):
            for t in o1:
                assert torch.equal(o1[t], o2[t]), t
        _assert_equal(into_hbm, into_cached)


def test_export_reads_every_row_with_dirty_lines_flushed() -> None:
    hbm, cached = _dec(ScoreStrategy.STEP, None), _dec(ScoreStrategy.STEP, 0.1)
    _run(hbm)
    _run(cached)
    cache = cached._storages[0].payload
    assert isinstance(cache, RowCache) and bool(cache.dirty.any())
    for t in ("a_emb", "b_emb"):
        k1, v1 = hbm.export_table(t)
        k2, v2 = cached.export_table(t)
        assert torch.equal(k1, k2) and torch.equal(v1, v2), t
    assert not bool(cache.dirty.any())  # flushed


def test_reserve_max_capacity_moves_the_payload() -> None:
    hbm, cached = _dec(ScoreStrategy.STEP, None), _dec(ScoreStrategy.STEP, 0.1)
    _run(hbm, 2)
    _run(cached, 2)
    hbm.reserve_max_capacity()
    cached.reserve_max_capacity()
    _assert_equal(hbm, cached)
    for o1, o2 in zip(_run(hbm, 3), _run(cached, 3), strict=True):
        for t in o1:
            assert torch.equal(o1[t], o2[t]), t


def test_row_cache_resolves_misses_evicts_lru_and_bypasses_past_its_lines() -> None:
    """The cache's own mechanics on a bare index: LRU victims outside the call's rows, dirty
    write-back, bypass when a call needs more rows than lines, Adagrad equal to the rows'."""
    cache, store, rows, init = _bare_cache(lines=3, keys=6)
    assert torch.equal(cache.gather(rows[:2]), init[:2])  # two misses into free lines
    assert cache.counters.misses == 2 and cache.counters.evictions == 0
    config = AdagradConfig(0.1, 1e-10, 0.5)
    grads = torch.ones(2, 2)
    cache.adagrad(rows[:2], grads, config)  # hits: lines now dirty
    assert cache.counters.hits == 2 and int(cache.dirty.sum()) == 2
    expected_v, expected_a = init.clone(), torch.full((6, 2), 0.5)
    adagrad_update(expected_v, expected_a, torch.tensor([0, 1]), grads, config)
    cache.gather(rows[2:4])  # one free line, then the least recently used (row of key 0)
    assert cache.counters.evictions == 1 and cache.counters.writebacks == 1
    assert int(cache.line_of_row[rows[0]]) == -1 and int(cache.line_of_row[rows[1]]) >= 0
    out = cache.gather(rows)  # 6 rows, 3 lines: 3 bypassed, read from the host tier
    assert cache.counters.bypassed == 3
    assert torch.equal(out, expected_v)
    exported = cache.export()
    assert torch.equal(exported.values, expected_v) and torch.equal(
        exported.accumulators, expected_a
    )


def test_victims_are_fresh_lines_then_the_oldest_of_a_window_after_the_clock_hand() -> None:
    """Lines never used go first (no eviction), then each call takes the least recently used
    lines of a window of 2 * (misses + hits) lines after the hand, never its own, and the
    hand moves past the window; values stay those of the host tier."""
    cache, store, rows, init = _bare_cache(lines=16, keys=24)
    for a in range(0, 16, 4):  # four calls of four misses: lines 0..15 in order
        assert torch.equal(cache.gather(rows[a : a + 4]), init[a : a + 4])
        # which of its fresh lines each row takes is free (rows ascending take them in turn)
        assert sorted(cache.line_of_row[rows[a : a + 4]].tolist()) == list(range(a, a + 4))
    assert cache.counters.evictions == 0 and cache.counters.misses == 16
    # rows 0, 1 hit, rows 16, 17 miss: window lines 0..7; rows 0, 1's lines are this call's,
    # rows 2, 3's (first call) are older than 4..7 (second call): those two go
    first = cache.line_of_row[rows[:4]].tolist()
    call = rows[[0, 1, 16, 17]]
    assert torch.equal(cache.gather(call), init[[0, 1, 16, 17]])
    assert cache.counters.evictions == 2
    assert cache.line_of_row[rows[:4]].tolist() == [*first[:2], -1, -1]
    assert sorted(cache.line_of_row[rows[16:18]].tolist()) == sorted(first[2:])
    # the hand is at line 8 now: two misses take two of lines 8..11 (window 4, the same age),
    # not the older lines 4..7 behind the hand
    assert torch.equal(cache.gather(rows[18:20]), init[18:20])
    assert set(cache.line_of_row[rows[18:20]].tolist()) <= {8, 9, 10, 11}
    assert cache.counters.evictions == 4 and cache.counters.writebacks == 0
    exported = cache.export()
    assert exported.values is not None and torch.equal(exported.values, init[exported.keys])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares tiers on the GPU")
@pytest.mark.parametrize("strategy", STRATEGIES, ids=[s.value for s in STRATEGIES])
def test_on_cuda_a_cache_of_a_few_rows_equals_hbm_only(strategy: ScoreStrategy) -> None:
    hbm, cached = _dec(strategy, None, "cuda"), _dec(strategy, 0.01, "cuda")
    cache = cached._storages[0].payload
    assert isinstance(cache, RowCache) and isinstance(cache.store, TensorHostStore)
    # with the CUDA kernels the host tier's rows move through UVA (cuda/host_rows.py)
    assert cache.store.mapped == (cuda.unavailable_reason() is None)
    assert_close_on_cuda(_run(hbm), _run(cached, prefetch=True), hbm, cached)


def assert_close_on_cuda(
    outs_a: list[dict[str, torch.Tensor]],
    outs_b: list[dict[str, torch.Tensor]],
    a: DynamicEmbeddingCollection,
    b: DynamicEmbeddingCollection,
) -> None:
    """Two CUDA runs of :func:`_run` alike: outputs, values and Adagrad sums within the CUDA
    tests' tolerances; keys, scores, counters and stats equal."""
    for o1, o2 in zip(outs_a, outs_b, strict=True):
        for t in o1:
            torch.testing.assert_close(o1[t], o2[t], rtol=1e-6, atol=1e-7, msg=t)
    sa, sb = a.table_states(), b.table_states()
    for t in sa:
        for f in ("keys", "scores", "counter_keys", "counter_counts"):
            x, y = getattr(sa[t], f), getattr(sb[t], f)
            assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), (t, f)
        for f in ("values", "accumulators"):
            torch.testing.assert_close(getattr(sa[t], f), getattr(sb[t], f), rtol=1e-6, atol=1e-7)
    assert a.stats() == b.stats()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host tier")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_on_cuda_checkpoints_round_trip_into_a_cached_table(tmp_path, world_size: int) -> None:
    hbm = _dec(ScoreStrategy.LFU, None, "cuda")
    _run(hbm)
    for rank in range(world_size):
        hbm.save(tmp_path, "sparse", rank=rank, world_size=world_size)
    for rank in range(world_size):
        a, b = _dec(ScoreStrategy.LFU, None, "cuda"), _dec(ScoreStrategy.LFU, 0.02, "cuda")
        a.load(tmp_path, "sparse", rank=rank, world_size=world_size)
        b.load(tmp_path, "sparse", rank=rank, world_size=world_size)
        _assert_equal(a, b)
