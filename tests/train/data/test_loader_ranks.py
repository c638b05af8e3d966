"""Loader(rank, world_size): the ranks' batches of a step concatenate to one process's batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.batch import Batch
from shared.features import FeatureSet
from train.data.loader import Loader, part_range


def _rows(b: Batch) -> list[tuple[int, ...]]:
    users = b.user["user_id"].lengths().tolist()
    ads = b.item["adgroup_id"].values().tolist()
    labels = b.labels.tolist() if b.labels is not None else []
    seq = b.sequence["click_50_seq__adgroup_id"].lengths().tolist()
    return list(zip(users, ads, labels, seq, strict=True))


def test_part_range_splits_evenly() -> None:
    assert [part_range(10, r, 3) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [part_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]


@pytest.mark.parametrize(
    ("world", "shuffle", "workers"), [(2, True, 0), (3, True, 0), (3, False, 0), (2, False, 2)]
)
def test_rank_batches_concatenate_to_the_global_batch(
    tiny_samples: Path, seed_fs: FeatureSet, world: int, shuffle: bool, workers: int
) -> None:
    kw = dict(num_workers=workers, shuffle=shuffle, seed=5, shuffle_rows=1000, message_rows=400)
    one = Loader(tiny_samples / "train", seed_fs, batch_size=50 * world, **kw)  # type: ignore[arg-type]
    ranks = [
        Loader(tiny_samples / "train", seed_fs, batch_size=50, rank=r, world_size=world, **kw)  # type: ignore[arg-type]
        for r in range(world)
    ]
    assert all(r.batch_rows(0) == one.batch_rows(0) for r in ranks)
    assert sum(one.batch_rows(0)) == one.rows  # nothing dropped here (last batch >= world)
    skip = 3  # resume mid-epoch: the same parts
    per_rank = [list(r.epoch(0, skip_batches=skip)) for r in ranks]
    whole = list(one.epoch(0, skip_batches=skip))
    assert all(len(p) == len(whole) == ranks[0].num_batches(0) - skip for p in per_rank)
    for i, batch in enumerate(whole):
        parts = [p[i] for p in per_rank]
        assert [p.batch_size for p in parts] == [
            part_range(batch.batch_size, r, world)[1] for r in range(world)
        ]
        assert sum((_rows(p) for p in parts), []) == _rows(batch)
        assert torch.equal(torch.cat([p.labels for p in parts]), batch.labels)  # type: ignore[misc]


def test_short_global_batch_below_world_size_is_dropped(
    tiny_samples: Path, seed_fs: FeatureSet
) -> None:
    total = Loader(tiny_samples / "train", seed_fs, batch_size=1).rows
    world, per_rank = next(
        (w, b) for w in (3, 5, 7) for b in range(10, 1000) if 0 < total % (b * w) < w
    )
    ranks = [
        Loader(tiny_samples / "train", seed_fs, batch_size=per_rank, rank=r, world_size=world)
        for r in range(world)
    ]
    rows = ranks[0].batch_rows(0)
    assert sum(rows) == total - total % (per_rank * world) and min(rows) == per_rank * world
    assert [len(list(r.epoch(0))) for r in ranks] == [len(rows)] * world
