"""The epoch plan (train/data/plan.py): unshuffled slices, resume points, the interleave."""

from __future__ import annotations

import random
from typing import Any

import pytest

from train.data.plan import RowGroup, in_order_slices, interleave, resume_point


def test_in_order_slices_end_at_row_groups_rounded_up_to_a_batch() -> None:
    """Each slice starts a batch (a multiple of 100) and ends once it has 250 rows, at the end
    of a row group rounded up to the next batch, or at the epoch's end."""
    groups = [RowGroup("a", i, n) for i, n in enumerate([120, 200, 90, 400, 30])]  # ends:
    # 120, 320, 410, 810, 840
    assert in_order_slices(groups, 840, 100, 250) == [(0, 400), (400, 840)]
    assert in_order_slices(groups, 800, 100, 250) == [(0, 400), (400, 800)]  # drop_last
    assert in_order_slices(groups, 840, 100, 1) == [(0, 200), (200, 400), (400, 500),
                                                    (500, 840)]  # fmt: skip
    assert in_order_slices(groups, 0, 100, 250) == []


def test_resume_point_continues_any_round_robin() -> None:
    def round_robin(counts: list[int]) -> list[tuple[int, int]]:
        return [
            (s, r) for r in range(max(counts, default=0)) for s, c in enumerate(counts) if c > r
        ]

    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.randint(0, 6) for _ in range(rng.randint(1, 4))]
        full = round_robin(counts)
        for k in range(len(full) + 1):
            taken, order = resume_point(counts, k)
            left = [counts[s] - taken[s] for s in order]
            resumed = [
                (order[i], taken[order[i]] + r)
                for r in range(max(left, default=0))
                for i in range(len(order))
                if left[i] > r
            ]
            assert resumed == full[k:]


def test_interleave_gives_the_round_robin_over_batches_for_any_message_size() -> None:
    rng = random.Random(1)
    for _ in range(300):
        counts = [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]  # batches per slot
        k = rng.randint(1, 4)
        batches = [[(s, r) for r in range(c)] for s, c in enumerate(counts)]
        chunks = [[b[i : i + k] for i in range(0, len(b), k)] for b in batches]
        sent = [  # the DataLoader's round-robin over messages
            chunks[s][j] for j in range(max(map(len, chunks))) for s in range(len(counts))
            if j < len(chunks[s])
        ]  # fmt: skip
        want = [(s, r) for r in range(max(counts)) for s, c in enumerate(counts) if c > r]
        got: list[Any] = list(interleave(iter(sent), [len(c) for c in chunks]))  # type: ignore[arg-type]
        assert got == want, (counts, k)
    with pytest.raises(RuntimeError, match="fewer messages"):
        list(interleave(iter([[1]]), [2]))  # type: ignore[list-item]
