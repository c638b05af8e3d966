"""The cold users' logit term (train.model.cold_head): nothing at the start, nothing on warm
rows and no gradient from them, the config round trip and its errors, and the exported program
equal to the module with a trained head."""

from __future__ import annotations

import pytest
import torch
from google.protobuf import text_format

from shared.batch import Batch
from shared.config import ConfigError, load_config
from shared.features import FeatureSet, build_feature_set
from tests.conftest import SEED_CONFIG
from train.model.cold_head import ColdHead
from train.model.dense_arch import DenseArch, DenseArchConfig, example_inputs, export_dense_arch
from train.model.mlp import MLPConfig
from train.model.multi_tower_din import MultiTowerDIN


def _config(head: str = "cold_head { hidden_units: [8] }"):
    config = load_config(SEED_CONFIG)
    text_format.Merge(head, config.model_config.multi_tower_din.cold_backoff)
    return config


def test_the_head_changes_nothing_at_the_start(tiny_batch: Batch) -> None:
    """It draws nothing from the global generator and its output starts at zero: every other
    weight and every score (the fresh tables' users are all cold) are as without it."""
    plain = load_config(SEED_CONFIG)
    plain.model_config.multi_tower_din.cold_backoff.SetInParent()
    models = [
        MultiTowerDIN.from_config(c, build_feature_set(c), seed=3).eval()
        for c in (plain, _config())
    ]
    a, b = (m.state_dict() for m in models)
    assert set(b) - set(a) == {k for k in b if k.startswith("dense.cold_head.")} != set()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        torch.testing.assert_close(models[0](tiny_batch), models[1](tiny_batch), rtol=0, atol=0)


def test_warm_rows_get_nothing_and_send_no_gradient() -> None:
    head = ColdHead(6, MLPConfig((4,)))
    torch.nn.init.normal_(head.output.weight)  # as after training
    x = torch.randn(3, 6)
    cold = torch.tensor([False, True, False])
    out = head(x, cold)
    assert out[0] == 0 and out[2] == 0 and out[1] != 0
    out.sum().backward()
    grads = [p.grad.clone() for p in head.parameters()]  # type: ignore[union-attr]
    head.zero_grad()
    head(x[1:2], cold[1:2]).sum().backward()  # the cold row alone
    for g, p in zip(grads, head.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_config_round_trips_and_errors_name_the_field(seed_fs: FeatureSet) -> None:
    arch = DenseArch.from_config(seed_fs, _config().model_config)
    assert arch.config.cold_head == MLPConfig((8,))
    assert DenseArchConfig.from_dict(arch.config.to_dict()) == arch.config
    rebuilt = DenseArch.from_arch_config(arch.config)
    assert set(rebuilt.state_dict()) == set(arch.state_dict())
    old = {k: v for k, v in arch.config.to_dict().items() if k != "cold_head"}
    assert DenseArchConfig.from_dict(old).cold_head is None  # configs stored before the head
    with pytest.raises(ConfigError, match=r"cold_backoff\.cold_head"):
        DenseArch.from_config(seed_fs, _config("cold_head { hidden_units: [] }").model_config)
    c = arch.config
    with pytest.raises(ValueError, match="needs the user cold mask"):
        DenseArch(c.user_deep_dim, c.item_deep_dim, c.seq_dim, c.tower, c.attn, c.final,
                  cold_head=MLPConfig((8,)))  # fmt: skip


def test_the_exported_program_scores_as_the_module(seed_fs: FeatureSet) -> None:
    arch = DenseArch.from_config(seed_fs, _config().model_config).eval()
    assert arch.cold_head is not None
    with torch.no_grad():
        for p in arch.cold_head.parameters():  # as after training: a head that says something
            p.normal_(0, 0.3)
    inputs = example_inputs(arch, pairs=True)
    inputs["user_cold"] = torch.tensor([[True], [False], [True]])  # users of rows 0, 2 and 3
    program = export_dense_arch(arch, example_inputs(arch, pairs=True))
    with torch.no_grad():
        want = arch(**inputs)
        got = program.module()(**inputs)
        without = arch.score(
            *(inputs[k] for k in ("user_deep", "item_deep", "query", "seq_values")),
            inputs["seq_lengths"], inputs["user_index"], inputs["pair_segment"],
            inputs["pair_element"],
        )  # fmt: skip
    torch.testing.assert_close(got, want)
    assert torch.equal(want[1], without[1]) and not torch.equal(want[[0, 2, 3]], without[[0, 2, 3]])
