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
