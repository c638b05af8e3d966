"""shared.hashtable.layout's row arrays (RowArrays): HOST changes where ``row_key``, ``row_tid``
and ``row_score`` live, never what a storage computes.

On the CPU both places are plain memory: a CACHING storage with its row arrays on the host equals
one with them on the device bit for bit, step by step (lookups, Adagrad, inserts that evict,
growth, export; the eager step and the static one). On CUDA (``gpu``) the host arrays are
page-locked host memory mapped into the device: the same scripts (the static step captured in
CUDA graphs), the pointers' memory types and the allocator's bytes checked.
"""

from __future__ import annotations

import pytest
import torch

from shared.features import LfuDecaySpec, ScoreStrategy
from shared.hashtable import host_memory
from shared.hashtable.cuda import insert
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.layout import RowArrays
from shared.hashtable.table import HashTable

from .conftest import NEEDS_CUDA_KERNELS
from .test_placement import planned_storage, table_bytes
from .test_row_cache import _assert_equal, _run, _tables, assert_close_on_cuda
from .test_row_cache_static import _static_dec, _static_run

HOST = {"a_emb": RowArrays.HOST}  # one member of the fused storage asks: the storage takes it


def _dec(
    row_arrays: dict[str, RowArrays], device: str = "cpu", factor: float | None = 0.05
) -> DynamicEmbeddingCollection:
    clock = iter(range(1000, 10**6, 7))
    return DynamicEmbeddingCollection(
        _tables(ScoreStrategy.STEP, factor), {"g": ["a_emb", "b_emb"]}, lr=0.03,
        initial_accumulator_value=0.1, device=device, clock=lambda: next(clock),
        row_arrays=row_arrays,
    )  # fmt: skip


def test_host_row_arrays_equal_device_ones_step_by_step_on_the_cpu() -> None:
    device, host = _dec({}), _dec(HOST)
    assert device._storages[0].table.row_arrays is RowArrays.DEVICE
    assert host._storages[0].table.row_arrays is RowArrays.HOST
    assert "row_arrays=HOST" in repr(host._storages[0].table)
    for o1, o2 in zip(_run(device), _run(host), strict=True):
        for t in o1:
            assert torch.equal(o1[t], o2[t]), t
    _assert_equal(device, host)
    assert device.tier_stats() == host.tier_stats()
    table = host._storages[0].table
    assert table.generation > 0  # the script grows the table
    assert host.stats()["a_emb"]["evictions"] > 0  # and evicts keys at its max capacity
    assert host.tier_stats()["g"]["cache_evictions"] > 0  # and cache lines


def test_a_copy_of_a_table_keeps_its_row_arrays_place() -> None:
    t = HashTable(4, init_capacity=64, max_capacity=64, row_arrays=RowArrays.HOST)
    t.insert_or_assign(torch.arange(10), torch.ones(10, 4), torch.zeros(10, dtype=torch.int64))
    copy = t.to("cpu")
    assert copy.row_arrays is RowArrays.HOST and copy._row_key is not t._row_key
    assert torch.equal(copy.find(torch.arange(10))[0], t.find(torch.arange(10))[0])


def test_host_row_arrays_are_refused_for_an_hbm_only_storage() -> None:
    with pytest.raises(ValueError, match="row_arrays HOST is for CACHING storages") as e:
        _dec(HOST, factor=None)
    assert "give one a cache_load_factor below 1, or keep its row arrays on the device" in str(e)


def test_row_arrays_of_a_table_that_is_not_here_are_refused() -> None:
    with pytest.raises(ValueError, match=r"row_arrays name tables \['x_emb'\]"):
        _dec({"x_emb": RowArrays.HOST})


def _memory_type(t: torch.Tensor) -> int:
    """cudaPointerGetAttributes' type of ``t``'s memory: 1 host (registered), 2 device."""
    import cupy

    return int(cupy.cuda.runtime.pointerGetAttributes(t.data_ptr()).type)


