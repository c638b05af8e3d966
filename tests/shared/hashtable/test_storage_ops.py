"""The number of torch ops (aten calls) and host syncs of one FusedStorage lookup (issue #18).

On a GPU a training step is bound by per-op launch cost, so these counts are a regression check
on the sparse forward: op counts are deterministic (no timing), and the bounds are what the code
reaches now (raise one only for a reason). ``outer`` counts the ops outside the backend's find,
insert, erase and new rows: the ops that also run around the CUDA backend's kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shared.features import ScoreStrategy
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.backend import TorchBackend
from shared.hashtable.initializers import NewRows
from shared.hashtable.storage import FusedStorage

from .conftest import dyn_table

_SYNCS = ("aten._local_scalar_dense.default", "aten.item.default")


@dataclass
class OpCount:
    total: int = 0  # every aten call
    outer: int = 0  # those outside the backend's operations
    outer_syncs: int = 0  # host reads outside them (scalar reads and tolist)
    paused: int = 0  # > 0 inside a backend operation


class _Counting(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        c = self.count
        c.total += 1
        if not c.paused:
            c.outer += 1
            c.outer_syncs += str(func) in _SYNCS
        return func(*args, **(kwargs or {}))


class _CountingBackend(TorchBackend):
    """The torch backend, telling the count which ops are its own."""

    def __init__(self) -> None:
        self.count = OpCount()

    @contextmanager
    def _inside(self) -> Iterator[None]:
        self.count.paused += 1
        try:
            yield
        finally:
            self.count.paused -= 1

    def _paused(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._inside():
                return fn(*args, **kwargs)

        return run

    def find(self, *args: Any, **kwargs: Any) -> Any:
        return self._paused(super().find)(*args, **kwargs)

    def insert_or_assign(self, *args: Any, **kwargs: Any) -> Any:
        return self._paused(super().insert_or_assign)(*args, **kwargs)

    def erase(self, *args: Any, **kwargs: Any) -> Any:
        return self._paused(super().erase)(*args, **kwargs)

    def keyed_rows(self, *args: Any, **kwargs: Any) -> NewRows:
        rows = super().keyed_rows(*args, **kwargs)
        return self._paused(rows)


def _storage(max_capacity: int) -> tuple[FusedStorage, _CountingBackend]:
    """3 fused tables with admission (threshold 3, LFU), as the seed config's groups."""
    specs = [
        dyn_table(f"t{i}", dim=8, max_capacity=max_capacity,
                  init_capacity=min(max_capacity, 4096), bucket_capacity=128,
                  strategy=ScoreStrategy.LFU, threshold=3, counter_capacity=8192)
        for i in range(3)
    ]  # fmt: skip
    backend = _CountingBackend()
    storage = FusedStorage(
        "g", specs, adagrad=AdagradConfig(0.1), seed=0, device=torch.device("cpu"), backend=backend
    )
    return storage, backend


def _parts(step: int, n: int = 8192, space: int = 6000) -> list[tuple[int, torch.Tensor]]:
    """n skewed keys with duplicates, split 1/2, 1/4, 1/4 over the 3 tables."""
    g = torch.Generator().manual_seed(step)
    keys = torch.randint(0, space, (n,), generator=g) ** 2 // space + step * 37
    sizes = [n // 2, n // 4, n - n // 2 - n // 4]
    return list(enumerate(torch.split(keys, sizes)))


def count_lookup(
    storage: FusedStorage, backend: _CountingBackend, step: int, *, train: bool
) -> OpCount:
    """The ops and host syncs of one lookup (``tolist`` reads dispatch no aten op: counted)."""
    count = backend.count = OpCount()
    real_tolist = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        count.outer_syncs += not count.paused
        return real_tolist(self)

    parts = _parts(step)
    with pytest.MonkeyPatch.context() as mp, _Counting(count):
        mp.setattr(torch.Tensor, "tolist", tolist)
        storage.lookup(parts, train=train, score_now=step)
    return count


@pytest.mark.parametrize(
    ("max_capacity", "total", "outer"),
    # the table not full; full (evicting: the bucket merge frees rows by a cumsum, 5 ops more
    # than a sort, shared with the static step: buckets._merged)
    [(1 << 17, 1290, 99), (1024, 1977, 104)],
    ids=["not_full", "full"],
)
def test_op_count_of_a_training_and_an_eval_lookup(max_capacity: int, total: int, outer: int):
    storage, backend = _storage(max_capacity)
    for step in range(4):  # counter hits, table hits and admissions in the measured step
        storage.lookup(_parts(step), train=True, score_now=step)
    evictions = storage.table.evictions
    count = count_lookup(storage, backend, 4, train=True)
    assert (storage.table.evictions > evictions) == (max_capacity == 1024)
    # distinct keys, hits, counter hits with admitted keys, the read after the insert
    assert count.outer_syncs == 4
    assert count.total <= total and count.outer <= outer, count
    count = count_lookup(storage, backend, 5, train=False)
    assert count.outer_syncs == 2  # distinct keys, the read of misses and longest run
    assert count.total <= 102 and count.outer <= 42, count


def test_part_ids_of_a_new_layout_are_one_cat_and_of_one_part_no_op():
    storage, backend = _storage(1 << 17)
    storage._part_ids([(t, torch.zeros(n, dtype=torch.int64)) for t, n in enumerate([9000, 3, 7])])
    for sizes in ([5, 0, 7], [9000, 3, 1], [2, 2, 2], [4]):  # within the buffers filled above
        parts = [(t, torch.zeros(n, dtype=torch.int64)) for t, n in enumerate(sizes)]
        count = backend.count = OpCount()
        with _Counting(count):
            ids = storage._part_ids(parts)
        want = torch.cat([torch.full_like(k, t) for t, k in parts])
        assert torch.equal(ids, want) and ids.dtype == torch.int64
        assert count.total == len(sizes) + (len(sizes) > 1)  # a slice per part, one cat
        count = backend.count = OpCount()
        with _Counting(count):
            assert storage._part_ids(parts) is ids  # the same layout again: kept
        assert count.total == 0


def test_counters_of_training_and_eval_lookups():
    """lookups (counted on the host), misses and admission rejections (one index_add_) against
    the plans: misses are the occurrences of distinct keys without a row."""
    storage, _ = _storage(1024)
    want = {"lookups": [0] * 3, "misses": [0] * 3, "eval_lookups": [0] * 3, "eval_misses": [0] * 3}
    for step in range(6):
        train = step != 4
        parts = _parts(step, n=3000)
        plan = storage.lookup(parts, train=train, score_now=step)
        prefix = "" if train else "eval_"
        for t, k in parts:
            want[f"{prefix}lookups"][t] += k.numel()
        missed = plan.counts * (plan.rows < 0)
        for t in range(3):
            want[f"{prefix}misses"][t] += int(missed[plan.table_ids == t].sum())
    for t in range(3):
        stats = storage.stats()[t]
        assert {k: stats[k] for k in want} == {k: float(v[t]) for k, v in want.items()}
        assert 0 < stats["admission_rejections"] <= stats["misses"]
