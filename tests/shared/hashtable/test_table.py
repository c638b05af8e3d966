"""HashTable: find/insert/erase/export, growth, eviction, refusals, bulk build."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable.hashing import GOLDEN, MASK64, fingerprint, mix64_int, to_signed
from shared.hashtable.layout import Counts
from shared.hashtable.table import HashTable

from .conftest import dyn_table


def _rows_of(table: HashTable, keys: torch.Tensor, tids: torch.Tensor | None = None):
    rows, found = table.find(keys, tids)
    assert bool(found.all())
    return rows


def _check_invariants(t: HashTable) -> None:
    fp = t._slot_fp
    assert bool((fp[1:] >= fp[:-1]).all()), "slot array must stay sorted"
    occupied = t._row_key[t._slot_row] >= 0
    per_bucket = occupied.view(-1, t.bucket_capacity).sum(1)
    assert torch.equal(per_bucket, t._bucket_count)
    assert t.size == int((t._row_key >= 0).sum()) == int(per_bucket.sum())
    assert torch.equal(torch.sort(t._slot_row).values, torch.arange(t.capacity))


def test_find_after_insert_returns_inserted_rows():
    t = HashTable(3, init_capacity=256, max_capacity=256, bucket_capacity=32)
    keys = torch.tensor([0, 7, 1 << 40, (1 << 63) - 1, 12345])
    vals = torch.arange(15, dtype=torch.float32).view(5, 3)
    res = t.insert_or_assign(keys, vals, torch.arange(5))
    assert res.inserted.all() and res.num_refused == 0 and t.size == 5
    rows, found = t.find(keys)
    assert found.all() and torch.equal(rows, res.rows)
    assert torch.equal(t.values[rows], vals)
    assert torch.equal(t.scores_of(rows), torch.arange(5))
    rows, found = t.find(torch.tensor([1, 8, 99]))
    assert not found.any() and rows.tolist() == [-1, -1, -1]
    _check_invariants(t)


def test_assign_existing_and_duplicates_last_wins():
    t = HashTable(2, init_capacity=64, max_capacity=64, bucket_capacity=16)
    t.insert_or_assign(torch.tensor([1, 2]), torch.ones(2, 2), torch.tensor([1, 1]))
    rows_before = _rows_of(t, torch.tensor([1, 2]))
    vals = torch.tensor([[5.0, 5.0], [6.0, 6.0], [7.0, 7.0]])
    res = t.insert_or_assign(torch.tensor([2, 3, 2]), vals, torch.tensor([4, 5, 6]))
    assert res.inserted.tolist() == [False, True, False]
    assert torch.equal(_rows_of(t, torch.tensor([1, 2])), rows_before)  # rows do not move
    rows = _rows_of(t, torch.tensor([1, 2, 3]))
    assert t.values[rows].tolist() == [[1.0, 1.0], [7.0, 7.0], [6.0, 6.0]]
    assert t.scores_of(rows).tolist() == [1, 6, 5]


def test_a_deferred_size_change_is_applied_before_the_size_is_read_or_set():
    """TableLayout._defer (the CUDA erase with count=False, the CUDA overflow with
    exact=False): the size and counters stay exact."""
    t = HashTable(1, init_capacity=128, max_capacity=128, bucket_capacity=16)
    keys = torch.arange(10)
    t.insert_or_assign(keys, keys.float()[:, None], keys)
    reads: list[int] = []

    def later(change: int) -> Callable[[], Counts]:
        def count() -> Counts:
            reads.append(change)
            return Counts(change, evictions=2 * change, refusals=3)

        return count

    t._defer(later(-2))
    t._defer(later(-3))
    assert reads == [] and len(t._pending) == 2  # nothing read at the call
    assert t.size == 5 and reads == [-2, -3] and t._pending == []
    assert t.size == 5 and reads == [-2, -3]  # read once
    assert (t.evictions, t.refusals) == (-10, 6)  # (not real counts: what was deferred)
    t._defer(later(-1))
    t._size += 7  # an assignment applies the pending change first: 5 - 1 + 7
    assert t._size == 11 and reads == [-2, -3, -1]
    t._defer(later(4))
    assert t.load_factor == 15 / t.capacity
    t._defer(later(0))
    t.refusals += 1  # the counters settle alike
    assert t._pending == [] and t.refusals == 6 + 3 + 3 + 3 + 1
    t._defer(later(-15))
    copy = t.to("cpu")  # settled first: the copy has the size and nothing pending
    assert copy._pending == [] and t._pending == [] and copy.size == t.size == 0


def test_erase_without_count_removes_the_same_keys():
    """count=False: None, the same table (the torch backend counts and checks anyway)."""
    tables = [HashTable(2, init_capacity=256, max_capacity=256, bucket_capacity=16) for _ in "ab"]
    keys, tids = torch.arange(120), torch.arange(120) % 3
    for t in tables:
        t.insert_or_assign(keys, keys.float()[:, None].repeat(1, 2), keys, table_ids=tids)
    gone = torch.tensor([3, 4, 4, 1000, 7])
    assert tables[0].erase(gone, gone % 3) == 3
    assert tables[1].erase(gone, gone % 3, count=False) is None
    a, b = tables
    assert a.size == b.size == 117 and torch.equal(a._slot_fp, b._slot_fp)
    assert torch.equal(a._row_key, b._row_key) and torch.equal(a._bucket_count, b._bucket_count)
    _check_invariants(b)


def test_erase_and_reinsert():
    t = HashTable(1, init_capacity=128, max_capacity=128, bucket_capacity=16)
    keys = torch.arange(50)
    t.insert_or_assign(keys, keys.float()[:, None], keys)
    assert t.erase(torch.tensor([3, 4, 4, 1000])) == 2
    _, found = t.find(keys)
    assert found.tolist() == [k not in (3, 4) for k in range(50)]
    assert torch.equal(t.values[_rows_of(t, keys[5:])].squeeze(1), keys[5:].float())
    t.insert_or_assign(torch.tensor([4]), torch.tensor([[40.0]]), torch.tensor([0]))
    assert t.values[_rows_of(t, torch.tensor([4]))].item() == 40.0
    assert t.size == 49
    _check_invariants(t)


def test_growth_preserves_every_key_and_row():
    t = HashTable(4, init_capacity=16, max_capacity=1 << 14, bucket_capacity=8)
    g = torch.Generator().manual_seed(0)
    keys = torch.unique(torch.randint(0, 1 << 62, (3000,), generator=g))
    vals = torch.randn(keys.numel(), 4, generator=g)
    for chunk in torch.arange(keys.numel()).split(300):
        t.insert_or_assign(keys[chunk], vals[chunk], chunk)
        _check_invariants(t)
    assert t.size == keys.numel() and t.evictions == 0 and t.refusals == 0
    assert t.generation > 0 and t.capacity > 16
    assert t.load_factor <= t.max_load_factor
    rows = _rows_of(t, keys)
    assert torch.equal(t.values[rows], vals)
    assert torch.equal(t.scores_of(rows), torch.arange(keys.numel()))
    exported = t.export()
    order = torch.argsort(keys)
    assert torch.equal(exported.keys, keys[order]) and torch.equal(exported.values, vals[order])


def test_reserve_max_capacity_keeps_every_entry():
    t = HashTable(4, init_capacity=16, max_capacity=1 << 12, bucket_capacity=8,
                  with_accumulator=True)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    keys = torch.unique(torch.randint(0, 1 << 62, (200,), generator=g))
    tids = torch.randint(0, 3, (keys.numel(),), generator=g)
    vals = torch.randn(keys.numel(), 4, generator=g)
    acc = torch.rand(keys.numel(), 4, generator=g)
    t.insert_or_assign(keys, vals, torch.arange(keys.numel()), table_ids=tids, accumulators=acc)
    before, generation = t.export(), t.generation
    assert t.capacity < t.max_capacity
    assert t.reserve_max_capacity()
    _check_invariants(t)
    assert t.capacity == t.max_capacity and t.generation == generation + 1
    after = t.export()
    for name in ("keys", "values", "scores", "accumulators", "table_ids"):
        assert torch.equal(getattr(after, name), getattr(before, name)), name
    assert t.evictions == 0 and t.refusals == 0
    assert not t.reserve_max_capacity()  # already there: nothing moves
    assert t.generation == generation + 1


def test_reserve_max_capacity_of_an_empty_table():
    t = HashTable(2, init_capacity=8, max_capacity=256, bucket_capacity=8)
    assert t.reserve_max_capacity()
    _check_invariants(t)
    assert t.capacity == 256 and t.size == 0


def test_growth_stops_at_max_capacity_then_evicts():
    t = HashTable(1, init_capacity=8, max_capacity=64, bucket_capacity=8)
    keys = torch.arange(200)
    for chunk in keys.split(20):
        t.insert_or_assign(chunk, chunk.float()[:, None], chunk)
    assert t.capacity == 64 and t.size <= 64 and t.evictions == 200 - t.size
    exported = t.export()  # whatever stayed still has its own value
    assert torch.equal(exported.values.squeeze(1), exported.keys.float())
    _check_invariants(t)


def _one_bucket(strategy: ScoreStrategy) -> HashTable:
    t = HashTable(1, init_capacity=4, max_capacity=4, bucket_capacity=4, score_strategy=strategy)
    keys = torch.tensor([10, 11, 12, 13])
    t.insert_or_assign(keys, keys.float()[:, None], torch.tensor([5, 2, 9, 7]))
    assert t.num_buckets == 1 and t.size == 4
    return t


def test_full_bucket_evicts_lowest_score():
    t = _one_bucket(ScoreStrategy.STEP)
    res = t.insert_or_assign(torch.tensor([14]), torch.tensor([[14.0]]), torch.tensor([8]))
    assert res.evicted_keys.tolist() == [11] and res.inserted.tolist() == [True]
    assert t.evictions == 1 and t.size == 4
    exported = t.export()
    assert exported.keys.tolist() == [10, 12, 13, 14]
    assert torch.equal(exported.values.squeeze(1), exported.keys.float())
    # a tie with the lowest score: the newcomer stays
    res = t.insert_or_assign(torch.tensor([15]), torch.tensor([[15.0]]), torch.tensor([5]))
    assert res.evicted_keys.tolist() == [10]
    # a newcomer below every score is refused
    res = t.insert_or_assign(torch.tensor([16]), torch.tensor([[16.0]]), torch.tensor([1]))
    assert res.rows.tolist() == [-1] and res.num_refused == 1 and t.refusals == 1
    _check_invariants(t)


def test_decay_scores_shifts_every_lfu_count_in_place_and_then_a_newcomer_fits():
    t = _one_bucket(ScoreStrategy.LFU)  # counts 10:5, 11:2, 12:9, 13:7
    scores = t._row_score
    res = t.insert_or_assign(torch.tensor([14]), torch.tensor([[14.0]]), torch.tensor([1]))
    assert res.num_refused == 1  # below every count of the full bucket
    t.decay_scores(1)
    assert t._row_score is scores  # in place: a captured step keeps reading the same tensor
    assert t.export().scores.tolist() == [2, 1, 4, 3]  # floor(count / 2)
    assert int(t._row_score[t._row_key < 0].abs().sum()) == 0  # free rows stay 0
    t.decay_scores(2)
    assert t.export().scores.tolist() == [0, 0, 1, 0]
    res = t.insert_or_assign(torch.tensor([14]), torch.tensor([[14.0]]), torch.tensor([1]))
    assert res.inserted.tolist() == [True]  # over one of the counts now 0 (ties: fingerprint)
    assert res.evicted_keys.tolist()[0] in (10, 11, 13)
    _check_invariants(t)


def test_decay_scores_refuses_scores_that_are_not_use_counts():
    for strategy in (ScoreStrategy.STEP, ScoreStrategy.TIMESTAMP, ScoreStrategy.NO_EVICTION):
        with pytest.raises(ValueError, match="not LFU use counts"):
            _one_bucket(strategy).decay_scores(1)


def test_pinned_rows_are_not_evicted():
    t = _one_bucket(ScoreStrategy.LFU)
    pinned = _rows_of(t, torch.tensor([11]))  # score 2, the lowest
    res = t.insert_or_assign(
        torch.tensor([14]), torch.tensor([[14.0]]), torch.tensor([8]), pinned_rows=pinned
    )
    assert res.evicted_keys.tolist() == [10]  # next lowest (5)
    assert t.export().keys.tolist() == [11, 12, 13, 14]


def test_no_eviction_refuses_and_counts():
    t = _one_bucket(ScoreStrategy.NO_EVICTION)
    res = t.insert_or_assign(
        torch.tensor([14, 15]), torch.tensor([[14.0], [15.0]]), torch.tensor([100, 100])
    )
    assert res.rows.tolist() == [-1, -1] and res.num_refused == 2
    assert t.refusals == 2 and t.evictions == 0
    assert t.export().keys.tolist() == [10, 11, 12, 13]
    t.erase(torch.tensor([12]))  # room again: accepted
    res = t.insert_or_assign(torch.tensor([15]), torch.tensor([[15.0]]), torch.tensor([0]))
    assert res.inserted.tolist() == [True]


def test_overflow_with_many_newcomers_keeps_best_scores():
    t = HashTable(1, init_capacity=4, max_capacity=4, bucket_capacity=4)
    keys = torch.arange(100, 110)
    res = t.insert_or_assign(keys, keys.float()[:, None], torch.arange(10) % 7)
    assert res.num_refused == 6 and t.size == 4
    kept = t.export()
    assert sorted(kept.scores.tolist()) == [3, 4, 5, 6]  # scores were 0..6, 0, 1, 2
    assert torch.equal(kept.values.squeeze(1), kept.keys.float())
    _check_invariants(t)


def test_table_ids_are_separate_key_spaces():
    t = HashTable(1, init_capacity=64, max_capacity=64, bucket_capacity=16)
    keys, tids = torch.tensor([7, 7, 8]), torch.tensor([0, 3, 3])
    t.insert_or_assign(keys, torch.tensor([[1.0], [2.0], [3.0]]), torch.zeros(3), table_ids=tids)
    assert t.values[_rows_of(t, keys, tids)].squeeze(1).tolist() == [1.0, 2.0, 3.0]
    _, found = t.find(torch.tensor([8]))  # table id 0 has no key 8
    assert found.tolist() == [False]
    assert t.export(3).keys.tolist() == [7, 8] and t.export(0).keys.tolist() == [7]
    assert t.table_sizes(4).tolist() == [1, 0, 0, 2]
    assert t.clear(3) == 2 and t.size == 1


def _unmix64(y: int) -> int:
    y ^= (y >> 31) ^ (y >> 62)
    y = (y * pow(0x94D049BB133111EB, -1, 1 << 64)) & MASK64
    y ^= (y >> 27) ^ (y >> 54)
    y = (y * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & MASK64
    y ^= (y >> 30) ^ (y >> 60)
    return y


def test_equal_fingerprints_are_told_apart():
    pairs = []
    for k1 in range(100):
        k2 = _unmix64(mix64_int(k1) ^ 1)  # same fingerprint: mixes differ in the lowest bit
        assert mix64_int(k2) == mix64_int(k1) ^ 1
        if k2 < 1 << 63:
            pairs += [k1, to_signed(k2)]
    keys = torch.tensor(pairs)
    t = HashTable(1, init_capacity=1024, max_capacity=1024, bucket_capacity=64)
    t.insert_or_assign(keys, keys.float()[:, None], torch.zeros_like(keys))
    assert torch.equal(t.values[_rows_of(t, keys)].squeeze(1), keys.float())
    t.erase(keys[0::2])
    _, found = t.find(keys)
    assert found.tolist() == [i % 2 == 1 for i in range(keys.numel())]


def test_reserved_keys_are_rejected():
    t = HashTable(1, init_capacity=8, max_capacity=8)
    with pytest.raises(ValueError, match=r"key -1 at position 1 is negative"):
        t.find(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="negative"):
        t.insert_or_assign(torch.tensor([-5]), torch.zeros(1, 1), torch.zeros(1))
    with pytest.raises(TypeError, match="integer"):
        t.find(torch.tensor([1.0]))


def test_from_keys_values_bulk_build():
    g = torch.Generator().manual_seed(1)
    keys = torch.randperm(20000, generator=g) * 13 + 5
    vals = torch.randn(20000, 8, generator=g)
    t = HashTable.from_keys_values(keys, vals, bucket_capacity=32)
    assert t.size == 20000 and t.load_factor <= 0.5 and t.generation == 0
    assert torch.equal(t.values[_rows_of(t, keys)], vals)
    _, found = t.find(keys + 1)
    assert not found.any()
    _check_invariants(t)
    with pytest.raises(ValueError, match="key 5 appears more than once"):
        HashTable.from_keys_values(torch.tensor([5, 6, 5]), torch.zeros(3, 2))


def test_find_without_validation_reports_negative_keys_missing():
    t = HashTable(1, init_capacity=16, max_capacity=16)
    t.insert_or_assign(torch.tensor([1]), torch.ones(1, 1), torch.zeros(1))
    rows, found = t.find(torch.tensor([1, -1, -7]), validate=False)
    assert found.tolist() == [True, False, False] and rows[1:].tolist() == [-1, -1]


def test_fused_key_spaces_with_shared_fingerprints():
    # table id t salts keys with mix64(t * GOLDEN); take one whose salt keeps keys non-negative
    tid = next(t for t in range(1, 20) if mix64_int(t * GOLDEN) < 1 << 63)
    salt = mix64_int(tid * GOLDEN)
    keys, tids = [], []
    for a in range(40):  # four (table id, key) pairs per fingerprint: runs of 4 slots
        partner = _unmix64(mix64_int(a) ^ 1)
        group = [(0, a), (tid, a ^ salt), (0, partner), (tid, partner ^ salt)]
        if all(k < 1 << 63 for _, k in group):
            tids += [t for t, _ in group]
            keys += [k for _, k in group]
    keys_t, tids_t = torch.tensor(keys), torch.tensor(tids)
    assert len(keys) >= 40
    fps = fingerprint(keys_t, tids_t).view(-1, 4)
    assert bool((fps == fps[:, :1]).all())
    t = HashTable(1, init_capacity=1024, max_capacity=1024, bucket_capacity=64)
    t.insert_or_assign(keys_t, torch.arange(len(keys)).float()[:, None], tids_t, table_ids=tids_t)
    rows = _rows_of(t, keys_t, tids_t)
    assert t.values[rows].squeeze(1).tolist() == list(range(len(keys)))
    t.erase(keys_t[1::4], tids_t[1::4])
    _, found = t.find(keys_t, tids_t)
    assert found.tolist() == [i % 4 != 1 for i in range(len(keys))]


def test_from_spec():
    t = HashTable.from_spec(dyn_table("a_emb", max_capacity=512, init_capacity=64))
    assert (t.dim, t.capacity, t.max_capacity, t.bucket_capacity) == (4, 64, 512, 16)
    assert t.accumulators is not None and t.score_strategy is ScoreStrategy.STEP
