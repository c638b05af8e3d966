"""bench.train_cached: the ``cached`` config is the seed config but for ``cache_load_factor``
0.1 on every dynamic table (and is refused without one), and the cached/dynamic ratios judge
issue #52's item 2 (at least 0.85x the samples/s, AUC within 0.001)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_train import CONFIGS
from bench.train_cached import CACHED_GOALS, cached_config, cached_ratios
from shared.config import config_digest, load_config
from shared.features import build_feature_set


def test_cached_config_is_the_seed_config_with_a_cache_on_every_dynamic_table(
    tmp_path: Path,
) -> None:
    out = cached_config(CONFIGS["dynamic"], tmp_path / "cached.config")
    seed, cached = load_config(CONFIGS["dynamic"]), load_config(out)
    tables = build_feature_set(cached).dynamic_tables
    assert len(tables) == 6
    assert [t.dynamic.cache_load_factor for t in tables if t.dynamic] == [pytest.approx(0.1)] * 6
    assert all(t.dynamic.cache_load_factor is None for t in build_feature_set(seed).dynamic_tables
               if t.dynamic)  # fmt: skip
    for fc in cached.feature_configs:  # nothing else differs
        feature = getattr(fc, fc.WhichOneof("feature"))
        if "dynamicemb" in feature.DESCRIPTOR.fields_by_name and feature.HasField("dynamicemb"):
            feature.dynamicemb.ClearField("cache_load_factor")
    assert config_digest(cached) == config_digest(seed)


def test_a_config_without_dynamic_tables_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="has no dynamicemb table.*cached=PATH"):
        cached_config(CONFIGS["buckets"], tmp_path / "cached.config")


def _run(samples_per_s: float, auc: float) -> dict:
    return {"end_to_end": {"samples_per_s": samples_per_s, "eval": {"auc": auc}}}


def test_ratios_and_goals() -> None:
    dyn = _run(1000.0, 0.70)
    met = cached_ratios(_run(900.0, 0.7005), dyn, 1.1)
    assert met["end_to_end_samples_per_s"] == pytest.approx(0.9)
    assert met["auc_diff"] == pytest.approx(0.0005)
    assert met["step_ms"] == 1.1
    assert set(met["goals"]) == set(CACHED_GOALS)
    assert all(g["met"] for g in met["goals"].values())
    slow = cached_ratios(_run(800.0, 0.698), dyn, None)["goals"]
    assert not slow["end_to_end_over_dynamic"]["met"]
    assert slow["auc_abs_diff"]["got"] == pytest.approx(0.002) and not slow["auc_abs_diff"]["met"]
    unknown = cached_ratios({"step": {}}, dyn, 1.0)
    assert unknown["end_to_end_samples_per_s"] is None and unknown["auc_diff"] is None
    assert all(g["met"] is None for g in unknown["goals"].values())
