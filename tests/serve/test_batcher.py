from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from serve.batcher import (
    Batcher,
    BatcherConfig,
    BatchStats,
    DeadlineExpiredError,
    concat_batches,
    merge_batches,
)
from serve.host_batch import HostBatch
from serve.limits import Limits
from serve.model import synthetic_batch
from serve.offline import select_rows, tile_users
from serve.validation import request_inputs
from shared.batch import Batch
from shared.fg_request import request_columns_to_batch


def _request_batches(fs, requests) -> list[Batch]:
    return [request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))) for r in requests]


def test_concat_batches_stacks_users_and_offsets_user_index(fs, requests) -> None:
    parts = _request_batches(fs, requests[:4])
    cat = concat_batches(parts)
    assert cat.num_users == 4 and cat.batch_size == sum(p.batch_size for p in parts)
    want_index = torch.cat([torch.full((p.batch_size,), i) for i, p in enumerate(parts)])
    assert torch.equal(cat.user_index, want_index)
    for which in ("user", "item", "sequence"):
        got = getattr(cat, which).to_dict()
        for key, jt in got.items():
            parts_jt = [getattr(p, which)[key] for p in parts]
            assert torch.equal(jt.values(), torch.cat([j.values() for j in parts_jt]))
            assert torch.equal(jt.lengths(), torch.cat([j.lengths() for j in parts_jt]))


def test_tile_users_merges_identical_user_rows(fs) -> None:
    batch = synthetic_batch(fs, users=3, candidates=3, seq_lengths=(2, 2, 2))  # 3 equal users
    tiled = tile_users(batch)
    assert tiled.num_users == 1 and torch.equal(tiled.user_index, torch.zeros(3, dtype=torch.int64))
    picked = select_rows(batch.sequence, torch.tensor([2, 0]))
    assert picked.stride() == 2 and picked.lengths().tolist() == [2, 2] * len(picked.keys())


def _wait_until_taken(b: Batcher) -> None:
    deadline = time.monotonic() + 10
    while b.depth() and time.monotonic() < deadline:
        time.sleep(0.005)


class _Slow:
    """A predictor that blocks until released and records the batch sizes it saw."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[tuple[int, int]] = []

    def predict(self, batch: Batch) -> torch.Tensor:
        self.release.wait(10)
        self.seen.append((batch.num_users, batch.batch_size))
        return batch.user_index.to(torch.float32)  # each row's user: shows the split


def test_batcher_merges_splits_and_keeps_versions_apart(fs) -> None:
    stats: list[BatchStats] = []
    b = Batcher(BatcherConfig(max_batch_rows=10, max_wait_us=200_000), on_batch=stats.append)
    old, new = _Slow(), _Slow()
    try:
        blocker = b.submit(old, synthetic_batch(fs, 1, 10, (0,)))  # full: runs alone at once
        _wait_until_taken(b)
        futs = [b.submit(old, synthetic_batch(fs, 1, 4, (1,))) for _ in range(3)]  # 4+4 | 4
        futs.append(b.submit(new, synthetic_batch(fs, 1, 2, (1,))))  # other version: own batch
        old.release.set()
        new.release.set()
        results = [f.result(5) for f in [blocker, *futs]]
    finally:
        b.close()
    assert old.seen == [(1, 10), (2, 8), (1, 4)] and new.seen == [(1, 2)]
    np.testing.assert_array_equal(results[1], np.zeros(4))
    np.testing.assert_array_equal(results[2], np.ones(4))  # second user of its batch
    assert [s.rows for s in stats] == [10, 8, 4, 2]


def test_batcher_drops_expired_and_cancelled_requests(fs) -> None:
    b = Batcher(BatcherConfig(max_batch_rows=1, max_wait_us=0))
    slow = _Slow()
    try:
        first = b.submit(slow, synthetic_batch(fs, 1, 1, (0,)))
        _wait_until_taken(b)  # the worker holds `first`
        expired = b.submit(slow, synthetic_batch(fs, 1, 1, (0,)), deadline=time.monotonic() + 0.01)
        cancelled = b.submit(slow, synthetic_batch(fs, 1, 1, (0,)))
        assert cancelled.cancel()
        time.sleep(0.05)
        slow.release.set()
        assert first.result(5).shape == (1,)
        with pytest.raises(DeadlineExpiredError):
            expired.result(5)
    finally:
        b.close()
    assert len(slow.seen) == 1  # the expired and the cancelled request cost no compute


def test_worker_survives_a_failing_model(fs) -> None:
    class Boom:
        def predict(self, batch: Batch) -> torch.Tensor:
            raise RuntimeError("boom")

    b = Batcher(BatcherConfig(max_wait_us=0))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            b.submit(Boom(), synthetic_batch(fs, 1, 1, (0,))).result(5)
        slow = _Slow()
        slow.release.set()
        assert b.submit(slow, synthetic_batch(fs, 1, 2, (0,))).result(5).shape == (2,)
    finally:
        b.close()


def test_merge_batches_builds_kjts_only_for_predictors_that_need_them(fs, requests) -> None:
    from tests.serve.test_host_batch import assert_same_batch

    parts = _request_batches(fs, requests[:3])
    hosts = [HostBatch.of(p) for p in parts]
    merged = merge_batches(hosts, host=True)
    assert isinstance(merged, HostBatch)
    assert_same_batch(merged.to_batch(), concat_batches(parts))
    built = merge_batches(hosts, host=False)
    assert isinstance(built, Batch)
    assert_same_batch(built, concat_batches(parts))
    mixed = merge_batches([hosts[0], parts[1], hosts[2]], host=True)  # a KJT batch among them
    assert isinstance(mixed, Batch)
    assert_same_batch(mixed, concat_batches(parts))