def _allocated(row_arrays: RowArrays) -> tuple[int, HashTable]:
    """(the allocator's bytes a CUDA table of 65,536 slots takes, the table)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    t = HashTable(
        0, init_capacity=1 << 16, max_capacity=1 << 16, device="cuda", row_arrays=row_arrays
    )
    return torch.cuda.memory_allocated() - before, t


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
def test_on_cuda_host_row_arrays_are_mapped_host_memory_outside_the_allocator() -> None:
    _allocated(RowArrays.HOST)  # anything a first table allocates once
    on_device, _ = _allocated(RowArrays.DEVICE)
    on_host, t = _allocated(RowArrays.HOST)
    rows = (t._row_key, t._row_tid, t._row_score)
    assert all(a.is_cuda for a in rows)
    assert [_memory_type(a) for a in rows] == [1, 1, 1]  # cudaMemoryTypeHost
    assert _memory_type(t._slot_fp) == _memory_type(t._slot_row) == 2  # cudaMemoryTypeDevice
    # the allocator holds the slot part only: slot_fp, slot_row and the two bucket arrays
    slots = t._slot_fp.nbytes + t._slot_row.nbytes + t._sentinel.nbytes + t._bucket_count.nbytes
    assert on_host == slots and on_device - on_host == (1 << 16) * (8 + 4 + 8)
    copy = t.to("cuda")  # a copy keeps its row arrays on the host
    assert _memory_type(copy._row_key) == 1 and torch.equal(copy._row_key, t._row_key)
    # the insert kernels' scratch: win on the device (4 B a slot), stage with the row arrays
    assert insert.scratch_bytes(t) == 0
    keys = torch.arange(1000, device="cuda")
    t.insert_or_assign(keys, torch.zeros(1000, 0, device="cuda"), torch.zeros_like(keys))
    assert t.size == 1000 and (1 << 16) * 4 <= insert.scratch_bytes(t) < (1 << 16) * 5
    assert _memory_type(insert._scratch[t].stage) == 1


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("row_arrays", list(RowArrays), ids=[r.value for r in RowArrays])
def test_on_cuda_the_plan_counts_the_insert_kernels_scratch(row_arrays: RowArrays) -> None:
    """The planner's insert scratch (``TablePlacement.insert_scratch_bytes`` on the device,
    ``host_parts()["insert_stage"]`` on the host; the counter's in ``counter_bytes``) is what the
    CUDA insert kernels keep with a CACHING storage's table and its admission counter after a
    first insert, their batch-sized ``rep_of`` aside."""
    plan, s = planned_storage(row_arrays, "cuda")
    table, counter = s.table, s.counter
    assert counter is not None and table.row_arrays is row_arrays
    assert insert.scratch_bytes(table) == insert.scratch_bytes(counter.table) == 0
    keys = torch.arange(1000, device="cuda")
    table.insert_or_assign(
        keys, torch.zeros(1000, table.dim, device="cuda"), torch.zeros_like(keys)
    )
    counter.add(keys, torch.ones_like(keys))
    assert table.size == counter.size == 1000  # no bucket full (the torch backend's too)

    def on_device(t: HashTable) -> int:
        return insert.scratch_bytes(t) - insert._scratch[t].rep_of.nbytes

    assert on_device(table) == plan.insert_scratch_bytes
    assert insert.stage_host_bytes(table) == plan.host_parts()["insert_stage"]
    hosted = row_arrays is RowArrays.HOST
    assert _memory_type(insert._scratch[table].stage) == (1 if hosted else 2)
    c = counter.table
    assert plan.counter_bytes == table_bytes(c) + on_device(c) and insert.stage_host_bytes(c) == 0


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("memory", ["register", "driver"])
def test_on_cuda_host_row_arrays_change_no_result(memory: str) -> None:
    """``driver``: the row arrays (and the host tier) in the CUDA driver's memory
    (shared.hashtable.host_memory), the table grown into new such memory."""
    with host_memory.using(memory):
        device, host = _dec({}, "cuda"), _dec(HOST, "cuda")
        t = host._storages[0].table
        assert t.row_arrays is RowArrays.HOST
        assert_close_on_cuda(_run(device), _run(host, prefetch=True), device, host)
    assert t.generation > 0 and host.stats()["a_emb"]["evictions"] > 0  # grown, evicted
    rows = (t._row_key, t._row_tid, t._row_score)
    assert all(a.is_cuda for a in rows)
    if memory == "register":
        assert [_memory_type(a) for a in rows] == [1, 1, 1]  # cudaMemoryTypeHost


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA_KERNELS])]
)
def test_the_static_step_with_host_row_arrays_equals_it_with_device_ones(device: str) -> None:
    """The static sparse step (captured in CUDA graphs on CUDA) of a 640-line cache under LFU
    with decay (an in-place shift of the host score array), step by step: bit for bit on the
    CPU, within the CUDA tests' tolerances on CUDA."""
    decay = LfuDecaySpec(interval_steps=2)
    on_device = _static_dec(ScoreStrategy.LFU, 0.3125, device, lfu_decay=decay)
    host = _static_dec(ScoreStrategy.LFU, 0.3125, device, lfu_decay=decay, row_arrays=HOST)
    assert host._storages[0].table.row_arrays is RowArrays.HOST
    _static_run([on_device, host], range(1, 13), exact=device == "cpu")
    ran = host.static_stats()["g"]
    assert ran == on_device.static_stats()["g"]
    assert ran["eager" if device == "cpu" else "replays"] == 12, ran
    assert host.stats()["a_emb"]["evictions"] > 0
