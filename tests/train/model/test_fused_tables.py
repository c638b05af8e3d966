"""Fused small tables (train.model.fused_tables) against the per-table layout they replace.

The reference is the layout of every earlier checkpoint: one ``nn.Embedding`` per table (dense
gradient when small, row-sparse when large) and one Adagrad over them. Fused tables must start
from the same values, train to the same values and losses, save and load that layout's state
dict and optimizer state (so old checkpoints resume), and refuse an id outside its table.
GPU (``pytest -m gpu``): the same comparisons on CUDA.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from shared.config import load_config
from shared.features import FeatureSet, TableSpec, build_feature_set
from tests.conftest import DEVICES, SEED_CONFIG
from train.data.loader import Loader
from train.model.fused_tables import DenseTables, Lookup, keep_per_table_state
from train.model.multi_tower_din import MultiTowerDIN, sparse_adagrad
from train.trainer import build_optimizers, train_step

# two dims, a table served by two features, and a large table with row-sparse gradients
SPECS = [
    TableSpec("a", 16, 3, None, "sum"),
    TableSpec("big", 8, 5000, None, "sum"),
    TableSpec("b", 16, 20, None, "sum"),
    TableSpec("c", 8, 7, None, "sum"),
    TableSpec("d", 16, 99, None, "sum"),
]
FEATURES = {"fa": "a", "fbig": "big", "fb": "b", "fb_seq": "b", "fc": "c", "fd": "d"}


class PerTable(nn.Module):
    """The layout before fusion: ``embeddings.<table>.weight``, one ``nn.Embedding`` each."""

    def __init__(
        self, specs: Sequence[TableSpec], *, sparse_grad: set[str], device: str | torch.device
    ) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict(
            {
                t.name: nn.Embedding(
                    int(t.num_rows or 0), t.dim, sparse=t.name in sparse_grad, device=device
                )
                for t in specs
            }
        )

    def forward(self, lookups: Sequence[Lookup]) -> list[torch.Tensor]:
        return [self.embeddings[table](ids) for _feature, table, ids in lookups]


def _lookups(gen: torch.Generator, device: str, n: int = 300) -> list[Lookup]:
    rows = {t.name: int(t.num_rows or 0) for t in SPECS}
    return [
        (f, t, torch.randint(0, rows[t], (n,), generator=gen).to(device))
        for f, t in FEATURES.items()
    ]


def _loss(found: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    terms = [
        (((r - t) ** 2).sum(1) * r.sum(1).sigmoid()).mean()
        for r, t in zip(found, targets, strict=True)
    ]
    return torch.stack(terms).sum()


def _saved(obj: object) -> dict:
    """``obj`` through ``torch.save`` and ``torch.load``, as a checkpoint holds it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _adagrad(params: object) -> torch.optim.Adagrad:
    return torch.optim.Adagrad(params, lr=0.3, eps=1e-8, initial_accumulator_value=0.1)  # type: ignore[arg-type]


def _fused(device: str) -> tuple[DenseTables, torch.optim.Adagrad]:
    tables = DenseTables(SPECS, sparse_grad={"big"}, device=device)
    opt = _adagrad(tables.parameters())
    keep_per_table_state(opt, tables)
    return tables, opt


