"""Integer hashing, bucket ranges and the deterministic unique/segment-sum helpers."""

from __future__ import annotations

import random

import torch

from shared.hashtable.hashing import (
    INT64_MIN,
    bucket_of,
    bucket_sentinels,
    fingerprint,
    mix64,
    mix64_int,
    segment_sum_sorted,
    to_signed,
    unique_pairs,
)


def test_mix64_matches_python_reference():
    rng = random.Random(0)
    xs = [0, 1, -1, INT64_MIN, (1 << 63) - 1] + [rng.getrandbits(64) for _ in range(200)]
    got = mix64(torch.tensor([to_signed(x) for x in xs])).tolist()
    assert got == [to_signed(mix64_int(x)) for x in xs]
    assert mix64_int(0) == 0


def test_fingerprints_are_even_and_separate_table_ids():
    keys = torch.arange(1000)
    fp0 = fingerprint(keys, None)
    assert bool((fp0 & 1 == 0).all())
    assert torch.equal(fp0, fingerprint(keys, torch.zeros_like(keys)))  # table id 0 = no salt
    assert not bool((fp0 == fingerprint(keys, torch.ones_like(keys))).any())


def _unsigned(fp: int) -> int:
    return (fp - INT64_MIN) & ((1 << 64) - 1)


def test_bucket_of_is_floor_u_times_nb_over_2_64():
    rng = random.Random(1)
    for nb in (1, 2, 3, 7, 1000, 2343, (1 << 31) - 1):
        fps = [to_signed(rng.getrandbits(64)) for _ in range(300)] + [INT64_MIN, (1 << 63) - 1]
        got = bucket_of(torch.tensor(fps), nb).tolist()
        assert got == [(_unsigned(f) * nb) >> 64 for f in fps], nb


def test_sentinels_bound_each_bucket():
    for nb in (1, 2, 3, 10, 977):
        sent = bucket_sentinels(nb, torch.device("cpu")).tolist()
        for b, s in enumerate(sent):
            last_u = -(-((b + 1) << 64) // nb) - 1  # ceil((b + 1) * 2**64 / nb) - 1
            assert s & 1 == 1
            assert _unsigned(s) in (last_u, last_u + 1)  # the bucket's last value, made odd
            assert (_unsigned(s) & ~1) <= last_u  # every even value of bucket b is below it
        assert sent == sorted(sent)


def test_unique_pairs_and_segment_sum():
    keys = torch.tensor([5, 3, 5, 9, 3, 5, 1])
    tids = torch.tensor([0, 0, 1, 0, 0, 0, 0])
    order, starts, counts, inverse, group = unique_pairs(keys, tids)
    pairs = list(zip(tids[order[starts]].tolist(), keys[order[starts]].tolist(), strict=True))
    assert pairs == [(0, 1), (0, 3), (0, 5), (0, 9), (1, 5)]
    assert counts.tolist() == [1, 2, 2, 1, 1]
    assert [pairs[i] for i in inverse.tolist()] == list(
        zip(tids.tolist(), keys.tolist(), strict=True)
    )
    assert order[starts + counts - 1].tolist() == [6, 4, 5, 3, 2]  # last occurrences
    x = torch.tensor([[1.0], [2.0], [4.0], [8.0], [16.0], [32.0], [64.0]])
    sums = segment_sum_sorted(x[order], starts, counts, group)
    assert sums.squeeze(1).tolist() == [64.0, 2.0 + 16.0, 1.0 + 32.0, 8.0, 4.0]


def test_segment_sum_long_runs_is_a_fixed_tree():
    g = torch.randn(1000, 3)
    group = torch.zeros(1000, dtype=torch.int64)
    out = segment_sum_sorted(g, torch.tensor([0]), torch.tensor([1000]), group)
    torch.testing.assert_close(out[0], g.sum(0), rtol=1e-5, atol=1e-5)
    again = segment_sum_sorted(g.clone(), torch.tensor([0]), torch.tensor([1000]), group)
    assert torch.equal(out, again)
