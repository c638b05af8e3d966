"""The cold-id backoff (train.model.backoff): which features back off to which, what a cold row
gets, the gradients, and that the switch off (or zero weights) leaves the model as it was."""

from __future__ import annotations

import pytest
import torch

from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import ConfigError, load_config
from shared.dense_inputs import COLD_NAMES
from shared.features import FeatureSet, build_feature_set
from tests.conftest import SEED_CONFIG
from train.model.backoff import ColdBackoff, backoff_spaces
from train.model.dense_arch import DenseArch, DenseArchConfig, example_inputs
from train.model.multi_tower_din import MultiTowerDIN


def _spaces(fs: FeatureSet, **sources: list[str]):
    config = pipeline_pb2.ColdBackoff()
    for name, side in sources.items():
        config.sources.add(feature_name=name, side_features=side)
    return {s.space: s for s in backoff_spaces(fs, config)}


ITEM_SIDES = ["brand", "campaign_id", "customer", "cate_id", "price"]
SEQ_SIDES = ["click_50_seq__cate_id", "click_50_seq__brand"]


def test_user_features_back_off_by_default_items_when_named(seed_fs: FeatureSet) -> None:
    spaces = _spaces(seed_fs)
    assert [s.mask_width for s in spaces.values()] == [1, 5, 3]  # a column per dynamic feature
    assert not spaces["item"].features and not spaces["sequence"].features
    spaces = _spaces(seed_fs, adgroup_id=ITEM_SIDES, click_50_seq__adgroup_id=SEQ_SIDES)
    feats = {f.name: f for s in spaces.values() for f in s.features}
    assert [f.name for f in spaces["user"].features] == ["user_id"]
    assert feats["user_id"].sources == (
        "cms_segid", "cms_group_id", "final_gender_code", "age_level", "pvalue_level",
        "shopping_level", "occupation", "new_user_class_level",
    )  # fmt: skip
    # item side: the other ITEM features of the DEEP group (pid, a CONTEXT feature, is not one)
    assert feats["adgroup_id"].sources == ("brand", "campaign_id", "customer", "cate_id", "price")
    assert feats["adgroup_id"].columns == (("item_deep", 0), ("query", 0))  # both places
    assert feats["click_50_seq__adgroup_id"].sources == tuple(SEQ_SIDES)
    assert [f.mask_column for f in feats.values()] == [0, 0, 0]
    assert [s.mask for s in spaces.values()] == list(COLD_NAMES)


def test_sources_can_be_overridden_and_are_checked(seed_fs: FeatureSet) -> None:
    feats = {f.name: f for f in _spaces(seed_fs, adgroup_id=["cate_id", "brand"])["item"].features}
    assert feats["adgroup_id"].sources == ("brand", "cate_id")  # the input's order
    assert list(feats) == ["adgroup_id"]  # the other item features stay as they are
    assert _spaces(seed_fs, user_id=[])["user"].features[0].sources == ()  # unknown vector only
    with pytest.raises(ConfigError, match=r"sources\[0\]\.feature_name.*'price' is not a dynamic"):
        _spaces(seed_fs, price=["brand"])
    with pytest.raises(ConfigError, match=r"sources\[0\]\.side_features.*same row and side"):
        _spaces(seed_fs, adgroup_id=["age_level"])  # a user feature for an item one
    with pytest.raises(ConfigError, match="side_features"):
        _spaces(seed_fs, adgroup_id=["adgroup_id"])


