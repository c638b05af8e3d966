"""shared.hashtable.placement: each dynamic table's mode and bytes, planned from the config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shared.features import FeatureSet, TableSpec
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.cuda import insert
from shared.hashtable.host_store import TensorHostStore
from shared.hashtable.layout import RowArrays
from shared.hashtable.placement import (
    BUCKET_BYTES,
    GIB,
    INDEX_BYTES_PER_SLOT,
    INSERT_SCRATCH_BYTES_PER_BUCKET,
    INSERT_SCRATCH_BYTES_PER_SLOT,
    INSERT_SCRATCH_BYTES_PER_TABLE,
    INSERT_STAGE_BYTES_PER_SLOT,
    ROW_ARRAY_BYTES_PER_SLOT,
    SLOT_BYTES_PER_SLOT,
    PlacementError,
    StorageMode,
    TablePlacement,
    describe,
    insert_scratch_bytes,
    plan_placement,
)
from shared.hashtable.row_cache import RowCache
from shared.hashtable.storage import FusedStorage
from shared.hashtable.table import HashTable

from .conftest import dyn_table


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
    assert user.index_bytes == 300_032 * SLOT_BYTES_PER_SLOT + 300_032 // 128 * BUCKET_BYTES
    assert user.row_arrays is RowArrays.DEVICE
    assert user.row_array_bytes == 300_032 * ROW_ARRAY_BYTES_PER_SLOT
    assert user.value_bytes == 300_032 * 16 * 8  # values + Adagrad state, float32
    # the CUDA insert kernels' scratch: win, the bucket arrays and the stats on the device,
    # the stage where the row arrays are (here the device too)
    assert user.scratch_bytes == 300_032 * 4 + 300_032 // 128 * 20 + 2 * 16 * 8
    assert user.stage_bytes == 300_032 * 8
    assert user.insert_scratch_bytes == user.scratch_bytes + user.stage_bytes
    # counter buckets of 1024: its table and its insert scratch (row arrays on the device)
    counter_buckets = 300_032 // 1024
    counter_scratch = 300_032 * (4 + 8) + counter_buckets * 20 + 2 * 16 * 8
    assert user.counter_bytes == (
        300_032 * INDEX_BYTES_PER_SLOT + counter_buckets * BUCKET_BYTES + counter_scratch
    )
    assert user.cache_bytes == user.value_bytes  # HBM_ONLY: no line map
    assert user.hbm_bytes == (
        user.index_bytes
        + user.row_array_bytes
        + user.value_bytes
        + user.counter_bytes
        + user.insert_scratch_bytes
    )
    assert user.host_bytes == 0
    assert user.line().endswith("(300,032 slots x dim 16; row arrays on the device)")
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
    assert {p.cache_load_factor for p in plans} == {0.08}
    assert {p.row_arrays for p in plans} == {RowArrays.DEVICE}  # a 1 % cache fits with them
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


def test_a_budget_too_tight_for_the_indexes_moves_the_cached_tables_row_arrays_to_the_host(
    seed_fs: FeatureSet,
) -> None:
    budget = GIB // 12
    with_device_rows = [
        p.hbm_bytes for p in plan_placement(seed_fs.dynamic_tables, hbm_budget=None)
    ]
    plans = plan_placement(seed_fs.dynamic_tables, hbm_budget=budget)
    assert {p.mode for p in plans} == {StorageMode.CACHING}
    assert {p.row_arrays for p in plans} == {RowArrays.HOST}
    assert {p.cache_load_factor for p in plans} == {0.14}
    assert sum(p.hbm_bytes for p in plans) <= budget < sum(with_device_rows)
    for p in plans:  # the host holds every row's payload, the row arrays and the insert stage
        stage = p.slots * INSERT_STAGE_BYTES_PER_SLOT
        assert p.host_bytes == p.value_bytes + p.slots * ROW_ARRAY_BYTES_PER_SLOT + stage
        assert p.host_parts()["insert_stage"] == stage
        assert p.insert_scratch_bytes == p.scratch_bytes  # the stage is off the device
        assert p.hbm_bytes == p.index_bytes + p.counter_bytes + p.cache_bytes + p.scratch_bytes
        assert p.line().endswith(f"({p.slots:,} slots x dim {p.dim}; row arrays on the host)")


def test_a_budget_the_slot_arrays_alone_exceed_is_refused_naming_the_biggest_table(
    seed_fs: FeatureSet,
) -> None:
    with pytest.raises(PlacementError) as e:
        plan_placement(seed_fs.dynamic_tables, hbm_budget=GIB // 100)
    message = str(e.value)
    assert "at least 0.07 GiB with a 1% cache and the cached tables' row arrays" in message
    assert "(key, table id, score) in host memory, but the budget is 0.01 GiB" in message
    assert "the biggest is user_id_emb" in message
    assert "Lower its max_capacity (or dim), or raise the budget" in message


def test_a_table_the_config_keeps_hbm_only_keeps_its_row_arrays_on_the_device(
    seed_fs: FeatureSet,
) -> None:
    tables = [
        _with_factor(t, 1.0) if t.name == "cate_id_emb" else t for t in seed_fs.dynamic_tables
    ]
    plans = {p.table: p for p in plan_placement(tables, hbm_budget=GIB // 12)}
    assert plans["cate_id_emb"].mode is StorageMode.HBM_ONLY
    assert plans["cate_id_emb"].row_arrays is RowArrays.DEVICE
    assert {p.row_arrays for n, p in plans.items() if n != "cate_id_emb"} == {RowArrays.HOST}


def planned_storage(row_arrays: RowArrays, device: str) -> tuple[TablePlacement, FusedStorage]:
    """A CACHING storage of 4,096 slots in buckets of 16 (factor 0.25, an admission counter of
    4,096) on ``device`` with ``row_arrays``, and the planner's placement of it."""
    spec = dyn_table(
        "t_emb", dim=8, init_capacity=4096, max_capacity=4096, threshold=2, counter_capacity=4096
    )
    t = _with_factor(spec, 0.25)
    (planned,) = plan_placement([t], hbm_budget=None)
    s = FusedStorage(
        "t", [t], adagrad=AdagradConfig(0.1), seed=0, device=torch.device(device),
        row_arrays=row_arrays,
    )  # fmt: skip
    return replace(planned, row_arrays=row_arrays), s


