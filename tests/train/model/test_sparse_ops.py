"""The number of torch ops (aten calls) of one training ``MultiTowerDIN.dense_inputs`` (issue #18),
and of the cold-ids config's sparse forward and backward around the static step (issue #53).

On a GPU a training step is bound by per-op launch cost, so the count is a regression check on
the sparse forward outside the hash-table core (the ops inside ``DynamicEmbeddingCollection``'s
lookup are not counted; tests/shared/hashtable/test_storage_ops.py counts those). Op counts are
deterministic; the bound is what the code reaches now (raise it only for a reason). The fewer ops
must give the same bits: forward values, and after backward the gradients of every parameter and
every dynamic table, against a reference that looks up the way the code did before (``KJT.to_dict``
per feature, one offset add and one host check per fused-table lookup; for the cold-ids config,
each dynamic table's pieces concatenated by the caller, its rows split after the autograd node).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shared.hashtable.embedding as embedding
import shared.hashtable.static_step as static_step
import train.model.sparse_arch as sparse_arch
from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import load_config, parse_config
from shared.dense_inputs import FeaturePart
from shared.features import FeatureSet, build_feature_set
from shared.fg import table_to_batch
from shared.hashtable.embedding import DynamicEmbeddingCollection, lookup_by_table
from shared.hashtable.storage import FusedStorage, Plan
from tests.conftest import ROOT, SEED_CONFIG
from train.model.fused_tables import FusedTables, Lookup, _check_ids
from train.model.multi_tower_din import MultiTowerDIN

# ops of one training dense_inputs of the seed config outside the hash-table core (was 92, then
# 39 until the lookup in pieces and the pooling's own bag index, issue #53)
MAX_OPS = 31
_SYNCS = ("aten._local_scalar_dense.default", "aten.item.default")
COLD_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb_cold_ids.config"
# ops of the cold-ids config's training sparse forward (``SparseArch.forward`` with cold flags)
# and of its backward, outside the static step's captured bodies (train_lookup and
# apply_gradients: CUDA graph replays on a GPU), a batch of a new layout (issue #53): 58 and 28
# before the storage took its pieces in the caller's order and split its rows in its own
# autograd node
COLD_MAX_FORWARD_OPS = 56
COLD_MAX_BACKWARD_OPS = 27


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


# ------------------------------------------------------------------ the cold-ids config


# a tenth of the cold-ids config's max capacities of its big tables (the cate table's 5000
# stays: below init_capacity_per_rank's 1024 is refused). The static step ranks every bucket of
# a table reserved at its max, so a CPU step's time follows the capacity; three batches of 1024
# rows stay far below it, and the op counts and bits do not depend on it.
TENTH_CAPACITIES = {
    f"max_capacity: {n}\n": f"max_capacity: {n // 10}\n" for n in (300000, 250000, 150000, 100000)
}


def _cold_config() -> pipeline_pb2.EasyRecConfig:
    """The cold-ids config with :data:`TENTH_CAPACITIES`."""
    text = COLD_CONFIG.read_text()
    for old, new in TENTH_CAPACITIES.items():
        assert old in text, old
        text = text.replace(old, new)
    return parse_config(text, str(COLD_CONFIG))


@pytest.fixture(scope="module")
def cold_fs() -> FeatureSet:
    return build_feature_set(_cold_config())


def _cold_model(fs: FeatureSet, *, static: bool = True) -> MultiTowerDIN:
    """The cold-ids config's model (:func:`_cold_config`) in training, its dynamic tables at max
    capacity and (with ``static``) taking the static step, run eagerly on the CPU: the GPU's
    code path."""
    model = MultiTowerDIN.from_config(_cold_config(), fs, seed=0).train()
    if static:
        model.sparse.dynamic.reserve_max_capacity()
        model.sparse.dynamic.use_static_step(capture=False)
    return model


def _cold_batch(tiny_samples: Path, fs: FeatureSet, start: int, rows: int = 1024) -> Batch:
    data = ds.dataset(str(tiny_samples / "train"), format="parquet")
    return table_to_batch(fs, data.head(start + rows).slice(start))


def _outputs(model: MultiTowerDIN, batch: Batch) -> tuple[list[str], list[torch.Tensor]]:
    """The sparse forward's named outputs: pooled and sequence embeddings, then cold flags."""
    emb = model.sparse(batch, cold=model.dense.takes_cold)
    named = [*emb.pooled.items(), *emb.sequences.items()]
    named += [(f"cold.{k}", v) for k, v in emb.cold.items()]
    return [n for n, _ in named], [v for _, v in named]


