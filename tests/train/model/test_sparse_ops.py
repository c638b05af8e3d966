"""The number of torch ops (aten calls) of one training ``MultiTowerDIN.dense_inputs`` (issue #18).

On a GPU a training step is bound by per-op launch cost, so the count is a regression check on
the sparse forward outside the hash-table core (the ops inside ``DynamicEmbeddingCollection``'s
lookup are not counted; tests/shared/hashtable/test_storage_ops.py counts those). Op counts are
deterministic; the bound is what the code reaches now (raise it only for a reason). The fewer ops
must give the same bits: forward values, and after backward the gradients of every parameter and
every dynamic table, against a reference that looks up the way the code did before (``KJT.to_dict``
per feature, one offset add and one host check per fused-table lookup).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train.model.sparse_arch as sparse_arch
from shared.batch import Batch
from shared.config import load_config
from shared.dense_inputs import FeaturePart
from shared.features import FeatureSet
from shared.fg import table_to_batch
from tests.conftest import SEED_CONFIG
from train.model.fused_tables import FusedTables, Lookup, _check_ids
from train.model.multi_tower_din import MultiTowerDIN

# ops of one training dense_inputs of the seed config outside the hash-table core (was 92, then
# 39 until the lookup in pieces and the pooling's own bag index, issue #53)
MAX_OPS = 31
_SYNCS = ("aten._local_scalar_dense.default", "aten.item.default")


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _batch(tiny_samples: Path, fs: FeatureSet, rows: int = 1024) -> Batch:
    return table_to_batch(fs, ds.dataset(str(tiny_samples / "train"), format="parquet").head(rows))


def _model(fs: FeatureSet) -> MultiTowerDIN:
    return MultiTowerDIN.from_config(load_config(SEED_CONFIG), fs, seed=0).train()


def _count(model: MultiTowerDIN, batch: Batch) -> list[str]:
    """The aten ops of ``model.dense_inputs(batch)`` outside the dynamic tables' lookup."""
    counting = _Counting()
    lookup = model.sparse.dynamic.lookup_parts  # what the model calls (lookup calls it too)

    def paused_lookup(*args: Any, **kwargs: Any) -> Any:
        with counting.pause():
            return lookup(*args, **kwargs)

    model.sparse.dynamic.lookup_parts = paused_lookup  # type: ignore[method-assign]
    try:
        with counting:
            model.dense_inputs(batch)
    finally:
        del model.sparse.dynamic.lookup_parts
    return counting.ops


def test_dense_inputs_op_count(tiny_samples: Path, seed_fs: FeatureSet) -> None:
    model = _model(seed_fs)
    model.dense_inputs(_batch(tiny_samples, seed_fs))  # first call: cached index tensors
    ops = _count(model, _batch(tiny_samples, seed_fs))  # a fresh batch, as each step has
    assert len(ops) <= MAX_OPS, (len(ops), sorted(ops))
    # CPU only: the one host check of all fused-table ids (a device assert on a GPU)
    assert sum(op in _SYNCS for op in ops) <= 1, sorted(ops)


# ------------------------------------------------------------------ the reference: the old way


def _old_feature_parts(batch: Batch) -> list[FeaturePart]:
    kjts = (("user", batch.user), ("item", batch.item), ("sequence", batch.sequence))
    return [
        (which, name, jt.values(), jt.lengths())
        for which, kjt in kjts
        for name, jt in kjt.to_dict().items()
    ]


def _old_fused_forward(self: FusedTables, lookups: Sequence[Lookup]) -> list[torch.Tensor]:
    fused_ids = []
    for feature, table, ids in lookups:
        _check_ids(feature, table, ids, self.rows[table])
        offset = self.offsets[table]
        fused_ids.append(ids + offset if offset else ids)
    flat = torch.cat(fused_ids) if len(fused_ids) > 1 else fused_ids[0]
    rows = self.weight.index_select(0, flat)
    return list(torch.split(rows, [int(i.numel()) for i in fused_ids]))


def _step(model: MultiTowerDIN, batch: Batch) -> dict[str, torch.Tensor]:
    """dense_inputs, then a backward through every float input (which also updates the dynamic
    tables: their Adagrad runs in the backward)."""
    inputs = model.dense_inputs(batch)
    gen = torch.Generator().manual_seed(1)
    loss = sum(
        (v * torch.rand(v.shape, generator=gen)).sum()
        for v in inputs.values()
        if v.is_floating_point()
    )
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return {k: v.detach().clone() for k, v in inputs.items()}


def _state(model: MultiTowerDIN) -> dict[str, torch.Tensor]:
    out = {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for table in model.fs.dynamic_tables:
        keys, values = model.sparse.dynamic.export_table(table.name)
        out[f"dyn.{table.name}.keys"], out[f"dyn.{table.name}.values"] = (
            keys.clone(),
            values.clone(),
        )
    return out


def test_dense_inputs_bit_equal_to_the_old_way(
    tiny_samples: Path, seed_fs: FeatureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = _batch(tiny_samples, seed_fs)
    new = _model(seed_fs)
    got, got_state = _step(new, batch), _state(new)
    old = _model(seed_fs)
    monkeypatch.setattr(sparse_arch, "feature_parts", _old_feature_parts)
    monkeypatch.setattr(FusedTables, "forward", _old_fused_forward)
    want, want_state = _step(old, _batch(tiny_samples, seed_fs)), _state(old)
    assert got.keys() == want.keys() and got_state.keys() == want_state.keys()
    assert any(k.startswith("dyn.") for k in got_state) and any("grad." in k for k in got_state)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for k in want_state:
        assert torch.equal(got_state[k], want_state[k]), k


def test_fused_id_check_names_the_feature(seed_fs: FeatureSet) -> None:
    dim = seed_fs.dense_tables[0].dim
    tables = FusedTables([t for t in seed_fs.dense_tables if t.dim == dim][:2], device="cpu")
    names = list(tables.rows)
    assert len(names) == 2
    ok = torch.zeros(3, dtype=torch.int64)
    bad = torch.tensor([0, tables.rows[names[1]]])
    with pytest.raises(IndexError, match=f"feature 'b'.*{names[1]}"):
        tables([("a", names[0], ok), ("b", names[1], bad)])
    with pytest.raises(IndexError, match="feature 'a'"):
        tables([("a", names[0], torch.tensor([-1])), ("b", names[1], ok)])
    assert [r.shape[0] for r in tables([("a", names[0], ok), ("b", names[1], ok[:1])])] == [3, 1]
