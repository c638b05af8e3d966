"""shared.hashtable.placement: each dynamic table's mode and bytes, planned from the config."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.features import FeatureSet, TableSpec
from shared.hashtable.placement import (
    GIB,
    INDEX_BYTES_PER_SLOT,
    PlacementError,
    StorageMode,
    describe,
    plan_placement,
)


def _with_factor(t: TableSpec, factor: float | None) -> TableSpec:
    assert t.dynamic is not None
    return replace(t, dynamic=replace(t.dynamic, cache_load_factor=factor))


def test_without_a_budget_every_table_is_hbm_only_with_its_layout_bytes(
    seed_fs: FeatureSet,
) -> None:
    plans = {p.table: p for p in plan_placement(seed_fs.dynamic_tables, hbm_budget=None)}
    assert set(plans) == {t.name for t in seed_fs.dynamic_tables}
    user = plans["user_id_emb"]  # max_capacity 300000, dim 16, admission (counter 300000)
    assert user.mode is StorageMode.HBM_ONLY and user.cache_load_factor == 1.0
    assert not user.planned
    assert user.slots == 300_032  # whole buckets of 128
    assert user.index_bytes == 300_032 * INDEX_BYTES_PER_SLOT
    assert user.value_bytes == 300_032 * 16 * 8  # values + Adagrad state, float32
    assert user.counter_bytes == 300_032 * INDEX_BYTES_PER_SLOT  # counter buckets of 1024
    assert user.hbm_bytes == user.index_bytes + user.value_bytes + user.counter_bytes
    assert user.host_bytes == 0
    no_admission = replace(seed_fs.tables["brand_emb"].dynamic, admission=None)
    brand = replace(seed_fs.tables["brand_emb"], dynamic=no_admission)
    assert plan_placement([brand], hbm_budget=None)[0].counter_bytes == 0


def test_a_budget_that_fits_changes_nothing(seed_fs: FeatureSet) -> None:
    free = plan_placement(seed_fs.dynamic_tables, hbm_budget=None)
    assert plan_placement(seed_fs.dynamic_tables, hbm_budget=GIB) == free


def test_a_tight_budget_plans_one_cached_share_of_the_values(seed_fs: FeatureSet) -> None:
    budget = GIB // 10
    plans = plan_placement(seed_fs.dynamic_tables, hbm_budget=budget)
    assert {p.mode for p in plans} == {StorageMode.CACHING}
    assert {p.cache_load_factor for p in plans} == {0.31}
    assert all(p.planned for p in plans)
    assert sum(p.hbm_bytes for p in plans) <= budget
    assert all(p.host_bytes == p.value_bytes for p in plans)  # the host holds every row
    assert len(describe(plans)) == len(plans) + 1


def test_a_factor_the_config_sets_is_kept_and_the_others_planned(seed_fs: FeatureSet) -> None:
    tables = [
        _with_factor(t, 0.5) if t.name == "user_id_emb" else t for t in seed_fs.dynamic_tables
    ]
    plans = {p.table: p for p in plan_placement(tables, hbm_budget=GIB // 10)}
    assert plans["user_id_emb"].cache_load_factor == 0.5 and not plans["user_id_emb"].planned
    assert plans["adgroup_id_emb"].planned and plans["adgroup_id_emb"].cache_load_factor < 1.0


def test_a_budget_the_indexes_alone_exceed_is_refused_naming_the_biggest_table(
    seed_fs: FeatureSet,
) -> None:
    with pytest.raises(PlacementError) as e:
        plan_placement(seed_fs.dynamic_tables, hbm_budget=GIB // 100)
    message = str(e.value)
    assert "the budget is 0.01 GiB" in message
    assert "the biggest is user_id_emb" in message
    assert "Lower its max_capacity (or dim), or raise the budget" in message


def test_a_config_factor_below_one_plans_caching(seed_fs: FeatureSet) -> None:
    tables = [_with_factor(t, 0.1) if t.name == "brand_emb" else t for t in seed_fs.dynamic_tables]
    plans = {p.table: p for p in plan_placement(tables, hbm_budget=None)}
    assert plans["brand_emb"].mode is StorageMode.CACHING
    assert plans["brand_emb"].host_bytes == plans["brand_emb"].value_bytes
    assert {p.mode for n, p in plans.items() if n != "brand_emb"} == {StorageMode.HBM_ONLY}
