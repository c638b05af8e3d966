"""train/model/sparse_arch.py: table_lr_scales (a dynamic table's own sparse rate from the
config, resolved through any feature of the table, and the errors that name the field), and
the cold-ids config's pooled embeddings and cold flags against their definition."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos import pipeline_pb2
from shared.config import ConfigError, load_config, parse_config
from shared.features import FeatureSet, LfuDecaySpec, feature_set_from_text
from tests.conftest import ROOT, SEED_CONFIG
from train.model.multi_tower_din import MultiTowerDIN
from train.model.sparse_arch import table_lr_scales

COLD_IDS_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb_cold_ids.config"


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


def test_cold_ids_lookup_pools_and_flags_each_feature_as_defined(tiny_samples: Path) -> None:
    """The cold-ids config's SparseArch (cold=True, after 4 training steps on other rows, so
    some keys are warm and some cold): every pooled feature is its own lookup's rows pooled alone (``pool``), every cold
    flag the definition (a pooled bag with ids and no hit; a sequence element without a
    row), bit for bit: one bag index for the pooling and the hit counts changes nothing."""
    import pyarrow.dataset as ds
    import torch

    from shared.dense_inputs import feature_parts, pool
    from shared.features import build_feature_set
    from shared.fg import table_to_batch
    from train.trainer import build_optimizers, train_step

    config = load_config(COLD_IDS_CONFIG)
    fs = build_feature_set(config)
    table = ds.dataset(str(tiny_samples / "train"), format="parquet").head(512)
    seen, batch = (table_to_batch(fs, table.slice(at, 256)) for at in (0, 256))
    model = MultiTowerDIN.from_config(config, fs, seed=0)
    assert model.dense.takes_cold
    opts = build_optimizers(model, config.train_config)
    for step in range(4):  # the keys of `seen` admitted (threshold 3), `batch` has new ones
        train_step(model, opts, seen, step)
    model.eval()
    with torch.no_grad():
        embedded = model.sparse(batch, cold=True)
        parts = feature_parts(batch)
        rows, hits = model.sparse._lookup(parts, hits=True)
    flags = []
    for (which, name, _ids, lengths), emb, found in zip(parts, rows, hits, strict=True):
        if which == "sequence":
            assert torch.equal(embedded.sequences[name], emb), name
        else:
            want = pool(emb, lengths, fs.tables[fs.features[name].table].pooling)
            assert torch.equal(embedded.pooled[name], want), name
        if found is None:
            assert name not in embedded.cold, name
            continue
        if which == "sequence":
            want_cold = ~found
        else:
            bags = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
            hit_bags = torch.zeros(lengths.shape[0], dtype=torch.bool).index_fill_(
                0, bags[found], True
            )
            want_cold = (lengths > 0) & ~hit_bags
        assert torch.equal(embedded.cold[name], want_cold), name
        flags.append(want_cold)
    assert list(embedded.cold) == [p[1] for p, h in zip(parts, hits, strict=True) if h is not None]
    both = torch.cat(flags)
    assert bool(both.any()) and not bool(both.all())  # warm and cold rows both


def test_a_tables_lfu_decay_reaches_the_models_storage_of_it() -> None:
    """``dynamicemb.lfu_decay`` of the config is honoured: the model's storage of that table
    decays (a storage of its own, as it cannot share one with tables that do not)."""
    text = SEED_CONFIG.read_text()
    block = 'max_capacity: 300000\ninitializer_args { mode: "NORMAL"; std_dev: 0.05 }\n'
    assert block in text
    text = text.replace(block, block + "lfu_decay { interval_steps: 50 }\n", 1)
    config, fs = parse_config(text, "decay"), feature_set_from_text(text, "decay")
    dynamic = MultiTowerDIN.from_config(config, fs).sparse.dynamic
    storage, _ = dynamic._lookup_table("user_id_emb")
    assert storage.names == ["user_id_emb"]
    assert storage.lfu_decay == LfuDecaySpec(interval_steps=50, shift=1)
    others = {dynamic._lookup_table(n)[0] for n in dynamic.tables if n != "user_id_emb"}
    assert others and all(s.lfu_decay is None for s in others)
