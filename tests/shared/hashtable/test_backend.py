"""Backends: chosen once per table (backend_for, or passed), shown in repr, kept by copies;
the torch backend's operations that have no table (expand_rows)."""

from __future__ import annotations

import copy

import pytest
import torch

from shared.features import InitializerSpec, InitMode
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.admission import FrequencyCounter
from shared.hashtable.backend import TORCH, backend_for
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.cuda import unavailable_reason
from shared.hashtable.cuda.backend import CudaBackend
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.initializers import KeyedInitializer
from shared.hashtable.layout import InsertResult, TableLayout
from shared.hashtable.storage import FusedStorage
from shared.hashtable.table import HashTable
from shared.hashtable.torch_backend import TorchBackend

from .conftest import dyn_table


class CountingBackend(TorchBackend):
    """The torch backend, counting the operations that reach it."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def find(
        self, t: TableLayout, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append("find")
        return super().find(t, keys, table_ids)

    def insert_or_assign(self, t: TableLayout, *args, **kwargs) -> InsertResult:
        self.calls.append("insert")
        return super().insert_or_assign(t, *args, **kwargs)

    def unique_pairs(self, keys, table_ids, *, reject_negative=False):
        self.calls.append("unique")
        return super().unique_pairs(keys, table_ids, reject_negative=reject_negative)


class CpuRefusing(TorchBackend):
    name = "gpu-only"

    def accepts(self, device: torch.device) -> bool:
        return device.type != "cpu"


def _table(**kw) -> HashTable:
    return HashTable(2, init_capacity=64, max_capacity=1024, bucket_capacity=16, **kw)


def test_cpu_tables_get_the_torch_backend_and_show_it():
    assert backend_for("cpu") is TORCH
    t = _table()
    assert t.backend is TORCH
    assert repr(t).endswith("device=cpu, backend=torch)")
    built = HashTable.from_keys_values(torch.tensor([3, 1]), torch.ones(2, 2))
    assert built.backend is TORCH


@pytest.mark.skipif(unavailable_reason() is None, reason="CUDA and CuPy are here")
def test_without_the_kernels_cuda_asks_for_the_torch_backend():
    assert backend_for("cuda") is TORCH
    with pytest.raises(RuntimeError, match="cannot run here"):
        CudaBackend()


@pytest.mark.gpu
@pytest.mark.skipif(unavailable_reason() is not None, reason="needs CUDA and CuPy")
def test_the_cuda_backend_compiles_every_kernel_module_when_chosen():
    for cache in (rt._function, rt._source_module, rt._module):  # earlier tests compiled
        cache.cache_clear()
    assert isinstance(backend_for("cuda"), CudaBackend)
    index = torch.cuda.current_device()
    compiled = rt._source_module.cache_info().currsize  # compile_modules filled the caches
    assert rt._module.cache_info().currsize == 1 and compiled == 3
    _table(device="cuda").insert_or_assign(
        torch.tensor([5], device="cuda"),
        torch.ones(1, 2, device="cuda"),
        torch.zeros(1, device="cuda"),
    )
    assert rt._source_module.cache_info().currsize == compiled, f"device {index}: compiled late"


def test_a_passed_backend_runs_every_operation():
    b = CountingBackend()
    t = _table(backend=b)
    t.insert_or_assign(torch.tensor([5, 6]), torch.ones(2, 2), torch.zeros(2))
    rows, found = t.find(torch.tensor([5, 7]))
    assert found.tolist() == [True, False] and b.calls == ["insert", "find"]
    assert "backend=counting" in repr(t)


def test_a_backend_refusing_the_device_is_an_error():
    with pytest.raises(ValueError, match="'gpu-only' backend cannot run a table on cpu"):
        _table(backend=CpuRefusing())


def test_copies_keep_the_backend_and_to_chooses_one():
    b = CountingBackend()
    t = _table(backend=b)
    t.insert_or_assign(torch.tensor([5, 6]), torch.ones(2, 2), torch.zeros(2))
    assert copy.deepcopy(t).backend is b  # a backend is shared, never copied
    moved = t.to("cpu")
    assert moved.backend is TORCH and t.backend is b
    assert moved.values.data_ptr() != t.values.data_ptr()  # a copy, also on the same device
    moved.insert_or_assign(torch.tensor([7]), torch.ones(1, 2), torch.zeros(1))
    assert (moved.size, t.size) == (3, 2)
    assert torch.equal(moved.find(torch.tensor([5, 6]))[0], t.find(torch.tensor([5, 6]))[0])
    assert t.to("cpu", backend=b).backend is b


def test_storages_give_their_backend_to_the_counter_and_the_new_rows():
    b = CountingBackend()
    specs = [dyn_table("a_emb", threshold=2), dyn_table("b_emb")]
    s = FusedStorage(
        "g", specs, adagrad=AdagradConfig(lr=0.1), seed=0, device=torch.device("cpu"), backend=b
    )
    assert s.backend is b and s.table.backend is b
    assert s.counter is not None and s.counter.table.backend is b
    assert (
        repr(s)
        == "FusedStorage('g', tables=['a_emb', 'b_emb'], capacity=128, backend=counting, payload=HBM_ONLY)"
    )
    assert FrequencyCounter(64, 16, backend=b).table.backend is b


def test_the_collection_passes_its_backend_to_every_storage():
    b = CountingBackend()
    dec = DynamicEmbeddingCollection(
        [dyn_table("a_emb"), dyn_table("b_emb", dim=8)], {}, lr=0.1, backend=b
    )
    dec({"a_emb": torch.tensor([1, 2]), "b_emb": torch.tensor([3])})
    assert b.calls.count("find") == 2 and b.calls.count("insert") == 2
    assert b.calls.count("unique") == 2  # each storage deduplicates its keys through it
    assert repr(dec).count("backend=counting") == 2
    plain = DynamicEmbeddingCollection([dyn_table("a_emb")], {}, lr=0.1)
    assert "backend=torch" in repr(plain)


def test_expand_rows_gives_each_occurrence_its_runs_row():
    """TorchBackend.expand_rows: per occurrence, its run's stored row or the new row of the
    run's (key, initializer), and whether the run has a row: the gathers it composes."""
    g = torch.Generator().manual_seed(0)
    specs = [
        InitializerSpec(InitMode.NORMAL, std_dev=0.1),
        InitializerSpec(InitMode.UNIFORM, lower=-1.0, upper=2.0),
        InitializerSpec(InitMode.TRUNCATED_NORMAL, std_dev=1.0, lower=-0.5, upper=0.5),
        InitializerSpec(InitMode.CONSTANT, value=0.25),
    ]
    inits = [KeyedInitializer(s, seed=1, table=f"t{i}") for i, s in enumerate(specs)]
    new_rows = TORCH.keyed_rows(inits, torch.device("cpu"))
    dim = 5
    values = torch.randn(50, dim, generator=g)
    rows = torch.tensor([3, -1, 0, -1, 49, -1])  # per run
    keys = torch.tensor([10, 11, 12, 13, 14, 2**62])
    which = torch.tensor([0, 1, 2, 3, 0, 0])
    inverse = torch.tensor([1, 0, 5, 1, 2, 3, 3, 4, 1])  # per occurrence, with repeats
    out, stored = TORCH.expand_rows(values, rows, inverse, keys, which, new_rows)
    assert out.shape == (9, dim) and out.dtype == torch.float32
    assert stored.tolist() == [False, True, False, False, True, False, False, True, False]
    for i, run in enumerate(inverse.tolist()):
        r = int(rows[run])
        one = new_rows(keys[run : run + 1], which[run : run + 1], dim)[0]
        assert torch.equal(out[i], values[r] if r >= 0 else one), i
    per_run = torch.where(
        (rows >= 0)[:, None], values[rows.clamp(min=0)], new_rows(keys, which, dim)
    )
    assert torch.equal(out, per_run.index_select(0, inverse))
    out, stored = TORCH.expand_rows(values, rows, inverse[:0], keys, which, new_rows)
    assert out.shape == (0, dim) and stored.shape == (0,) and stored.dtype == torch.bool