def _grads_of(outputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    floats = [v for v in outputs if v.is_floating_point()]
    return floats, [torch.rand(v.shape, generator=gen) for v in floats]


def _cold_step_ops(
    tiny_samples: Path, fs: FeatureSet, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], list[str]]:
    """(forward, backward): the ops of the cold-ids config's third training step of the
    sparse part outside the static step's captured bodies (train_lookup and apply_gradients:
    CUDA graph replays on a GPU), on a batch of a layout not seen before."""
    model = _cold_model(fs)
    for start in (0, 1024):  # warm: the static entry of the size, the cached index tensors
        torch.autograd.backward(
            *_grads_of(_outputs(model, _cold_batch(tiny_samples, fs, start))[1])
        )
    model.zero_grad(set_to_none=True)  # as the trainer's step begins
    counting = _Counting()
    for name in ("train_lookup", "apply_gradients"):
        body = getattr(static_step, name)

        def paused(*args: Any, _body: Any = body, **kwargs: Any) -> Any:
            with counting.pause():
                return _body(*args, **kwargs)

        monkeypatch.setattr(static_step, name, paused)
    batch = _cold_batch(tiny_samples, fs, 2048)
    with counting:
        outputs = _outputs(model, batch)[1]
    forward, counting.ops = counting.ops, []
    outs, grads = _grads_of(outputs)
    with counting:
        torch.autograd.backward(outs, grads)
    assert model.sparse.dynamic.static_stats()["deep"]["eager"] == 3  # the static step ran
    return forward, counting.ops


def test_cold_ids_sparse_step_op_count(
    tiny_samples: Path, cold_fs: FeatureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    forward, backward = _cold_step_ops(tiny_samples, cold_fs, monkeypatch)
    assert len(forward) <= COLD_MAX_FORWARD_OPS, (len(forward), Counter(forward).most_common())
    assert len(backward) <= COLD_MAX_BACKWARD_OPS, (len(backward), Counter(backward).most_common())
    # CPU only: the one host check of the fused-table ids (a device assert on a GPU)
    assert sum(op in _SYNCS for op in forward + backward) <= 1, sorted(forward + backward)


class _OldDynamicLookup(torch.autograd.Function):
    """The autograd node before issue #53's change: all of a storage's rows, split after it."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, storage: FusedStorage, plan: Plan) -> torch.Tensor:
        ctx.storage, ctx.plan = storage, plan
        return plan.expanded()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.storage.apply_gradients(ctx.plan, grad)
        return None, None, None


class _SplitAfter:
    @staticmethod
    def apply(dummy: torch.Tensor, storage: FusedStorage, plan: Plan, sizes: list[int]) -> Any:
        return torch.split(_OldDynamicLookup.apply(dummy, storage, plan), sizes)


def _by_table(dyn: DynamicEmbeddingCollection) -> Any:
    """lookup_parts the old way: each table's pieces concatenated by the caller (a storage's
    keys grouped by table), its rows and hits split back."""

    def lookup(keys: dict[str, torch.Tensor], *, hits: bool) -> Any:
        rows, found = DynamicEmbeddingCollection.lookup_parts(dyn, list(keys.items()), hits=hits)
        return dict(zip(keys, rows, strict=True)), dict(zip(keys, found, strict=False))

    def lookup_parts(pieces: Sequence[tuple[str, torch.Tensor]], *, hits: bool) -> Any:
        return lookup_by_table(lookup, pieces, hits=hits)

    return lookup_parts


@pytest.mark.parametrize("static", [True, False], ids=["static", "eager"])
def test_cold_ids_sparse_steps_bit_equal_to_the_old_way(
    tiny_samples: Path, cold_fs: FeatureSet, monkeypatch: pytest.MonkeyPatch, static: bool
) -> None:
    """Three training steps of the cold-ids config's sparse part: the same outputs, cold flags,
    fused-table gradients and dynamic tables (keys, values) as the old way, bit for bit."""
    new, old = _cold_model(cold_fs, static=static), _cold_model(cold_fs, static=static)
    old.sparse.dynamic.lookup_parts = _by_table(old.sparse.dynamic)  # type: ignore[method-assign]
    for start in (0, 1024, 2048):
        batch = _cold_batch(tiny_samples, cold_fs, start)
        names, got = _outputs(new, batch)
        torch.autograd.backward(*_grads_of(got))
        with monkeypatch.context() as m:
            m.setattr(embedding, "_DynamicLookup", _SplitAfter)
            want_names, want = _outputs(old, batch)
            torch.autograd.backward(*_grads_of(want))
        assert names == want_names and any(n.startswith("cold.") for n in names)
        for n, g, w in zip(names, got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (start, n)
        got_state, want_state = _state(new), _state(old)
        assert got_state.keys() == want_state.keys()
        for k in want_state:
            assert torch.equal(got_state[k], want_state[k]), (start, k)
    if static:
        assert new.sparse.dynamic.static_stats()["deep"]["eager"] == 3
