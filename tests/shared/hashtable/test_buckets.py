"""Who stays in a full bucket: the ranking rules of shared.hashtable.buckets."""

from __future__ import annotations

import torch

from shared.hashtable.buckets import group_runs, keep_best, merge_full_buckets


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