def _step(
    tables: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, device: str
) -> float:
    lookups = _lookups(gen, device)
    targets = [
        torch.randn(ids.numel(), 8 if t in ("big", "c") else 16, generator=gen).to(device)
        for _f, t, ids in lookups
    ]
    opt.zero_grad(set_to_none=True)
    loss = _loss(tables(lookups), targets)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _assert_same_state(
    fused: DenseTables, ref: PerTable, opt_f: torch.optim.Optimizer, opt_r: torch.optim.Optimizer
) -> None:
    got, want = fused.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    so, sr = opt_f.state_dict(), opt_r.state_dict()
    assert so["param_groups"] == sr["param_groups"]
    assert so["state"].keys() == sr["state"].keys()
    for j, st in sr["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(so["state"][j][k], v, rtol=1e-5, atol=1e-6, msg=f"{j} {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_trains_like_per_table_and_resumes_from_its_state(device: str) -> None:
    """The reference trains 2 steps; its state (an old checkpoint) is loaded into fused tables;
    both train on, the fused ones through a save/load round trip; all stays equal."""
    torch.manual_seed(0)
    ref = PerTable(SPECS, sparse_grad={"big"}, device=device)
    opt_r = _adagrad(ref.parameters())
    gen_r = torch.Generator().manual_seed(1)
    for _ in range(2):
        _step(ref, opt_r, gen_r, device)
    fused, opt_f = _fused(device)
    fused.load_state_dict(_saved(ref.state_dict()))
    opt_f.load_state_dict(_saved(opt_r.state_dict()))
    _assert_same_state(fused, ref, opt_f, opt_r)
    gen_f = torch.Generator().manual_seed(0)
    gen_f.set_state(gen_r.get_state())
    for step in range(4):
        want, got = _step(ref, opt_r, gen_r, device), _step(fused, opt_f, gen_f, device)
        assert got == pytest.approx(want, rel=1e-5), step
        if step == 1:  # resume: a fresh fused module from the saved (per-table) state
            saved, saved_opt = _saved(fused.state_dict()), _saved(opt_f.state_dict())
            fused, opt_f = _fused(device)
            fused.load_state_dict(saved)
            opt_f.load_state_dict(saved_opt)
    _assert_same_state(fused, ref, opt_f, opt_r)
    assert len(list(fused.parameters())) == 3  # dim 16 fused, dim 8 fused, the large table


def test_weights_are_views_into_one_matrix_per_dim() -> None:
    fused, _ = _fused("cpu")
    weights = fused.weights()
    assert list(weights) == [t.name for t in SPECS]
    assert weights["b"].data_ptr() == weights["a"].data_ptr() + 3 * 16 * 4  # rows 3..23 of dim16
    assert weights["big"] is fused.embeddings["big"].weight
    with torch.no_grad():
        weights["d"][5] = 7.0
    assert torch.equal(fused.state_dict()["embeddings.d.weight"][5], torch.full((16,), 7.0))
    sd = fused.state_dict()
    assert sd["embeddings.d.weight"].untyped_storage().nbytes() == 99 * 16 * 4  # its own tensor


@pytest.mark.parametrize("table, bad", [("a", 3), ("d", -1), ("big", 5000)])
def test_out_of_range_id_names_the_feature(table: str, bad: int) -> None:
    fused, _ = _fused("cpu")
    feature = {v: k for k, v in FEATURES.items()}[table]
    with pytest.raises(IndexError, match=rf"feature {feature!r}: id {bad} is outside table"):
        fused([("fc", "c", torch.tensor([1])), (feature, table, torch.tensor([0, bad]))])


def test_load_reports_missing_and_mismatched_tables() -> None:
    ref = PerTable(SPECS, sparse_grad={"big"}, device="cpu")
    fused, opt = _fused("cpu")
    state = ref.state_dict()
    del state["embeddings.b.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\)[^\n]*\"embeddings.b.weight\""):
        fused.load_state_dict(state)
    before = fused.weights()["b"].detach().clone()
    result = fused.load_state_dict(state, strict=False)
    assert result.missing_keys == ["embeddings.b.weight"] and result.unexpected_keys == []
    assert torch.equal(fused.weights()["b"], before)  # kept
    assert torch.equal(fused.weights()["d"], ref.state_dict()["embeddings.d.weight"])  # loaded
    state["embeddings.b.weight"] = torch.zeros(21, 16)
    with pytest.raises(RuntimeError, match=r"size mismatch for embeddings.b.weight"):
        fused.load_state_dict(state)
    opt_state = _adagrad(ref.parameters()).state_dict()
    del opt_state["state"][2]
    opt_state["param_groups"][0]["params"].pop()
    with pytest.raises(ValueError, match="expected one group of 5"):
        opt.load_state_dict(opt_state)


def _specs_of(fs: FeatureSet) -> list[TableSpec]:
    return [t for t in fs.dense_tables if any(f.table == t.name for f in fs.features.values())]


@pytest.mark.parametrize("device", DEVICES)
def test_model_trains_like_per_table_reference(tiny_samples: Path, device: str) -> None:
    """MultiTowerDIN of the seed config: fused tables (as built) against the same model with a
    per-table reference in their place, loaded from its initial state; six train_steps."""
    config = load_config(SEED_CONFIG)
    fs = build_feature_set(config)
    loader = Loader(tiny_samples / "train", fs, batch_size=256, shuffle=False)
    batches = [b.to(device) for _, b in zip(range(3), loader.epoch(0), strict=False)]
    models, opts = [], []
    for fused in (True, False):
        model = MultiTowerDIN.from_config(config, fs, device=device, seed=0)
        opt = build_optimizers(model, config.train_config)
        if not fused:
            ref = PerTable(_specs_of(fs), sparse_grad=set(), device=device)
            ref.load_state_dict(model.sparse.dense.state_dict())
            model.sparse.dense = ref  # type: ignore[assignment]
            ada = sparse_adagrad(config.train_config)
            opt["sparse"] = torch.optim.Adagrad(
                ref.parameters(),
                lr=ada.lr,
                eps=ada.eps,
                initial_accumulator_value=ada.initial_accumulator_value,
            )
        models.append(model)
        opts.append(opt)
    # CPU: the same sums in the same order (index_add as embedding's backward); CUDA: atomics
    tol = {"rtol": 0.0, "atol": 0.0} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    for step in range(6):
        got, want = (
            float(train_step(m, o, batches[step % 3], step))
            for m, o in zip(models, opts, strict=True)
        )
        assert got == pytest.approx(want, rel=tol["rtol"], abs=tol["atol"]), step
    fused_model, ref_model = models
    assert list(fused_model.sparse.dense.state_dict()) == list(ref_model.sparse.dense.state_dict())
    for (name, a), b in zip(
        fused_model.sparse.dense.state_dict().items(),
        ref_model.sparse.dense.state_dict().values(),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **tol, msg=name)
    for (name, a), b in zip(
        fused_model.dense.state_dict().items(),
        ref_model.dense.state_dict().values(),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **tol, msg=name)
    assert len(list(fused_model.sparse.dense_parameters())) == 1  # ten tables, one dim