def test_a_cold_row_gets_the_projection_of_its_warm_side_features(seed_fs: FeatureSet) -> None:
    brand_sides = ["adgroup_id", "campaign_id", "customer", "cate_id", "price"]
    space = _spaces(seed_fs, adgroup_id=ITEM_SIDES, brand=brand_sides)["item"]
    backoff = ColdBackoff([space])
    layer = backoff.by_space["item"]
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    item, query = torch.randn(3, 112), torch.randn(3, 48)
    cold = torch.zeros(3, space.mask_width, dtype=torch.bool)
    cold[1, 0] = True  # row 1: adgroup_id cold
    cold[2, [0, 1]] = True  # row 2: adgroup_id and brand cold
    out = backoff({"item_deep": item, "query": query, "item_cold": cold})
    assert torch.equal(out["item_deep"][0], item[0]) and torch.equal(out["query"][0], query[0])
    ad = space.features[0]
    rows = slice(0, 16)
    for r in (1, 2):
        side = item[r].clone()
        side[cold[r].nonzero().flatten() * 16 + torch.arange(16).unsqueeze(1)] = 0.0  # cold: 0
        w = layer.weight[rows] * layer.allowed[rows]
        want = torch.tanh(w @ side + layer.bias[rows]) * layer.scale[rows]
        torch.testing.assert_close(out["item_deep"][r, rows], want)
        torch.testing.assert_close(out["query"][r, 0:16], want)  # the query's adgroup_id too
        assert torch.equal(out["item_deep"][r, 80:], item[r, 80:])  # price, pid: never cold
    assert ad.name == "adgroup_id"
    assert torch.equal(out["item_deep"][1, 16:], item[1, 16:])  # row 1's other features
    with pytest.raises(ValueError, match="item_cold must be bool"):
        backoff({"item_deep": item, "query": query, "item_cold": cold.float()})


def test_gradients_reach_the_backoff_and_side_features_of_cold_rows_only(
    seed_fs: FeatureSet,
) -> None:
    space = _spaces(seed_fs, adgroup_id=ITEM_SIDES)["item"]
    backoff = ColdBackoff([space])
    item = torch.randn(2, 112, requires_grad=True)
    query = torch.randn(2, 48)
    cold = torch.zeros(2, space.mask_width, dtype=torch.bool)
    cold[1, 0] = True
    backoff({"item_deep": item, "query": query, "item_cold": cold})["item_deep"].sum().backward()
    layer = backoff.by_space["item"]
    assert layer.weight.grad is not None and layer.bias.grad is not None
    assert layer.bias.grad[:16].tolist() == [0.25] * 16 and not layer.bias.grad[16:].any()
    assert (layer.weight.grad[16:] == 0).all()  # only adgroup_id's map was used
    assert layer.weight.grad[:16, :16].abs().sum() == 0  # its own (cold) column: no gradient
    assert item.grad is not None and not item.grad[1, :16].any()  # the cold key: none


def test_zero_backoff_scores_as_the_switch_off_at_the_start(tiny_batch: Batch) -> None:
    """Same seed: the backoff draws nothing, so every other weight is as without it; with its
    zero maps a cold row scores as before (its eval embedding is 0 too)."""
    off = load_config(SEED_CONFIG)
    on = load_config(SEED_CONFIG)
    on.model_config.multi_tower_din.cold_backoff.SetInParent()
    models = [MultiTowerDIN.from_config(c, build_feature_set(c), seed=3).eval() for c in (off, on)]
    a, b = (m.state_dict() for m in models)
    assert set(b) - set(a) == {k for k in b if k.startswith("dense.backoff.")} != set()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        torch.testing.assert_close(models[0](tiny_batch), models[1](tiny_batch), rtol=0, atol=0)


def test_arch_config_round_trips_with_the_backoff(seed_fs: FeatureSet) -> None:
    config = load_config(SEED_CONFIG)
    config.model_config.multi_tower_din.cold_backoff.SetInParent()
    arch = DenseArch.from_config(seed_fs, config.model_config)
    assert DenseArchConfig.from_dict(arch.config.to_dict()) == arch.config
    rebuilt = DenseArch.from_arch_config(arch.config)
    assert rebuilt.takes_cold and set(rebuilt.state_dict()) == set(arch.state_dict())
    example = example_inputs(arch, pairs=True)
    assert [example[n].shape[1] for n in COLD_NAMES] == [1, 5, 3]
    with pytest.raises(ValueError, match="exports with the pair inputs"):
        example_inputs(arch, pairs=False)
    with pytest.raises(ValueError, match="pass all of"):
        arch(**{k: v for k, v in example.items() if k != "seq_cold"})
    plain = DenseArch.from_config(seed_fs, load_config(SEED_CONFIG).model_config)
    with pytest.raises(ValueError, match="no cold-id backoff"):
        plain(**example_inputs(plain), user_cold=example["user_cold"])
