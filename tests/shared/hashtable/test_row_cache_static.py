"""The static step on a CACHING storage (shared.hashtable.row_cache_static) equals HBM_ONLY's.

Step by step, bit for bit on CPU: misses read from the host tier, victims written back, new
keys' rows made in their lines, rows past the lines bypassed through staging slots, eager steps
while the tables grow then static ones on the same cache, checkpoints; the bare static resolve.
The same scripts run captured in CUDA graphs (``gpu``), compared within the CUDA tests'
tolerances. The eager cache's tests: ``test_row_cache.py`` (whose helpers these share).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from shared.features import LfuDecaySpec, ScoreStrategy
from shared.hashtable import host_memory, host_move
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.host_node_fill import HostNodeFill
from shared.hashtable.host_store import TensorHostStore
from shared.hashtable.layout import RowArrays
from shared.hashtable.row_cache import RowCache
from shared.hashtable.static_step import supports

from .conftest import NEEDS_CUDA_KERNELS, dyn_table
from .test_row_cache import FIELDS, STRATEGIES, _assert_equal, _bare_cache, _cached, _dec, _lines


def test_the_static_step_takes_a_cached_storage_whose_host_tier_the_device_reaches() -> None:
    """A CACHING storage takes the static step (at its max capacity) wherever its host tier is
    read and written with no host read: on CPU, or mapped on CUDA; a pinned store that is not
    mapped (no CUDA kernels) would move row ids through the host, and is refused."""
    cached = _dec(ScoreStrategy.STEP, 0.1)
    cached.reserve_max_capacity()
    assert supports(cached._storages[0]) is None
    hbm = _dec(ScoreStrategy.STEP, None)
    hbm.reserve_max_capacity()
    assert supports(hbm._storages[0]) is None
    store = TensorHostStore(2, capacity=8, pin=False)
    assert store.why_not_static(torch.device("cpu")) is None
    reason = store.why_not_static(torch.device("cuda"))
    assert reason is not None and "not mapped" in reason and "CuPy" in reason


def _static_dec(
    strategy: ScoreStrategy,
    factor: float | None,
    device: str = "cpu",
    *,
    grown: bool = True,
    lfu_decay: LfuDecaySpec | None = None,
    row_arrays: dict[str, RowArrays] | None = None,
    prefetch: bool = False,
) -> DynamicEmbeddingCollection:
    """Two fused tables of 1024 rows each (full buckets), one with admission, with the static
    sparse step (captured on CUDA); ``grown``: at their max capacity from the start, else
    growing from 64 rows each (eager steps until the max). ``row_arrays``: the collection's.
    ``prefetch``: the static step's prefetch on (``use_static_step(prefetch=True)``)."""
    init = 1024 if grown else 64
    kw = dict(init_capacity=init, bucket_capacity=16, max_capacity=1024, strategy=strategy,
              lfu_decay=lfu_decay)  # fmt: skip
    tables = [dyn_table("a_emb", **kw), dyn_table("b_emb", threshold=2, **kw)]  # type: ignore[arg-type]
    clock = itertools.count(1000, 7)
    dec = DynamicEmbeddingCollection(
        [_cached(t, factor) for t in tables], {"g": ["a_emb", "b_emb"]}, lr=0.03,
        initial_accumulator_value=0.1, device=device, clock=lambda: next(clock),
        row_arrays=row_arrays,
    )  # fmt: skip
    dec.use_static_step(capture=device == "cuda", prefetch=prefetch)
    if grown:
        dec.reserve_max_capacity()
    dec.train()
    return dec


def _static_batch(gen: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    """Skewed keys over a range that outgrows the tables (index evictions) and the lines
    (cache evictions), with duplicates; every 4th step a burst of new keys, each twice. At
    most 608 keys: padded to 640."""
    span = 1500 + 300 * step
    a = (torch.rand(200, generator=gen) ** 2 * span).long()
    b = torch.randint(0, 1500 + 100 * step, (100 + step,), generator=gen)
    if step % 4 == 3:
        burst = torch.arange(10_000 * step, 10_000 * step + 150)
        a = torch.cat([a, burst, burst])
    return {"a_emb": a, "b_emb": b}


def _assert_close(a: DynamicEmbeddingCollection, b: DynamicEmbeddingCollection) -> None:
    """:func:`_assert_equal` within the CUDA tests' tolerance for values and accumulators."""
    sa, sb = a.table_states(), b.table_states()
    for t in sa:
        for f in FIELDS:
            x, y = getattr(sa[t], f), getattr(sb[t], f)
            if f in ("values", "accumulators"):
                torch.testing.assert_close(x.cpu(), y.cpu(), rtol=1e-6, atol=1e-7, msg=str((t, f)))
            else:
                assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), (t, f)
    assert a.stats() == b.stats()


