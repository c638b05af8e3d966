"""Keyed initializers: deterministic per (seed, table, key), right distributions."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from shared.features import InitializerSpec, InitMode
from shared.hashtable.initializers import KeyedInitializer, inv_normal_cdf, key_uniforms, log_f64

KEYS = torch.arange(50_000) * 7919 + 3


def test_values_depend_only_on_seed_table_key():
    init = KeyedInitializer(InitializerSpec(InitMode.NORMAL, std_dev=0.05), seed=3, table="a_emb")
    all_at_once = init(KEYS, 8)
    perm = torch.randperm(KEYS.numel())
    assert torch.equal(init(KEYS[perm], 8), all_at_once[perm])  # order/batch independent
    assert torch.equal(init(KEYS[:10], 8), all_at_once[:10])
    other_table = KeyedInitializer(init.spec, seed=3, table="b_emb")(KEYS[:10], 8)
    other_seed = KeyedInitializer(init.spec, seed=4, table="a_emb")(KEYS[:10], 8)
    assert not torch.equal(other_table, all_at_once[:10])
    assert not torch.equal(other_seed, all_at_once[:10])


def test_uniforms_are_open_unit_interval_and_uniform():
    u = key_uniforms(KEYS, 4, salt=123)
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.005).all())


def test_inverse_normal_cdf_and_log_match_references():
    p = [1e-300, 1e-20, 1e-6, 0.02, 0.074, 0.3, 0.5, 0.77, 0.93, 0.999999]
    ref = torch.tensor([statistics.NormalDist().inv_cdf(x) for x in p], dtype=torch.float64)
    got = inv_normal_cdf(torch.tensor(p, dtype=torch.float64))
    torch.testing.assert_close(got, ref, rtol=1e-14, atol=0)
    x = torch.tensor([1e-300, 1e-5, 0.1, 0.5, 0.7071, 1.0, 3.0], dtype=torch.float64)
    ref_log = torch.tensor([math.log(v) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log_f64(x), ref_log, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize(
    ("spec", "mean", "std", "lo", "hi"),
    [
        (InitializerSpec(InitMode.NORMAL, mean=0.1, std_dev=0.05), 0.1, 0.05, None, None),
        (InitializerSpec(InitMode.UNIFORM, lower=-0.2, upper=0.4), 0.1, 0.6 / 12**0.5, -0.2, 0.4),
        (
            InitializerSpec(InitMode.TRUNCATED_NORMAL, std_dev=1.0, lower=-1.0, upper=1.0),
            0.0,
            0.5379,  # std of N(0, 1) conditioned on [-1, 1]
            -1.0,
            1.0,
        ),
    ],
)
def test_distributions(spec, mean, std, lo, hi):
    x = KeyedInitializer(spec, seed=0, table="t")(KEYS, 4).double()
    assert abs(x.mean().item() - mean) < 0.01 * max(std, 0.1)
    assert abs(x.std().item() - std) < 0.01 * std
    if lo is not None:
        assert x.min().item() >= lo and x.max().item() <= hi


def test_constant():
    x = KeyedInitializer(InitializerSpec(InitMode.CONSTANT, value=0.25), seed=0, table="t")(
        KEYS[:3], 2
    )
    assert x.tolist() == [[0.25, 0.25]] * 3 and x.dtype == torch.float32
