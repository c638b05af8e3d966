"""shared.hashtable.host_memory: the choice of how a mapped host tier's memory is made, and the
CUDA driver's memory itself (on the device: the CPU and a UVA kernel see the same rows)."""

from __future__ import annotations

import gc

import pytest
import torch

from shared.hashtable import host_memory
from shared.hashtable.host_store import TensorHostStore

from .conftest import NEEDS_CUDA_KERNELS


def test_the_default_is_registered_memory_and_an_unknown_kind_is_refused() -> None:
    assert host_memory.default() == "register"
    with pytest.raises(ValueError, match="'huge' is not one of register, driver"):
        host_memory.use("huge")
    assert host_memory.default() == "register"


def test_a_store_in_driver_memory_needs_a_cuda_device() -> None:
    with host_memory.using("driver"):
        with pytest.raises(ValueError, match="made for a CUDA device, got device=cpu"):
            TensorHostStore(4, capacity=8, pin=True, mapped=True, device=torch.device("cpu"))
        plain = TensorHostStore(4, capacity=8, pin=False)  # not mapped: the choice is moot
        assert plain.memory == "register"
    assert host_memory.default() == "register"


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
def test_driver_memory_is_zeros_the_cpu_and_the_device_read_and_write_alike() -> None:
    """Rows written by the CPU are read by the UVA gather at the tensor's own address, rows
    scattered by the device are read by the CPU, and the store grows into new driver memory."""
    from shared.hashtable.cuda import host_rows

    device = torch.device("cuda")
    t = host_memory.driver_zeros(1000, 8, device)
    assert t.device.type == "cpu" and t.shape == (1000, 8) and float(t.abs().sum()) == 0.0
    t[:, 0] = torch.arange(1000, dtype=torch.float32)
    ids = torch.tensor([5, 999, 0, 17], device=device)
    out = torch.empty(4, 8, device=device)
    host_rows.gather(t.data_ptr(), ids, out)
    assert out[:, 0].tolist() == [5.0, 999.0, 0.0, 17.0]
    host_rows.scatter(t.data_ptr(), ids[:2], torch.full((2, 8), -1.0, device=device))
    torch.cuda.synchronize()
    assert t[5].tolist() == [-1.0] * 8 and t[999].tolist() == [-1.0] * 8
    del t, out
    gc.collect()  # freed with its storage (after the device's work)

    with host_memory.using("driver"):
        store = TensorHostStore(4, capacity=16, pin=True, mapped=True, device=device)
    assert store.memory == "driver" and store.device_pointer() == store.rows.data_ptr()
    rows = torch.arange(16, device=device)
    store.write(rows, torch.arange(128, dtype=torch.float32, device=device).view(16, 8))
    store.permute(32, rows, rows + 16)  # growth: rows move on the device into new memory
    assert store.capacity == 32 and store.memory == "driver"
    assert store.rows[16:, 0].tolist() == [8.0 * i for i in range(16)]