def _static_run(
    decs: list[DynamicEmbeddingCollection],
    steps: range,
    seed: int = 0,
    *,
    exact: bool = True,
    no_backward: tuple[int, ...] = (),
    prefetch: str = "",
    states_every: int = 1,
) -> None:
    """The same training steps on every collection, each compared with the first: rows, hit
    flags, then keys, values, scores, accumulators, admission counters and stats (bit for bit,
    or with ``exact`` False values within the CUDA tests' tolerance), the tables' states after
    every ``states_every``-th step and the last (reading them flushes every dirty line to the
    host tier: between two reads the fills write dirty victims back themselves). The steps of
    ``no_backward`` look up only (inserts, no update). ``prefetch``: each step's collections
    prefetch the next step's keys ``"before_backward"`` (between the lookup and its backward,
    on the collection's prefetch stream: on CUDA beside the backward, as the trainer runs it)
    or ``"after_backward"``."""
    gen = torch.Generator().manual_seed(seed)
    dev = decs[0].device
    batches = []
    for step in steps:
        keys = {n: k.to(dev) for n, k in _static_batch(gen, step).items()}
        grads = {n: torch.randn(k.numel(), 4, generator=gen).to(dev) for n, k in keys.items()}
        batches.append((step, keys, grads))
    for i, ((step, keys, grads), after) in enumerate(itertools.zip_longest(batches, batches[1:])):
        got = []
        for dec in decs:
            dec.set_step(step)
            rows, hits = dec.lookup(keys, hits=True)
            if prefetch == "before_backward" and after is not None:
                with dec.prefetch_stream():  # on CUDA a side stream, beside the backward
                    dec.prefetch(after[1])
            if step not in no_backward:
                loss = sum((rows[n] * grads[n]).sum() for n in keys)
                loss.backward()  # type: ignore[union-attr]
            if prefetch == "after_backward" and after is not None:
                dec.prefetch(after[1])
            got.append({n: (rows[n].detach().cpu(), hits[n].cpu()) for n in keys})
        for other, dec in zip(got[1:], decs[1:], strict=True):
            for n in keys:
                if exact:
                    assert torch.equal(got[0][n][0], other[n][0]), (step, n)
                else:
                    torch.testing.assert_close(got[0][n][0], other[n][0], rtol=1e-6, atol=1e-7)
                assert torch.equal(got[0][n][1], other[n][1]), (step, n)
            if (i + 1) % states_every == 0 or after is None:
                (_assert_equal if exact else _assert_close)(decs[0], dec)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=[s.value for s in STRATEGIES])
def test_the_static_step_on_a_cache_equals_it_on_hbm_only(strategy: ScoreStrategy) -> None:
    """A cache of 640 lines (the steps' padded size) under the static step, step by step bit
    for bit against HBM_ONLY's static step: misses read from the host tier, victims written
    back, new keys' rows made in their lines, index evictions and admission."""
    hbm, cached = _static_dec(strategy, None), _static_dec(strategy, 0.3125)
    assert _lines(cached) == 640
    # the tables' states read every 4th step: the fills between write dirty victims back
    _static_run([hbm, cached], range(1, 13), states_every=4)
    for dec in (hbm, cached):  # every step took the static path
        assert dec.static_stats()["g"] == {"captures": 0, "replays": 0, "eager": 12,
                                           "prefetches": 0, "prefetches_left_out": 0}  # fmt: skip
    s = cached.tier_stats()["g"]
    assert s["cache_hits"] > 0 and s["cache_misses"] > 0 and s["cache_created"] > 0
    assert s["cache_evictions"] > 0 and s["cache_writebacks"] > 0 and s["cache_bypassed"] == 0
    stats = hbm.stats()
    if strategy is ScoreStrategy.NO_EVICTION:
        assert stats["a_emb"]["refusals"] > 0
    else:
        assert stats["a_emb"]["evictions"] > 0
    assert stats["b_emb"]["admission_rejections"] > 0


