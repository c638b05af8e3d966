from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from serve.batcher import (
    MAX_IN_FLIGHT,
    Batcher,
    BatcherClosedError,
    BatcherConfig,
    BatchStats,
    DeadlineExpiredError,
    PendingScores,
    concat_batches,
    merge_batches,
)
from serve.host_batch import HostBatch
from serve.limits import Limits
from serve.model import LoadedModel, synthetic_batch
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
    from tests.serve.test_host_batch import (
        assert_golden,
        assert_holds_parts,
        assert_same_batch,
        golden_parts,
    )

    for parts in (golden_parts(), _request_batches(fs, requests[:3])):
        hosts = [HostBatch.of(p) for p in parts]
        merged = merge_batches(hosts, host=True)
        assert isinstance(merged, HostBatch)
        built = merge_batches(hosts, host=False)
        assert isinstance(built, Batch)
        mixed = merge_batches([hosts[0], parts[1], hosts[2]], host=True)  # a KJT batch among them
        assert isinstance(mixed, Batch)
        assert_holds_parts(built, parts)
        for other in (merged.to_batch(), mixed):
            assert_same_batch(other, built)
    assert_golden(merge_batches([HostBatch.of(p) for p in golden_parts()], host=False))
    one = synthetic_batch(fs, 1, 2, (1,))
    assert merge_batches([one], host=False) is one  # a request alone: its batch as it is


# --------------------------------------------------------------------------- started batches


class _LaterScores(PendingScores):
    """Scores the test completes (``finish``), optionally with an error from ``result``."""

    def __init__(self, scores: torch.Tensor) -> None:
        super().__init__(scores)
        self.finished = threading.Event()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.finished.set()

    def result(self, timings: dict[str, float] | None = None) -> torch.Tensor:
        if not self.finished.wait(10):
            raise TimeoutError("the test never finished this batch")
        if self.error is not None:
            raise self.error
        return super().result(timings)


class _Starter:
    """A predictor with ``start``: batch k scores each row ``100 * k + its user``; each pending
    is completed by the test (``done=True``: returned done)."""

    reports_timings = True

    def __init__(self, *, done: bool = False) -> None:
        self.pendings: list[_LaterScores] = []
        self._done = done

    def start(self, batch: Batch, timings: dict[str, float] | None = None) -> PendingScores:
        pending = _LaterScores(batch.user_index.to(torch.float32) + 100 * len(self.pendings))
        if self._done:
            pending.finish()
        if timings is not None:
            timings.update(h2d=0.0, compute=0.0)
        self.pendings.append(pending)
        return pending

    def predict(self, batch: Batch) -> torch.Tensor:
        raise AssertionError("a predictor with start is started, not called")


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"not within 10 s: {what}"
        time.sleep(0.002)


def _submit(b: Batcher, model, fs, n: int) -> list:
    return [b.submit(model, synthetic_batch(fs, 1, 1, (0,))) for _ in range(n)]  # a batch each


def test_started_batches_complete_in_order_at_most_two_in_flight(fs) -> None:
    stats: list[BatchStats] = []
    b = Batcher(BatcherConfig(max_batch_rows=1, max_wait_us=0), on_batch=stats.append)
    model = _Starter()
    try:
        futs = _submit(b, model, fs, 4)
        _until(lambda: len(model.pendings) == MAX_IN_FLIGHT, "two batches started")
        time.sleep(0.05)
        assert len(model.pendings) == 2  # the third start waits for a slot
        model.pendings[1].finish()  # completed in start order: still waits for the first
        time.sleep(0.05)
        assert len(model.pendings) == 2 and not futs[1].done()
        model.pendings[0].finish()
        _until(lambda: len(model.pendings) == 4, "both slots free again")
        _until(lambda: futs[0].done() and futs[1].done(), "the first two answered")
        assert not futs[2].done()
        model.pendings[3].finish()
        model.pendings[2].finish()
        results = [f.result(5) for f in futs]
    finally:
        b.close()
    for k, got in enumerate(results):
        np.testing.assert_array_equal(got, [100.0 * k])
    assert [s.rows for s in stats] == [1, 1, 1, 1]
    assert all(set(s.stages) == {"h2d", "compute", "sync"} and s.run_s >= 0 for s in stats)


def test_close_drains_started_batches(fs) -> None:
    b = Batcher(BatcherConfig(max_batch_rows=1, max_wait_us=0))
    model = _Starter()
    futs = _submit(b, model, fs, 3)
    _until(lambda: len(model.pendings) == 2, "two batches started")
    closer = threading.Thread(target=b.close, args=(10,))
    closer.start()
    with pytest.raises(BatcherClosedError):
        b.submit(model, synthetic_batch(fs, 1, 1, (0,)))
    time.sleep(0.05)
    assert closer.is_alive() and not any(f.done() for f in futs)
    for k in range(3):
        _until(lambda k=k: len(model.pendings) > k, f"batch {k} started")
        model.pendings[k].finish()
    closer.join(10)
    assert not closer.is_alive()
    assert [float(f.result(0)[0]) for f in futs] == [0.0, 100.0, 200.0]
    assert not b._worker.is_alive() and not b._completer.is_alive()


