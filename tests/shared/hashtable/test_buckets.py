"""Who stays in a full bucket: the ranking rules of shared.hashtable.buckets."""

from __future__ import annotations

import torch

from shared.hashtable.buckets import (
    group_runs,
    keep_best,
    merge_full_buckets,
    rank_buckets,
    rank_buckets_packed,
)


def test_group_runs():
    ids, counts, group, rank = group_runs(torch.tensor([2, 2, 5, 7, 7, 7]))
    assert ids.tolist() == [2, 5, 7] and counts.tolist() == [2, 1, 3]
    assert group.tolist() == [0, 0, 1, 2, 2, 2] and rank.tolist() == [0, 1, 0, 0, 1, 2]


def test_keep_best_prefers_pinned_then_score():
    order = torch.arange(5)  # entries already in fingerprint order
    bucket = torch.tensor([0, 0, 0, 1, 1])
    scores = torch.tensor([1, 9, 5, 3, 4])
    pinned = torch.tensor([True, False, False, False, False])
    keep = keep_best(order, bucket, scores, pinned, capacity=2)
    assert keep.tolist() == [True, True, False, True, True]


def test_merge_full_bucket_rules():
    # one bucket of 4 slots: three stored entries (rows 10, 11, 12; row 13 is free)
    e_fp = torch.tensor([[100, 200, 300, 999]])
    e_row = torch.tensor([[10, 11, 12, 13]])
    e_valid = torch.tensor([[True, True, True, False]])
    e_score = torch.tensor([[5, 1, 1, 0]])
    e_pin = torch.tensor([[False, False, True, False]])
    # three newcomers (positions 0..2) with scores 1, 7, 0
    n_ref = torch.tensor([[0, 1, 2]])
    n_fp, n_score = torch.tensor([150, 250, 350]), torch.tensor([1, 7, 0])
    m = merge_full_buckets(
        e_fp, e_row, e_valid, e_score, e_pin, n_ref, n_fp, n_score, torch.tensor([999])
    )
    # pinned 300 stays; then scores 7 (new), 5 (stored); a tie at 1: the newcomer (150) beats
    # the stored 200; newcomer 350 (score 0) is refused
    assert m.slot_fp.tolist() == [[100, 150, 250, 300]]
    assert m.evicted_rows.tolist() == [11] and m.refused == 1 and m.size.tolist() == [4]
    assert sorted(m.new_pos.tolist()) == [0, 1]
    assert sorted(m.new_rows.tolist()) == [11, 13]  # the free row and the evicted one
    assert sorted(m.slot_row[0].tolist()) == [10, 11, 12, 13]


def _random_buckets(gen: torch.Generator, n_o: int, b: int, m: int):
    """Buckets of ``b`` sorted slots (a random fill) and up to ``m`` newcomers each, the
    newcomer columns in fingerprint order, with many equal scores (ties)."""
    fill = torch.randint(0, b + 1, (n_o, 1), generator=gen)
    e_valid = torch.arange(b) < fill
    sentinel = torch.arange(1, n_o + 1) * 10_000 + 9999
    e_fp = torch.where(e_valid, torch.sort(torch.randint(0, 5000, (n_o, b), generator=gen) * 2
                                           + torch.arange(n_o)[:, None] * 10_000).values,
                       sentinel[:, None])  # fmt: skip
    e_row = torch.stack([torch.randperm(b, generator=gen) + i * b for i in range(n_o)])
    e_score = torch.randint(0, 4, (n_o, b), generator=gen)
    e_pin = torch.rand(n_o, b, generator=gen) < 0.2
    k = torch.randint(0, m + 1, (n_o,), generator=gen)
    n_fp = torch.sort(torch.randint(0, 5000, (n_o, m), generator=gen) * 2 + 1_000_000
                      + torch.arange(n_o)[:, None] * 10_000, dim=1).values  # fmt: skip
    n_ref = torch.where(torch.arange(m) < k[:, None], torch.arange(n_o * m).view(n_o, m), -1)
    n_score = torch.randint(0, 4, (n_o * m,), generator=gen)
    return e_fp, e_row, e_valid, e_score, e_pin, n_ref, n_fp.flatten(), n_score, sentinel


def test_rank_buckets_packed_equals_the_five_sort_ranking():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        args = _random_buckets(gen, n_o=7, b=8, m=8)
        want = rank_buckets(*args)
        got, bad = rank_buckets_packed(*args)
        assert not bool(bad)
        for name in ("slot_fp", "size", "kept_new", "evicted", "refused"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for which in (want.kept_new, want.evicted, want.refused):  # (empty candidates: any order)
            assert torch.equal(got.ref[which], want.ref[which])
        # rows: the same kept rows per bucket; newcomers take the same free rows
        assert torch.equal(got.assigned[got.kept_new], want.assigned[want.kept_new])
        assert torch.equal(torch.sort(got.slot_row, 1).values, torch.sort(want.slot_row, 1).values)


def test_rank_buckets_packed_flags_scores_out_of_range():
    gen = torch.Generator().manual_seed(1)
    e_fp, e_row, e_valid, e_score, e_pin, n_ref, n_fp, n_score, sentinel = _random_buckets(
        gen, n_o=2, b=4, m=4
    )
    e_valid[0, 0] = True
    e_score[0, 0] = -1
    _, bad = rank_buckets_packed(e_fp, e_row, e_valid, e_score, e_pin, n_ref, n_fp, n_score,
                                 sentinel)  # fmt: skip
    assert bool(bad)