def test_the_static_step_on_a_cache_with_lfu_decay_equals_it_on_hbm_only() -> None:
    """LFU counts halved every 2 steps: the decay shifts the index's scores (on the device
    for a CACHING storage too), so the cache takes the same index evictions as HBM_ONLY."""
    decay = LfuDecaySpec(interval_steps=2)
    hbm = _static_dec(ScoreStrategy.LFU, None, lfu_decay=decay)
    cached = _static_dec(ScoreStrategy.LFU, 0.3125, lfu_decay=decay)
    plain = _static_dec(ScoreStrategy.LFU, 0.3125)
    _static_run([hbm, cached], range(1, 13))
    _static_run([plain], range(1, 13))
    assert hbm.stats()["a_emb"]["evictions"] > 0
    decayed, counted = cached.table_state("a_emb").scores, plain.table_state("a_emb").scores
    assert int(decayed.sum()) < int(counted.sum())


def test_a_static_step_with_more_rows_than_lines_bypasses_them() -> None:
    """320 lines, steps of up to 640 padded keys: the rows a step cannot give a line (more
    distinct rows than lines, or lines the step uses itself) take staging slots, read from
    the host tier (or made from the initializer) in the forward and written back by the
    backward, all in fixed shapes; the results stay HBM_ONLY's."""
    hbm, cached = _static_dec(ScoreStrategy.LFU, None), _static_dec(ScoreStrategy.LFU, 0.15625)
    assert _lines(cached) == 320
    # steps 3 and 7 (bursts of new keys) without a backward: a bypassed new key's row is in
    # the host tier all the same
    _static_run([hbm, cached], range(1, 13), no_backward=(3, 7))
    assert cached.static_stats()["g"]["eager"] == 12
    s = cached.tier_stats()["g"]
    assert s["cache_bypassed"] > 0 and s["cache_created"] > 0 and s["cache_evictions"] > 0


def test_eager_steps_while_the_tables_grow_then_static_ones_share_the_cache() -> None:
    """Tables that grow take eager steps (the eager resolve, with one host read) until their
    max capacity, then the static step: both on one cache (the device's clock and hand, the
    maps, the lines the eager resolve thought never used), with HBM_ONLY's results."""
    hbm = _static_dec(ScoreStrategy.STEP, None, grown=False)
    cached = _static_dec(ScoreStrategy.STEP, 0.3125, grown=False)
    _static_run([hbm, cached], range(1, 13))
    for dec in (hbm, cached):
        ran = dec.static_stats()["g"]["eager"]
        assert 0 < ran < 12, ran  # some steps took the static path, the first ones not
    s = cached.tier_stats()["g"]
    assert s["cache_created"] > 0 and s["cache_evictions"] > 0 and s["cache_misses"] > 0


def test_without_prefetching_a_storage_on_the_static_step_prefetches_nothing() -> None:
    """The static step reads its misses inside its graph: unless prefetching is on
    (``use_static_step(prefetch=True)``), a prefetch does nothing there (the eager one would
    repeat its find and add a host read a step)."""
    cached = _static_dec(ScoreStrategy.STEP, 0.15625)  # 320 lines: the steps evict
    _static_run([cached], range(1, 5))
    before = cached.tier_stats()["g"]
    cached.prefetch(_static_batch(torch.Generator().manual_seed(0), 1))  # stored, evicted keys
    assert cached.tier_stats()["g"] == before
    assert before["cache_prefetched"] == 0
    assert cached.static_stats()["g"]["prefetches"] == 0


