"""train.lr_schedule: tzrec's formulas (values worked out by hand from
tzrec/optim/lr_scheduler.py at 54cac3165a2a, and against torch's own schedulers where they are
the same curve), the errors that name the field, and a tzrec config that sets them parsing."""

from __future__ import annotations

import math

import pytest
import torch
from google.protobuf import text_format

from protos import pipeline_pb2
from shared.config import parse_config
from tests.conftest import SEED_CONFIG
from train.lr_schedule import Schedule, schedule_of
from train.trainer import learning_rate_schedules

FIELD = "train_config.dense_optimizer"


def _schedule(text: str, base: float = 0.1) -> Schedule:
    opt = text_format.Parse(text, pipeline_pb2.DenseOptimizer())
    return schedule_of(opt, base, FIELD)


def test_constant_and_unset_keep_the_base() -> None:
    for text in ("", "constant_learning_rate {}"):
        s = _schedule(text)
        assert s.constant and [s.rate(k, 0) for k in (0, 7, 10**6)] == [0.1] * 3


def test_exponential_decay_with_warmup_staircase_and_floor() -> None:
    s = _schedule(
        "exponential_decay_learning_rate { decay_size: 10 decay_factor: 0.5 "
        "warmup_learning_rate: 0.01 warmup_size: 5 min_learning_rate: 0.02 }"
    )
    assert s.rate(0, 0) == pytest.approx(0.01)  # the warmup's start
    assert s.rate(2, 0) == pytest.approx(0.01 + 0.09 * 2 / 5)
    assert s.rate(5, 0) == pytest.approx(0.1)  # decay from the warmup's end
    assert s.rate(14, 0) == pytest.approx(0.1)  # staircase: p = floor(9 / 10) = 0
    assert s.rate(15, 0) == pytest.approx(0.05)
    assert s.rate(25, 0) == pytest.approx(0.025)
    assert s.rate(35, 0) == pytest.approx(0.02)  # 0.0125 under the floor


def test_exponential_decay_without_staircase_is_torch_exponential_lr() -> None:
    # the config fields are float32: equal to torch to float32 precision
    s = _schedule(
        "exponential_decay_learning_rate { decay_size: 1 decay_factor: 0.9 staircase: false }"
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    ref = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    for k in range(30):
        assert s.rate(k, 0) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6)
        opt.step()
        ref.step()


def test_manual_steps_switch_after_each_size_and_warm_up() -> None:
    text = "manual_step_learning_rate { schedule_sizes: [10, 20] learning_rates: [0.05, 0.01] %s }"
    s = _schedule(text % "")
    # bisect_left: the rate changes on the step after a size (tzrec's ManualStepLR)
    assert [s.rate(k, 0) for k in (0, 10, 11, 20, 21, 1000)] == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.01, 0.01]
    )
    w = _schedule(text % "warmup: true")
    assert w.rate(0, 0) == pytest.approx(0.1)
    assert w.rate(5, 0) == pytest.approx(0.1 + (0.05 - 0.1) * 0.5)
    assert w.rate(10, 0) == pytest.approx(0.05)


def test_cosine_is_torch_cosine_annealing_then_holds_its_minimum() -> None:
    s = _schedule("cosine_annealing_learning_rate { T_max: 40 min_learning_rate: 0.001 }")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40, eta_min=0.001)
    for k in range(41):
        assert s.rate(k, 0) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6)
        opt.step()
        ref.step()
    assert s.rate(41, 0) == s.rate(1000, 0) == pytest.approx(0.001)  # torch's would rise again


def test_cosine_warmup_then_cosine() -> None:
    s = _schedule(
        "cosine_annealing_learning_rate { T_max: 10 warmup_size: 4 warmup_learning_rate: 0.0 }"
    )
    assert [s.rate(k, 0) for k in range(4)] == pytest.approx([0.0, 0.025, 0.05, 0.075])
    assert s.rate(4, 0) == pytest.approx(0.1)
    assert s.rate(9, 0) == pytest.approx(0.05)  # half way: t = 5 of 10


@pytest.mark.parametrize("t_mult", [1, 2, 3])
def test_warm_restarts_are_torch_cosine_annealing_warm_restarts(t_mult: int) -> None:
    s = _schedule(
        "cosine_annealing_warm_restarts_learning_rate "
        f"{{ T_0: 5 T_mult: {t_mult} min_learning_rate: 0.002 }}"
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    ref = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt, T_0=5, T_mult=t_mult, eta_min=0.002
    )
    for k in range(60):
        assert s.rate(k, 0) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6), k
        opt.step()
        ref.step()


def test_by_epoch_follows_the_epoch_not_the_step() -> None:
    s = _schedule(
        "exponential_decay_learning_rate { decay_size: 1 decay_factor: 0.5 by_epoch: true }"
    )
    assert s.rate(0, 0) == s.rate(999, 0) == pytest.approx(0.1)
    assert s.rate(0, 2) == pytest.approx(0.025)


def test_a_base_of_zero_stays_zero() -> None:
    s = _schedule("cosine_annealing_learning_rate { T_max: 10 warmup_size: 3 "
                  "warmup_learning_rate: 0.5 }", base=0.0)  # fmt: skip
    assert [s.rate(k, 0) for k in (0, 5, 20)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "text, field, says",
    [
        ("exponential_decay_learning_rate {}", "exponential_decay_learning_rate.decay_size",
         "must be > 0"),
        ("cosine_annealing_learning_rate {}", "cosine_annealing_learning_rate.T_max",
         "must be > 0"),
        ("cosine_annealing_warm_restarts_learning_rate { T_0: 3 T_mult: 0 }",
         "cosine_annealing_warm_restarts_learning_rate.T_mult", ">= 1"),
        ("manual_step_learning_rate { schedule_sizes: [5] learning_rates: [0.1, 0.2] }",
         "manual_step_learning_rate.schedule_sizes", "one rate per size"),
        ("manual_step_learning_rate { schedule_sizes: [9, 5] learning_rates: [0.1, 0.2] }",
         "manual_step_learning_rate.schedule_sizes", "ascending"),
    ],
)  # fmt: skip
def test_settings_no_schedule_runs_with_name_the_field(text: str, field: str, says: str) -> None:
    with pytest.raises(ValueError, match=rf"{FIELD}\.{field}: .*{says}"):
        _schedule(text)


def test_a_tzrec_config_with_schedules_parses_and_builds_them() -> None:
    text = SEED_CONFIG.read_text()
    assert text.count("constant_learning_rate {}") == 2
    text = text.replace(
        "constant_learning_rate {}",
        "exponential_decay_learning_rate { decay_size: 1000 decay_factor: 0.9 }",
        1,
    ).replace("constant_learning_rate {}", "cosine_annealing_learning_rate { T_max: 500 }")
    config = parse_config(text, "tzrec_style.config")
    schedules = learning_rate_schedules(config.train_config)
    sparse, dense = schedules["sparse"], schedules["dense"]
    assert sparse.field == "train_config.sparse_optimizer.exponential_decay_learning_rate"
    assert sparse.rate(1000, 0) == pytest.approx(0.001 * 0.9)
    assert dense.rate(250, 0) == pytest.approx(0.001 * 0.5 * (1 + math.cos(math.pi / 2)))
