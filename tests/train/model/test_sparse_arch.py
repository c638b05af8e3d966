"""train/model/sparse_arch.py's table_lr_scales: a dynamic table's own sparse rate from the
config, resolved through any feature of the table, and the errors that name the field."""

from __future__ import annotations

import pytest

from protos import pipeline_pb2
from shared.config import ConfigError, load_config
from shared.features import FeatureSet
from tests.conftest import SEED_CONFIG
from train.model.multi_tower_din import MultiTowerDIN
from train.model.sparse_arch import table_lr_scales


def _optimizer(*entries: tuple[str, float]) -> pipeline_pb2.SparseOptimizer:
    opt = pipeline_pb2.SparseOptimizer()
    opt.adagrad_optimizer.lr = 0.05
    for name, scale in entries:
        opt.table_learning_rates.add(feature_name=name, lr_scale=scale)
    return opt


def test_a_feature_names_its_table_and_the_model_trains_it_at_that_rate(
    seed_fs: FeatureSet,
) -> None:
    scales = table_lr_scales(seed_fs, _optimizer(("click_50_seq__cate_id", 4.0), ("brand", 0.5)))
    assert scales == {"cate_id_emb": 4.0, "brand_emb": 0.5}  # the sequence shares cate_id's
    assert table_lr_scales(seed_fs, _optimizer()) == {}

    config = load_config(SEED_CONFIG)
    config.train_config.sparse_optimizer.table_learning_rates.add(
        feature_name="cate_id", lr_scale=4.0
    )
    dynamic = MultiTowerDIN.from_config(config, seed_fs).sparse.dynamic
    assert dynamic.lr_scales == {"cate_id_emb": 4.0}
    assert dynamic.storages["cate_id_emb"] == ["cate_id_emb"]
    lr = config.train_config.sparse_optimizer.adagrad_optimizer.lr
    assert dynamic.table_adagrad("cate_id_emb").lr == pytest.approx(4 * lr)


@pytest.mark.parametrize(
    ("entries", "field", "message"),
    [
        ([("no_such", 2.0)], "[0].feature_name", "'no_such' is not a feature of this config"),
        ([("cms_group_id", 2.0)], "[0].feature_name", "only dynamic (dynamicemb) tables"),
        ([("cate_id", 0.0)], "[0].lr_scale", "give a scale > 0"),
        ([("cate_id", float("inf"))], "[0].lr_scale", "give a scale > 0"),
        ([("cate_id", 2.0), ("click_50_seq__cate_id", 3.0)], "[1].feature_name",
         "uses table cate_id_emb, whose rate an earlier entry sets"),
    ],
)  # fmt: skip
def test_bad_entries_name_the_field(
    seed_fs: FeatureSet, entries: list[tuple[str, float]], field: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        table_lr_scales(seed_fs, _optimizer(*entries))
    assert f"train_config.sparse_optimizer.table_learning_rates{field}" in str(err.value)
    assert message in str(err.value)


def test_cold_flags_are_each_features_own_in_one_pass() -> None:
    """cold_flags: every pooled feature's bags in one cold_rows and every sequence's elements
    in one negation give what each feature's own flags are (bags of 0, 1 and 3 ids)."""
    import torch

    from shared.dense_inputs import cold_rows
    from train.model.sparse_arch import cold_flags

    gen = torch.Generator().manual_seed(0)
    parts, hits = [], []
    for which, name, rows in (
        ("user", "user_id", 5), ("item", "price", 5), ("item", "adgroup_id", 5),
        ("sequence", "click_50_seq__adgroup_id", 0), ("sequence", "click_50_seq__brand", 0),
    ):  # fmt: skip
        lengths = torch.randint(0, 4, (rows,), generator=gen) if rows else torch.zeros(0)
        n = int(lengths.sum()) if rows else 7
        ids = torch.arange(n)
        parts.append((which, name, ids, lengths.to(torch.int64)))
        hits.append(None if name == "price" else torch.rand(n, generator=gen) < 0.5)
    got = cold_flags(parts, hits)
    assert list(got) == ["user_id", "adgroup_id", "click_50_seq__adgroup_id", "click_50_seq__brand"]
    for (which, name, _ids, lengths), found in zip(parts, hits, strict=True):
        if found is None:
            continue
        want = ~found if which == "sequence" else cold_rows(found, lengths)
        assert torch.equal(got[name], want), name