@pytest.mark.parametrize("when", ["before_backward", "after_backward"])
def test_a_static_prefetch_brings_the_next_rows_and_changes_nothing_else(when: str) -> None:
    """Each step prefetches the next one's stored rows into lines (the static form: a find and
    a fill in fixed shapes), between its lookup and its backward (where the trainer's side
    stream runs it) or after the backward: the backward is still accepted (the prefetch never
    takes the lines of the step in flight), every step equals HBM_ONLY's bit for bit, and the
    next steps hit more and read fewer rows themselves."""
    hbm = _static_dec(ScoreStrategy.STEP, None, prefetch=True)
    cached = _static_dec(ScoreStrategy.STEP, 0.3125, prefetch=True)
    plain = _static_dec(ScoreStrategy.STEP, 0.3125)
    _static_run([hbm, cached], range(1, 13), prefetch=when)
    _static_run([plain], range(1, 13))
    ran = cached.static_stats()["g"]
    assert ran["prefetches"] == 11 and ran["eager"] == 12, ran
    assert hbm.static_stats()["g"]["prefetches"] == 0  # HBM_ONLY: nothing to bring
    s, p = cached.tier_stats()["g"], plain.tier_stats()["g"]
    assert s["cache_prefetched"] > 0 and p["cache_prefetched"] == 0
    # the steps' own reads: the misses less the prefetched rows (counted as misses too)
    assert s["cache_misses"] - s["cache_prefetched"] < p["cache_misses"]
    assert s["cache_hits"] > p["cache_hits"]


def test_a_static_prefetch_after_eager_steps_while_the_tables_grow_changes_nothing() -> None:
    """Tables that grow take eager steps, then static ones; the prefetch takes the static form
    once the next lookup is static, beside eager and static steps alike: HBM_ONLY's run."""
    hbm = _static_dec(ScoreStrategy.STEP, None, grown=False, prefetch=True)
    cached = _static_dec(ScoreStrategy.STEP, 0.3125, grown=False, prefetch=True)
    _static_run([hbm, cached], range(1, 13), prefetch="before_backward")
    ran = cached.static_stats()["g"]
    assert 0 < ran["prefetches"] < 11, ran


def test_no_static_prefetch_beside_a_step_that_may_bypass_rows() -> None:
    """A step of more keys than lines bypasses rows, and its backward writes them to the host
    tier, which a prefetch beside it could read: there is no prefetch then (and the steps are
    HBM_ONLY's all the same)."""
    hbm = _static_dec(ScoreStrategy.LFU, None, prefetch=True)
    cached = _static_dec(ScoreStrategy.LFU, 0.125, prefetch=True)
    assert _lines(cached) == 256  # the steps pad their 301 to 608 keys to 304 to 640
    _static_run([hbm, cached], range(1, 7), prefetch="before_backward")
    assert cached.static_stats()["g"]["prefetches"] == 0
    s = cached.tier_stats()["g"]
    assert s["cache_prefetched"] == 0 and s["cache_bypassed"] > 0


def test_a_static_step_on_a_cache_refuses_a_backward_after_lines_moved() -> None:
    """An eager resolve (here an eval lookup) between a static lookup and its backward may
    take its lines: the backward is refused, saying what to do."""
    cached = _static_dec(ScoreStrategy.STEP, 0.3125)
    for step in range(3):  # 900 rows stored, 640 lines
        cached.set_step(step)
        keys = torch.arange(300 * step, 300 * step + 300)
        cached({"a_emb": keys, "b_emb": torch.arange(5)})["a_emb"].sum().backward()
    cached.set_step(3)
    out = cached({"a_emb": torch.arange(900, 920), "b_emb": torch.arange(5)})
    cached.eval()  # an eval lookup (eager) of 900 rows: lines evicted
    cached({"a_emb": torch.arange(0, 900)})
    cached.train()
    with pytest.raises(RuntimeError, match="run it after the backward"):
        out["a_emb"].sum().backward()


@pytest.mark.parametrize("world_size", [1, 2])
def test_static_steps_on_a_cache_round_trip_a_checkpoint(tmp_path, world_size: int) -> None:
    """Checkpoints written by a cached storage after static steps are HBM_ONLY's files, and
    training on from them (across the tiers) stays equal step by step."""
    hbm, cached = _static_dec(ScoreStrategy.LFU, None), _static_dec(ScoreStrategy.LFU, 0.3125)
    _static_run([hbm, cached], range(1, 7))
    for rank in range(world_size):
        hbm.save(tmp_path / "h", "sparse", rank=rank, world_size=world_size)
        cached.save(tmp_path / "c", "sparse", rank=rank, world_size=world_size)
    files = sorted(p.name for p in (tmp_path / "h" / "dynamicemb" / "sparse").iterdir())
    for name in files:
        a = (tmp_path / "h" / "dynamicemb" / "sparse" / name).read_bytes()
        assert a == (tmp_path / "c" / "dynamicemb" / "sparse" / name).read_bytes(), name
    for rank in range(world_size):
        into_hbm = _static_dec(ScoreStrategy.LFU, None)
        into_cached = _static_dec(ScoreStrategy.LFU, 0.3125)
        into_hbm.load(tmp_path / "c", "sparse", rank=rank, world_size=world_size)
        into_cached.load(tmp_path / "h", "sparse", rank=rank, world_size=world_size)
        _assert_equal(into_hbm, into_cached)
        _static_run([into_hbm, into_cached], range(7, 11), seed=rank + 1)
        assert into_cached.static_stats()["g"]["eager"] == 4