def table_bytes(t: HashTable) -> int:
    """The bytes of a table's index: slot and bucket arrays, row arrays (an admission counter's
    whole table: it has no values)."""
    arrays = (t._slot_fp, t._slot_row, t._bucket_count, t._sentinel, t._row_key, t._row_tid)
    return sum(a.nbytes for a in (*arrays, t._row_score))


@pytest.mark.parametrize("row_arrays", list(RowArrays), ids=[r.value for r in RowArrays])
def test_the_planned_bytes_are_those_a_cached_storage_allocates(row_arrays: RowArrays) -> None:
    """The planner's bytes against the arrays a CACHING storage really makes (on the CPU every
    array is host memory; what is counted where is the plan's), the CUDA insert kernels' scratch
    as they make it for the table and its counter (``insert._Scratch``: the torch backend has
    none, the plan counts it whatever the backend; on CUDA: test_layout)."""
    plan, s = planned_storage(row_arrays, "cpu")
    table, cache, counter = s.table, s.payload, s.counter
    assert isinstance(cache, RowCache) and counter is not None and table.row_arrays is row_arrays

    def nbytes(*arrays: torch.Tensor) -> int:
        return sum(a.nbytes for a in arrays)

    assert plan.index_bytes == nbytes(
        table._slot_fp, table._slot_row, table._bucket_count, table._sentinel
    )
    assert plan.row_array_bytes == nbytes(table._row_key, table._row_tid, table._row_score)
    assert plan.line_map_bytes == nbytes(cache.line_of_row)
    lines = nbytes(cache.values, cache.accum, cache.row_of_line, cache.stamp, cache.dirty)
    assert cache.lines == 1024 and plan.cache_bytes == lines + plan.line_map_bytes
    scratch, stage = _scratch(table)
    assert (plan.scratch_bytes, plan.stage_bytes) == (scratch, stage)
    hosted = row_arrays is RowArrays.HOST
    assert plan.insert_scratch_bytes == scratch + (0 if hosted else stage)
    c = counter.table
    assert c.row_arrays is RowArrays.DEVICE  # a counter's stage is on the device
    assert plan.counter_bytes == table_bytes(c) + sum(_scratch(c))
    assert isinstance(cache.store, TensorHostStore)
    host = cache.store.nbytes + (plan.row_array_bytes + stage if hosted else 0)
    assert plan.host_bytes == host
    assert plan.hbm_bytes == sum(plan.device_parts().values())


def _scratch(table: HashTable) -> tuple[int, int]:
    """(bytes of the CUDA insert kernels' scratch for ``table`` but its stage, the stage's), as
    they make it at the table's first insert (its batch-sized ``rep_of`` empty)."""
    sc = insert._Scratch(table)
    assert sc.rep_of.numel() == 0
    total = sum(v.nbytes for v in vars(sc).values() if isinstance(v, torch.Tensor))
    return total - sc.stage.nbytes, sc.stage.nbytes


def test_the_insert_scratch_constants_are_the_kernels_layout() -> None:
    """4 B a slot (win) and 8 (stage: STAGE_FACTOR int32 a slot), 20 a bucket, two stats rows."""
    assert INSERT_SCRATCH_BYTES_PER_SLOT == 4
    assert INSERT_STAGE_BYTES_PER_SLOT == insert.STAGE_FACTOR * 4
    assert INSERT_SCRATCH_BYTES_PER_BUCKET == 4 + 8 + 8
    assert INSERT_SCRATCH_BYTES_PER_TABLE == 2 * insert.ST_LEN * 8
    on_device = insert_scratch_bytes(1024, 8, RowArrays.DEVICE)
    assert on_device == 1024 * 12 + 8 * 20 + 256
    assert on_device - insert_scratch_bytes(1024, 8, RowArrays.HOST) == 1024 * 8


def test_a_config_factor_below_one_plans_caching(seed_fs: FeatureSet) -> None:
    tables = [_with_factor(t, 0.1) if t.name == "brand_emb" else t for t in seed_fs.dynamic_tables]
    plans = {p.table: p for p in plan_placement(tables, hbm_budget=None)}
    assert plans["brand_emb"].mode is StorageMode.CACHING
    assert plans["brand_emb"].host_bytes == plans["brand_emb"].value_bytes
    assert {p.mode for n, p in plans.items() if n != "brand_emb"} == {StorageMode.HBM_ONLY}
