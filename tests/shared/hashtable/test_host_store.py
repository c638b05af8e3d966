"""TensorHostStore: the host tier's rows by row id (read, write, permute on growth)."""

from __future__ import annotations

import pytest
import torch

from shared.hashtable import cuda
from shared.hashtable.host_store import HostStore, TensorHostStore, mapped_device_view


def _store(pin: bool = False) -> TensorHostStore:
    store = TensorHostStore(3, capacity=6, pin=pin)
    store.write(torch.arange(6), torch.arange(36, dtype=torch.float32).reshape(6, 6))
    return store


def test_read_gathers_the_packed_rows_and_write_scatters_them() -> None:
    store: HostStore = _store()
    assert store.capacity == 6
    got = store.read(torch.tensor([4, 0, 4]))
    assert got.shape == (3, 6) and got[:, 0].tolist() == [24.0, 0.0, 24.0]
    store.write(torch.tensor([1, 5]), torch.full((2, 6), -1.0))
    assert store.read(torch.tensor([1, 5])).eq(-1).all()
    assert store.read(torch.tensor([0]))[0, 0] == 0  # other rows untouched


def test_write_skips_negative_rows_and_mapped_rows_must_be_pinned() -> None:
    """A masked write-back passes -1 for the rows it does not write (no host read to select
    them); a store mapped into the device's address space is page-locked."""
    store = _store()
    store.write(torch.tensor([-1, 2, -1]), torch.full((3, 6), 7.0))
    assert store.read(torch.tensor([2])).eq(7).all()
    assert store.read(torch.tensor([1]))[0, 0] == 6  # others untouched
    with pytest.raises(ValueError, match="mapped rows must be pinned"):
        TensorHostStore(3, capacity=6, pin=False, mapped=True)


def test_swap_writes_back_then_reads_other_rows() -> None:
    """A cache's eviction pass: rows 1 and 4 written (-1: a clean line, nothing), rows 0, 2, 3
    read, as write then read."""
    store = _store()
    got = store.swap(torch.tensor([1, -1, 4]), torch.full((3, 6), -5.0), torch.tensor([0, 2, 3]))
    assert got[:, 0].tolist() == [0.0, 12.0, 18.0]
    assert store.read(torch.tensor([1, 4])).eq(-5).all()
    assert store.read(torch.tensor([5]))[0, 0] == 30  # the clean line's row untouched
    with pytest.raises(ValueError, match="as many of each"):
        store.swap(torch.tensor([1]), torch.zeros(1, 6), torch.tensor([0, 2]))


def test_permute_moves_rows_to_their_new_ids_and_drops_the_others() -> None:
    store = _store()
    before = store.read(torch.arange(6))
    store.permute(12, torch.tensor([0, 2, 5]), torch.tensor([11, 3, 0]))
    assert store.capacity == 12
    after = store.read(torch.tensor([11, 3, 0]))
    assert torch.equal(after, before[[0, 2, 5]])
    rest = [r for r in range(12) if r not in (11, 3, 0)]
    assert store.read(torch.tensor(rest)).eq(0).all()  # rows no key moved to: zeros


def test_store_reports_its_bytes_and_pinning() -> None:
    store = _store()
    assert store.nbytes == 6 * 6 * 4
    assert "capacity=6" in repr(store) and "pinned=False, mapped=False" in repr(store)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory")
def test_a_cuda_storage_store_is_pinned_and_takes_device_row_ids() -> None:
    store = _store(pin=True)
    assert store._rows.is_pinned()  # page-locked in place
    got = store.read(torch.tensor([2, 3], device="cuda"))
    assert got.is_pinned() and got[:, 0].tolist() == [12.0, 18.0]
    store.write(torch.tensor([2], device="cuda"), torch.zeros(1, 6, device="cuda"))
    assert store.read(torch.tensor([2])).eq(0).all()
    store.permute(9, torch.tensor([3], device="cuda"), torch.tensor([8], device="cuda"))
    assert store._rows.is_pinned() and store.read(torch.tensor([8]))[0, 0] == 18.0


def test_a_store_holding_rows_reads_them_without_a_copy() -> None:
    """Serving's host tier: the bundle's values [capacity, dim] as they are (no accumulators)."""
    rows = torch.arange(12, dtype=torch.float32).view(4, 3)
    store = TensorHostStore.holding(rows, pin=False)
    assert store.rows.data_ptr() == rows.data_ptr() and store.width == 3
    assert store.capacity == 4 and store.nbytes == 48
    assert torch.equal(store.read(torch.tensor([2, 0])), rows[[2, 0]])
    with pytest.raises(ValueError, match="not mapped"):
        store.device_pointer()
    with pytest.raises(ValueError, match="contiguous float32"):
        TensorHostStore.holding(rows.t(), pin=False)


def test_a_mapped_device_view_is_refused_off_cuda() -> None:
    with pytest.raises(ValueError, match="cpu is not a CUDA device"):
        mapped_device_view(torch.zeros(4), torch.device("cpu"))


@pytest.mark.skipif(cuda.unavailable_reason() is None, reason="the CUDA kernels can run here")
def test_a_mapped_device_view_without_the_cuda_kernels_says_why() -> None:
    with pytest.raises(RuntimeError, match="cannot be mapped into cuda here: ") as e:
        mapped_device_view(torch.zeros(4), torch.device("cuda"))
    assert str(cuda.unavailable_reason()) in str(e.value)
