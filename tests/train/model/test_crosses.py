"""Feature crosses (train.model.crosses): which pairs, the term itself, its place in the model,
and that a model without them is the model as it was."""

from __future__ import annotations

import pytest
import torch

from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import ConfigError, load_config
from shared.features import FeatureSet, build_feature_set
from tests.conftest import SEED_CONFIG
from train.model.crosses import FeatureCrosses, crosses_of
from train.model.dense_arch import DenseArch, DenseArchConfig, example_inputs
from train.model.multi_tower_din import MultiTowerDIN

USER = ["user_id", "cms_segid", "cms_group_id", "final_gender_code", "age_level",
        "pvalue_level", "shopping_level", "occupation", "new_user_class_level"]  # fmt: skip
ITEM = ["adgroup_id", "brand", "campaign_id", "customer", "cate_id", "pid", "price"]


def _crosses(fs: FeatureSet, *pairs: tuple[str, str]):
    config = pipeline_pb2.FeatureCrosses()
    for u, i in pairs:
        config.pairs.add(user_feature=u, item_feature=i)
    return crosses_of(fs, config)


def test_every_user_item_pair_by_default_named_ones_when_given(seed_fs: FeatureSet) -> None:
    every = _crosses(seed_fs)
    assert [(c.user_feature, c.item_feature) for c in every] == [(u, i) for u in USER for i in ITEM]
    assert {c.dim for c in every} == {16}
    named = _crosses(seed_fs, ("cms_group_id", "cate_id"), ("cms_group_id", "adgroup_id"))
    # columns in user_deep and item_deep, in the dense layout's order
    assert [(c.user_column, c.item_column) for c in named] == [(32, 64), (32, 0)]


def test_pairs_are_checked(seed_fs: FeatureSet) -> None:
    with pytest.raises(ConfigError, match=r"pairs\[0\]\.user_feature.*'cate_id' is not a USER"):
        _crosses(seed_fs, ("cate_id", "brand"))
    with pytest.raises(ConfigError, match=r"pairs\[1\]\.item_feature.*'age_level' is not an ITEM"):
        _crosses(seed_fs, ("user_id", "brand"), ("user_id", "age_level"))
    with pytest.raises(ConfigError, match=r"pairs\[0\]\.item_feature.*'nope'"):
        _crosses(seed_fs, ("user_id", "nope"))
    with pytest.raises(ConfigError, match="named twice"):
        _crosses(seed_fs, ("user_id", "brand"), ("user_id", "brand"))


def test_the_term_is_the_weighted_sum_of_the_pairs_dot_products(seed_fs: FeatureSet) -> None:
    crosses = _crosses(seed_fs, ("cms_group_id", "cate_id"), ("age_level", "adgroup_id"))
    module = FeatureCrosses(crosses, user_deep_dim=144)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([0.5, -2.0]))
    x = torch.randn(5, 144 + 112)
    group, age = x[:, 32:48], x[:, 64:80]  # cms_group_id, age_level (user_deep)
    cate, ad = x[:, 144 + 64 : 144 + 80], x[:, 144 : 144 + 16]  # cate_id, adgroup_id
    want = 0.5 * (group * cate).sum(1) - 2.0 * (age * ad).sum(1)
    torch.testing.assert_close(module(x), want)
    module(x).sum().backward()
    assert module.weight.grad is not None
    torch.testing.assert_close(
        module.weight.grad, torch.stack([(group * cate).sum(), (age * ad).sum()])
    )


def test_the_switch_adds_the_term_and_changes_no_other_weight(tiny_batch: Batch) -> None:
    """Same seed: the crosses draw nothing, so every other weight is as without them, and the
    logits differ by exactly the term."""
    off = load_config(SEED_CONFIG)
    on = load_config(SEED_CONFIG)
    # two static tables: a fresh model's dynamic ones give 0 in eval (nothing inserted)
    on.model_config.multi_tower_din.crosses.pairs.add(
        user_feature="cms_group_id", item_feature="pid"
    )
    models = [MultiTowerDIN.from_config(c, build_feature_set(c), seed=3).eval() for c in (off, on)]
    a, b = (m.state_dict() for m in models)
    assert set(b) - set(a) == {"dense.crosses.weight"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert models[0].dense.crosses is None
    with torch.no_grad():
        delta = models[1](tiny_batch) - models[0](tiny_batch)
        models[1].dense.crosses.weight.zero_()
        torch.testing.assert_close(models[1](tiny_batch), models[0](tiny_batch), rtol=0, atol=0)
    assert delta.abs().max() > 0  # the embeddings' initial values are not zero


def test_arch_config_round_trips_with_the_crosses(seed_fs: FeatureSet) -> None:
    config = load_config(SEED_CONFIG)
    config.model_config.multi_tower_din.crosses.SetInParent()  # every pair
    arch = DenseArch.from_config(seed_fs, config.model_config)
    assert len(arch.config.crosses) == 63
    assert DenseArchConfig.from_dict(arch.config.to_dict()) == arch.config
    rebuilt = DenseArch.from_arch_config(arch.config)
    rebuilt.load_state_dict(arch.state_dict())
    example = example_inputs(arch, pairs=True)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(**example), arch(**example), rtol=0, atol=0)
    # a checkpoint's config from before the crosses existed still reads, without them
    old = {k: v for k, v in arch.config.to_dict().items() if k != "crosses"}
    assert DenseArchConfig.from_dict(old).crosses == ()