def test_the_static_resolve_gives_lines_without_touching_the_host_tier_for_new_rows() -> None:
    """A bare cache's static resolve: hits stamped in place, a stored row read into a line, a
    new row's line made from its initializer (the host tier's row stays as it was, the line
    dirty), and the window's victims never the call's own lines; evictions write back."""
    cache, store, rows, init = _bare_cache(lines=4, keys=6)
    cache.gather(rows[:2])  # eager: rows 0, 1 in lines 0, 1 (clean)
    cache.adagrad(rows[:2], torch.ones(2, 2), AdagradConfig(0.1, 1e-10, 0.5))  # now dirty
    before = store.rows.clone()
    got = cache.static_resolve(
        torch.tensor([rows[0], rows[2], rows[3], -1]),  # a hit, a stored row, a "new" one
        torch.tensor([True, True, False, False]),
        torch.full((4, 2), 9.0),
    )
    lines = got.tolist()
    assert lines[0] == 0 and lines[3] == -1 and len(set(lines[:3])) == 3
    assert torch.equal(cache.values[lines[1]], init[2])  # read from the host tier
    assert torch.equal(cache.values[lines[2]], torch.full((2,), 9.0))  # its initializer
    assert torch.equal(cache.accum[lines[2]], torch.full((2,), 0.5))
    assert cache.dirty[lines[2]] and not cache.dirty[lines[1]] and cache.dirty[0]
    assert torch.equal(store.rows, before)  # line 1 (dirty) was not a victim: nothing written
    c = cache.counters
    assert (c.hits, c.misses, c.created) == (2 + 1, 2 + 1, 1)  # eager's, then the static one
    # the next call needs 3 lines besides the hit on row 2: rows 0, 1 (dirty) go back
    cache.static_resolve(
        torch.tensor([rows[2], rows[4], rows[5], rows[1]]),
        torch.tensor([True, True, True, True]),
        torch.zeros(4, 2),
    )
    assert cache.line_of_row[rows[0]] == -1 and cache.counters.writebacks >= 1
    assert store.rows[rows[0]].tolist() != before[rows[0]].tolist()  # written back


def test_the_static_resolve_pairs_rows_read_with_victims_in_host_row_order() -> None:
    """The re-pairing behind the one-launch fill: the k-th smallest row read takes the line
    of the victim whose write-back row is the k-th smallest, the returned order walks the
    positions that get a line first, by their row read, and the victims, their write-back
    rows and the positions without a line are the resolve's own (only who takes which line
    changes)."""
    cache, _store, _rows, _init = _bare_cache(lines=16, keys=10)
    gen = torch.Generator().manual_seed(3)
    p = 12
    gets = torch.rand(p, generator=gen) < 0.6
    gets[:2] = True  # a few at least
    n = int(gets.sum())
    big = cache.lines
    taken = torch.full((p,), big, dtype=torch.int64)
    taken[gets] = torch.randperm(big, generator=gen)[:n]  # distinct victim lines
    back = torch.full((p,), -1, dtype=torch.int64)
    dirty = gets & (torch.rand(p, generator=gen) < 0.5)
    back[dirty] = torch.randperm(10, generator=gen)[: int(dirty.sum())]
    read = torch.full((p,), -1, dtype=torch.int64)
    stored = gets & (torch.rand(p, generator=gen) < 0.8)  # the others: new keys (-1)
    read[stored] = torch.randperm(10, generator=gen)[: int(stored.sum())]
    paired_taken, paired_back, order = cache._pair_in_row_order(gets, taken, back, read)
    walked = order[:n]
    assert bool(gets[walked].all()) and not bool(gets[order[n:]].any())
    assert read[walked].tolist() == sorted(read[gets].tolist())
    assert paired_back[walked].tolist() == sorted(back[gets].tolist())
    # the same victims, each with its own write-back row
    assert sorted(
        zip(paired_taken[gets].tolist(), paired_back[gets].tolist(), strict=True)
    ) == sorted(zip(taken[gets].tolist(), back[gets].tolist(), strict=True))
    assert bool((paired_taken[~gets] == big).all()) and bool((paired_back[~gets] == -1).all())