def test_a_failing_result_fails_only_its_batch(fs) -> None:
    b = Batcher(BatcherConfig(max_batch_rows=1, max_wait_us=0))
    model = _Starter()
    try:
        futs = _submit(b, model, fs, 2)
        _until(lambda: len(model.pendings) == 2, "two batches started")
        model.pendings[0].finish(RuntimeError("device lost"))
        model.pendings[1].finish()
        with pytest.raises(RuntimeError, match="device lost"):
            futs[0].result(5)
        np.testing.assert_array_equal(futs[1].result(5), [100.0])
        later = _submit(b, model, fs, 1)[0]  # both threads still work, and both slots are free
        _until(lambda: len(model.pendings) == 3, "a later batch started")
        model.pendings[2].finish()
        np.testing.assert_array_equal(later.result(5), [200.0])
    finally:
        b.close()


def test_done_pendings_complete_on_the_worker(fs) -> None:
    threads: list[str] = []
    b = Batcher(
        BatcherConfig(max_batch_rows=1, max_wait_us=0),
        on_batch=lambda s: threads.append(threading.current_thread().name),
    )
    model = _Starter(done=True)
    try:
        results = [f.result(5) for f in _submit(b, model, fs, 3)]
    finally:
        b.close()
    assert [float(r[0]) for r in results] == [0.0, 100.0, 200.0]
    assert threads == ["batcher"] * 3  # inline, as without start


def test_cpu_model_starts_done_batches(bundle_v1, fs) -> None:
    model = LoadedModel.load(bundle_v1, device="cpu")
    batch = synthetic_batch(fs, 2, 6, (3, 0))
    timings: dict[str, float] = {}
    pending = model.start(batch, timings)
    assert pending.done and set(timings) == {"h2d", "compute", "sync"}
    got = pending.result(timings)
    assert torch.equal(got, model.predict(batch))
    b = Batcher(BatcherConfig(max_wait_us=0))
    try:
        np.testing.assert_array_equal(b.submit(model, batch).result(5), got.numpy())
    finally:
        b.close()


def test_a_batch_waits_only_while_an_outstanding_request_could_join(fs) -> None:
    """With ``outstanding`` (the server's admitted requests), a batch waits for company only
    while one of them is not yet in hand: a lone request starts at once (``max_wait_us`` is a
    minute here: a wait would outlast the results' timeouts)."""
    outstanding = [1]
    b = Batcher(BatcherConfig(max_wait_us=60_000_000), outstanding=lambda: outstanding[0])
    model = _Starter(done=True)
    try:
        np.testing.assert_array_equal(_submit(b, model, fs, 1)[0].result(5), [0.0])
        outstanding[0] = 3  # two more admitted (in validation, say): the batch waits for them
        futs = _submit(b, model, fs, 1)
        _wait_until_taken(b)
        time.sleep(0.05)
        assert len(model.pendings) == 1 and not futs[0].done()
        futs += _submit(b, model, fs, 2)  # all three in hand: it starts, as one batch
        results = [f.result(5) for f in futs]
    finally:
        b.close()
    assert [float(r[0]) for r in results] == [100.0, 101.0, 102.0]


def test_requests_in_flight_count_as_in_hand(fs) -> None:
    outstanding = [2]
    b = Batcher(BatcherConfig(max_wait_us=60_000_000), outstanding=lambda: outstanding[0])
    model = _Starter()
    try:
        first = _submit(b, model, fs, 1)[0]  # the other outstanding one is not here yet: waits
        _wait_until_taken(b)
        time.sleep(0.05)
        assert not model.pendings
        second = _submit(b, model, fs, 1)[0]
        _until(lambda: len(model.pendings) == 1, "both in hand: started")
        outstanding[0] = 3
        third = _submit(b, model, fs, 1)[0]  # two of the three in flight, this one in hand
        _until(lambda: len(model.pendings) == 2, "started without waiting")
        for p in model.pendings:
            p.finish()
        results = [f.result(5) for f in (first, second, third)]
    finally:
        b.close()
    assert [float(r[0]) for r in results] == [0.0, 1.0, 100.0]


def test_requests_arriving_while_the_slots_are_taken_join_the_next_batch(fs) -> None:
    b = Batcher(BatcherConfig(max_wait_us=0))
    model = _Starter()
    try:
        futs = _submit(b, model, fs, 1)
        _until(lambda: len(model.pendings) == 1, "the first batch started")
        futs += _submit(b, model, fs, 1)
        _until(lambda: len(model.pendings) == MAX_IN_FLIGHT, "both slots taken")
        futs += _submit(b, model, fs, 3)  # wait for a slot, collected into one batch
        _wait_until_taken(b)
        model.pendings[0].finish()
        _until(lambda: len(model.pendings) == 3, "a slot freed: the third batch started")
        for p in model.pendings[1:]:
            p.finish()
        results = [f.result(5) for f in futs]
    finally:
        b.close()
    assert [float(r[0]) for r in results] == [0.0, 100.0, 200.0, 201.0, 202.0]
