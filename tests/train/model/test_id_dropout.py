"""Id dropout (train.model.id_dropout): off is bit-identical, the drops are a hash of (seed, step,
table, key) with the configured rate, training mode only, and a dropped key looks cold."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import torch

from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import ConfigError, load_config
from shared.features import FeatureSet, build_feature_set
from shared.fg import table_to_batch
from tests.conftest import SEED_CONFIG
from train.model.id_dropout import FIELD, IdDropout
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import build_optimizers, train_step


def _config(id_dropout: float | None) -> pipeline_pb2.EasyRecConfig:
    """The seed config with ``cold_backoff {}``, and ``id_dropout`` when not None."""
    config = load_config(SEED_CONFIG)
    backoff = config.model_config.multi_tower_din.cold_backoff
    backoff.SetInParent()
    if id_dropout is not None:
        backoff.id_dropout = id_dropout
    return config


def _model(id_dropout: float | None, seed: int = 0) -> MultiTowerDIN:
    config = _config(id_dropout)
    return MultiTowerDIN.from_config(config, build_feature_set(config), seed=seed)


def _dropout(seed_fs: FeatureSet, p: float, seed: int = 0) -> IdDropout:
    dropout = IdDropout.from_config(seed_fs, _config(p).model_config.multi_tower_din.cold_backoff,
                                    seed=seed)  # fmt: skip
    assert dropout is not None
    return dropout


@pytest.fixture(scope="module")
def train_batch(tiny_samples: Path, seed_fs: FeatureSet) -> Batch:
    rows = ds.dataset(str(tiny_samples / "train"), format="parquet").head(256)
    return table_to_batch(seed_fs, rows)


def test_the_config_is_checked_and_names_the_field(seed_fs: FeatureSet) -> None:
    assert FIELD == "model_config.multi_tower_din.cold_backoff.id_dropout"
    for bad in (1.0, 1.5, -0.1, math.nan):
        with pytest.raises(ConfigError, match=rf"{FIELD}: .* not a probability in \[0, 1\)"):
            _model(bad)
    assert IdDropout.from_config(seed_fs, _config(0.0).model_config.multi_tower_din.cold_backoff,
                                 seed=0) is None  # fmt: skip
    dropout = _dropout(seed_fs, 0.25, seed=3)
    assert (dropout.features, dropout.seed) == (frozenset({"user_id"}), 3)  # what backs off
    assert _model(None).sparse.id_dropout is None
    assert _model(0.25).sparse.id_dropout == _dropout(seed_fs, 0.25)


def test_zero_trains_bit_equal_to_no_field(train_batch: Batch) -> None:
    runs = []
    for p in (None, 0.0, 0.4):
        config = _config(p)
        model = MultiTowerDIN.from_config(config, build_feature_set(config), seed=1)
        opts = build_optimizers(model, config.train_config)
        losses = [float(train_step(model, opts, train_batch, step)) for step in range(6)]
        runs.append((losses, model.state_dict(), model.sparse.dynamic.export_table("user_id_emb")))
    (a, sa, ta), (b, sb, tb), (c, _sc, _tc) = runs
    assert a == b and a != c  # 0: as without the field; 0.4 trains otherwise
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(ta[0], tb[0]) and torch.equal(ta[1], tb[1])


def test_a_share_p_of_keys_is_dropped_deterministically(seed_fs: FeatureSet) -> None:
    """A hash of (seed, step, table, key): reproducible, per step and seed, at the rate p."""
    p, n = 0.3, 20_000
    dropout = _dropout(seed_fs, p)
    keys = torch.arange(n, dtype=torch.int64) * 7919 - 10**6  # distinct keys, negative ones too
    drop = dropout.dropped("user_id_emb", keys, step=5)
    count = int(drop.sum())
    assert abs(count - p * n) < 4 * math.sqrt(n * p * (1 - p))  # binomial: 4 sigma (~260)
    assert count == 6117  # the same on every machine (int64 hashing; CUDA too)
    assert torch.equal(drop, dropout.dropped("user_id_emb", keys, step=5))  # same step: same
    assert torch.equal(drop.flip(0), dropout.dropped("user_id_emb", keys.flip(0), step=5))
    for other in (
        dropout.dropped("user_id_emb", keys, step=6),  # another step
        dropout.dropped("adgroup_id_emb", keys, step=5),  # another table
        _dropout(seed_fs, p, seed=1).dropped("user_id_emb", keys, step=5),  # another seed
    ):
        both = int((drop & other).sum())
        assert abs(both - p * p * n) < 4 * math.sqrt(n * p * p * (1 - p * p))  # independent
    dup = torch.tensor([11, 12, 11, 11, 12])
    d = dropout.dropped("user_id_emb", dup.repeat(200), step=5).view(200, 5)
    assert (d[:, 0] == d[:, 2]).all() and (d[:, 1] == d[:, 4]).all()  # per key, not occurrence


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_drops_the_same_keys_as_cpu(seed_fs: FeatureSet) -> None:
    dropout = _dropout(seed_fs, 0.3)
    keys = torch.randint(-(2**62), 2**62, (10_000,), generator=torch.Generator().manual_seed(0))
    cpu = dropout.dropped("user_id_emb", keys, step=9)
    assert torch.equal(cpu, dropout.dropped("user_id_emb", keys.cuda(), step=9).cpu())


def _warm_pair(train_batch: Batch, p: float) -> tuple[MultiTowerDIN, MultiTowerDIN]:
    """Two models of one seed, without and with id dropout, trained alike (the dropout held
    back) 4 steps on the batch, so its keys are admitted (admission threshold 3) and the two
    have equal weights and tables."""
    models = []
    for q in (None, p):
        config = _config(q)
        model = MultiTowerDIN.from_config(config, build_feature_set(config), seed=2)
        opts = build_optimizers(model, config.train_config)
        dropout, model.sparse.id_dropout = model.sparse.id_dropout, None
        for step in range(4):
            train_step(model, opts, train_batch, step)
        model.sparse.id_dropout = dropout
        models.append(model)
    return models[0], models[1]


def test_training_drops_warm_occurrences_and_eval_drops_none(train_batch: Batch) -> None:
    p = 0.4
    off, on = _warm_pair(train_batch, p)
    assert on.sparse.id_dropout is not None
    keys = train_batch.user["user_id"].values()
    for model in (off, on):
        model.sparse.dynamic.set_step(4)
    a, b = off.sparse(train_batch, cold=True), on.sparse(train_batch, cold=True)
    warm = ~a.cold["user_id"]
    dropped = on.sparse.id_dropout.dropped("user_id_emb", keys, step=4)
    assert warm.sum() > 100  # enough warm users for the rate below
    assert torch.equal(b.cold["user_id"], a.cold["user_id"] | (warm & dropped))
    share = float((warm & dropped).sum() / warm.sum())
    n = int(warm.sum())
    assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n)  # binomial, 4 sigma
    assert not b.pooled["user_id"][warm & dropped].any()  # the dropped rows: zeros
    assert torch.equal(b.pooled["user_id"][~dropped], a.pooled["user_id"][~dropped])
    for name in a.cold:  # the features that do not back off are as without dropout
        if name != "user_id":
            assert torch.equal(a.cold[name], b.cold[name]), name
    for model in (off, on):
        model.eval()
    with torch.no_grad():
        a, b = off.sparse(train_batch, cold=True), on.sparse(train_batch, cold=True)
        assert all(torch.equal(a.cold[k], b.cold[k]) for k in a.cold)  # eval: nothing dropped
        assert torch.equal(off(train_batch), on(train_batch))  # same weights, same scores


def test_a_dropped_key_gets_no_gradient(train_batch: Batch) -> None:
    """At step 4, the users dropped keep their rows; the other warm ones are updated."""
    _off, on = _warm_pair(train_batch, 0.4)
    assert on.sparse.id_dropout is not None
    keys_before, values_before = on.sparse.dynamic.export_table("user_id_emb")
    users = train_batch.user["user_id"].values().unique()
    dropped = users[on.sparse.id_dropout.dropped("user_id_emb", users, step=4)]
    kept = users[~torch.isin(users, dropped)]
    opts = build_optimizers(on, _config(0.4).train_config)
    train_step(on, opts, train_batch, 4)
    keys_after, values_after = on.sparse.dynamic.export_table("user_id_emb")
    assert torch.equal(keys_before, keys_after)
    moved = (values_before != values_after).any(dim=1)  # [rows] the keys' rows updated
    stored_dropped = torch.isin(keys_after, dropped)
    assert stored_dropped.sum() > 10 and not moved[stored_dropped].any()
    assert moved[torch.isin(keys_after, kept)].all()