def test_the_host_node_fill_needs_a_cuda_storage_with_a_mapped_tier() -> None:
    """Opt-in, and refused where it cannot run, naming what is missing."""
    cached = _static_dec(ScoreStrategy.STEP, 0.3125)  # on the CPU: nothing to map
    cache = cached._storages[0].payload
    assert isinstance(cache, RowCache)
    with pytest.raises(ValueError, match="needs a CUDA storage whose host tier is mapped"):
        cache.fill_with_host_node(threads=2)
    with pytest.raises(ValueError, match="needs a mapped host tier"):
        HostNodeFill(TensorHostStore(4, capacity=8, pin=False), 4, threads=2)


def test_the_cores_moving_a_collections_cached_rows_need_a_cuda_storage() -> None:
    """``move_cache_rows_with_cores`` (train --cache-row-threads): nothing to do without a cache,
    and the host-node fill's refusal on the CPU, naming what is missing."""
    assert _static_dec(ScoreStrategy.STEP, None).move_cache_rows_with_cores(2) == []
    cached = _static_dec(ScoreStrategy.STEP, 0.3125)
    with pytest.raises(ValueError, match="needs a CUDA storage whose host tier is mapped"):
        cached.move_cache_rows_with_cores(2)


def _beside(dec: DynamicEmbeddingCollection, rows: int, cores: int | None = None) -> RowCache:
    """The collection's cache, its write-backs staged and written beside the step
    (``write_back_beside(rows, cores)``)."""
    if cores is not None and host_move.unavailable_reason() is not None:
        pytest.skip(f"the native mover cannot be built here: {host_move.unavailable_reason()}")
    cache = dec._storages[0].payload
    assert isinstance(cache, RowCache)
    cache.write_back_beside(rows, cores)
    return cache


@pytest.mark.parametrize("cores", [None, 3], ids=["by_the_store", "by_3_cores"])
@pytest.mark.parametrize("rows", [4096, 8], ids=["all_staged", "most_left_to_the_fill"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=[s.value for s in STRATEGIES])
def test_static_steps_writing_back_beside_equal_them_on_hbm_only(
    strategy: ScoreStrategy, rows: int, cores: int | None
) -> None:
    """The write-backs staged in the forward and written to the host tier after it
    (shared.hashtable.write_back_beside), every one of them or only the first 8 a step (the
    rest by the fill, as without staging), by the store or by the native mover on 3 threads:
    step by step bit for bit against HBM_ONLY's static step and the cache without staging, the
    same evictions and write-backs counted."""
    hbm, plain = _static_dec(strategy, None), _static_dec(strategy, 0.3125)
    staged = _static_dec(strategy, 0.3125)
    cache = _beside(staged, rows, cores)
    most = []
    stage = cache._beside.stage  # type: ignore[union-attr]

    def counted(slots: torch.Tensor, back: torch.Tensor, *arrays: torch.Tensor) -> torch.Tensor:
        most.append(int((back >= 0).sum()))  # the step's write-backs
        return stage(slots, back, *arrays)

    cache._beside.stage = counted  # type: ignore[method-assign,union-attr]
    _static_run([hbm, plain, staged], range(1, 13), states_every=6)
    assert staged.static_stats()["g"]["eager"] == 12
    assert max(most) > 8  # some step staged 8 and left the rest to the fill
    s, want = staged.tier_stats()["g"], plain.tier_stats()["g"]
    assert s == want
    spent = cache.host_move_spent()  # the cores' moves counted (none by the store)
    assert spent == {} if cores is None else spent["write_back"][1] > 0


def test_static_steps_writing_back_beside_after_eager_steps_and_with_bypassed_rows() -> None:
    """Staged write-backs where the tables grow first (eager steps on the same cache), and
    where a step has more rows than lines (bypassed rows, written back by the backward beside
    the staged victims): HBM_ONLY's results."""
    hbm = _static_dec(ScoreStrategy.STEP, None, grown=False)
    cached = _static_dec(ScoreStrategy.STEP, 0.3125, grown=False)
    _beside(cached, 64)
    _static_run([hbm, cached], range(1, 13), states_every=6)
    assert 0 < cached.static_stats()["g"]["eager"] < 12
    hbm, small = _static_dec(ScoreStrategy.LFU, None), _static_dec(ScoreStrategy.LFU, 0.15625)
    _beside(small, 64)
    _static_run([hbm, small], range(1, 13), no_backward=(3, 7), states_every=6)
    s = small.tier_stats()["g"]
    assert s["cache_bypassed"] > 0 and s["cache_writebacks"] > 0


def test_write_back_beside_refuses_no_staging_rows() -> None:
    """A staging of no rows is refused, naming the argument."""
    cache = _static_dec(ScoreStrategy.STEP, 0.3125)._storages[0].payload
    assert isinstance(cache, RowCache)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        cache.write_back_beside(0)
    with pytest.raises(ValueError, match="cores must be >= 1 host threads"):
        cache.write_back_beside(64, cores=0)


@pytest.fixture
def driver_memory() -> Iterator[None]:
    """Host tiers made in the CUDA driver's memory (shared.hashtable.host_memory) meanwhile."""
    with host_memory.using("driver"):
        yield


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS  # the host tier mapped: the static step's swap runs in the graph
@pytest.mark.parametrize("strategy", STRATEGIES, ids=[s.value for s in STRATEGIES])
@pytest.mark.parametrize(
    "fill",
    ["device", "host_node", "device_driver_memory", "device_beside", "host_node_beside",
     "device_cores_beside", "host_node_cores_beside"],
)  # fmt: skip
def test_on_cuda_the_captured_static_step_on_a_cache_equals_hbm_only(
    strategy: ScoreStrategy, fill: str, request: pytest.FixtureRequest
) -> None:
    """The static step on a 640-line cache captured in CUDA graphs and replayed (the resolve,
    the host tier's swap through UVA, the gather from lines; the backward on lines), step by
    step against HBM_ONLY's captured static step. ``host_node``: the fill's rows moved by the
    host's cores, as a host node of the graph (shared.hashtable.host_node_fill);
    ``device_driver_memory``: the device's fill over a host tier in the CUDA driver's memory;
    ``device_beside``: the device's fill, its write-backs staged and written after the forward
    on a stream of their own (at most 64 a step: the rest by the fill); ``host_node_beside``:
    both, the host node's cores then reading rows and writing back only the rest;
    ``*_cores_beside``: the staged rows written by 3 host threads (a host function on the
    flush's stream), not the device."""
    if fill.startswith("host_node") and host_move.unavailable_reason() is not None:
        pytest.skip(f"the native mover cannot be built here: {host_move.unavailable_reason()}")
    if fill == "device_driver_memory":
        request.getfixturevalue("driver_memory")
    hbm, cached = _static_dec(strategy, None, "cuda"), _static_dec(strategy, 0.3125, "cuda")
    cache = cached._storages[0].payload
    assert isinstance(cache, RowCache) and isinstance(cache.store, TensorHostStore)
    assert cache.store.mapped and cache.why_not_static() is None
    want = "driver" if fill == "device_driver_memory" else "register"
    assert cache.store.memory == want
    if fill.startswith("host_node"):
        cache.fill_with_host_node(threads=3)
    if fill.endswith("beside"):
        _beside(cached, 64, 3 if fill.endswith("cores_beside") else None)
    _static_run([hbm, cached], range(1, 13), exact=False, states_every=4)
    for dec in (hbm, cached):
        ran = dec.static_stats()["g"]
        assert ran["replays"] == 12 and 0 < ran["captures"] < 12, ran
        assert ran["eager"] == 0, ran
    s = cached.tier_stats()["g"]
    assert s["cache_hits"] > 0 and s["cache_misses"] > 0 and s["cache_created"] > 0
    assert s["cache_evictions"] > 0 and s["cache_writebacks"] > 0 and s["cache_bypassed"] == 0


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("fill", ["device", "host_node", "device_beside", "cores_beside"])
def test_on_cuda_a_captured_static_prefetch_beside_the_backward_changes_nothing(fill: str) -> None:
    """Each step's prefetch of the next step's rows captured and replayed on the collection's
    side stream, from the end of the step's lookup on, beside its backward (the trainer's
    order): every step equals HBM_ONLY's captured one within the CUDA tolerances, and the
    prefetch read rows."""
    if fill == "host_node" and host_move.unavailable_reason() is not None:
        pytest.skip(f"the native mover cannot be built here: {host_move.unavailable_reason()}")
    hbm = _static_dec(ScoreStrategy.STEP, None, "cuda", prefetch=True)
    cached = _static_dec(ScoreStrategy.STEP, 0.3125, "cuda", prefetch=True)
    cache = cached._storages[0].payload
    assert isinstance(cache, RowCache)
    if fill == "host_node":
        cache.fill_with_host_node(threads=3)
    if fill.endswith("beside"):  # the prefetch waits for the step's staged write-backs
        _beside(cached, 64, 3 if fill == "cores_beside" else None)
    _static_run([hbm, cached], range(1, 13), exact=False, prefetch="before_backward")
    ran = cached.static_stats()["g"]
    assert ran["replays"] == 12 and ran["eager"] == 0, ran
    # the host node's arrays are sized by the steps: a prefetch larger than every step so far
    # is left out (its rows read by its step), and the next step makes them ready for it
    left_out = 0 if fill != "host_node" else ran["prefetches_left_out"]
    assert ran["prefetches"] == 11 - left_out and ran["prefetches_left_out"] == left_out, ran
    assert cached._ahead is not None  # the side stream ran them
    s = cached.tier_stats()["g"]
    assert s["cache_prefetched"] > 0 and s["cache_bypassed"] == 0


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
def test_on_cuda_the_captured_static_step_on_a_cache_with_lfu_decay_equals_hbm_only() -> None:
    """The decay between replays (an in-place shift of the index's scores on the device) with
    the captured static step on a 640-line cache, against HBM_ONLY's."""
    decay = LfuDecaySpec(interval_steps=2)
    hbm = _static_dec(ScoreStrategy.LFU, None, "cuda", lfu_decay=decay)
    cached = _static_dec(ScoreStrategy.LFU, 0.3125, "cuda", lfu_decay=decay)
    _static_run([hbm, cached], range(1, 13), exact=False)
    for dec in (hbm, cached):
        ran = dec.static_stats()["g"]
        assert ran["replays"] == 12 and ran["eager"] == 0, ran
    assert hbm.stats()["a_emb"]["evictions"] > 0


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
def test_on_cuda_a_captured_static_step_bypasses_rows_past_the_lines() -> None:
    """320 lines, steps of up to 640 padded keys: the captured step bypasses rows through its
    staging slots (read through UVA in the forward's graph, written back in the backward's)."""
    hbm = _static_dec(ScoreStrategy.LFU, None, "cuda")
    cached = _static_dec(ScoreStrategy.LFU, 0.15625, "cuda")
    _static_run([hbm, cached], range(1, 13), exact=False)
    ran = cached.static_stats()["g"]
    assert ran["replays"] == 12 and ran["eager"] == 0, ran
    assert cached.tier_stats()["g"]["cache_bypassed"] > 0


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("memory", ["register", "driver", "register_beside", "register_cores"])
def test_on_cuda_eager_steps_while_the_tables_grow_then_captured_ones_share_the_cache(
    memory: str, request: pytest.FixtureRequest
) -> None:
    """Growth moves the host tier's rows into new memory of the same kind (``driver``: the
    CUDA driver's, shared.hashtable.host_memory), then captured steps run on it;
    ``register_beside``: their write-backs staged and written beside the step, which the eager
    steps' and the growth's device calls wait for; ``register_cores``: written by 3 host
    threads (their mover made again over the grown rows)."""
    if memory == "driver":
        request.getfixturevalue("driver_memory")
    hbm = _static_dec(ScoreStrategy.STEP, None, "cuda", grown=False)
    cached = _static_dec(ScoreStrategy.STEP, 0.3125, "cuda", grown=False)
    if memory in ("register_beside", "register_cores"):
        _beside(cached, 64, 3 if memory == "register_cores" else None)
        memory = "register"
    _static_run([hbm, cached], range(1, 13), exact=False, states_every=4)
    for dec in (hbm, cached):
        assert 0 < dec.static_stats()["g"]["replays"] < 12
    cache = cached._storages[0].payload
    assert isinstance(cache, RowCache) and isinstance(cache.store, TensorHostStore)
    assert cache.store.memory == memory
