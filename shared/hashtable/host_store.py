"""The host tier of a CACHING storage: every row's payload (values and Adagrad state), by row id.

A CACHING storage (:mod:`shared.hashtable.row_cache`) keeps its hash index on the device and an
HBM cache of hot rows; the payload of *every* row lives here. A row id is the table's row (slot):
the store is as long as the table's capacity and is permuted when the table grows (rows move
then). One row's payload is ``values | accumulators`` packed, ``[2 * dim]`` float32, so that one
gather brings both.

:class:`HostStore` is the seam, as dynamicemb's ``Storage`` (``dynamicemb/types.py``:
find / insert / dump / load) is for its ``external_storage``: four operations on row ids.
:class:`TensorHostStore` is the one implementation: a torch tensor in pinned memory on CUDA (so
the packed miss list goes to the device in one asynchronous copy) and plain memory on CPU.

How an external store takes its place: a class with the same four methods over a key-value
store (RocksDB, a Redis cluster), keyed by row id or, better for a store shared between
processes, by ``(table id, key)``, which the caller can read from the index for the rows it
passes. ``read`` becomes a multi-get of the packed miss list, ``write`` a multi-put (the cache
writes back only dirty evicted lines and flushes before a checkpoint), and ``permute`` a no-op for
a store keyed by ``(table id, key)``, since growth moves rows but not keys. Checkpoints dump and
load through ``read`` / ``write`` of the live rows (:meth:`RowCache.export`), so a store needs no
format of its own.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch


class HostStore(Protocol):
    """Every row's packed payload ``[2 * dim]`` float32 (values, then accumulators), by row id."""

    @property
    def capacity(self) -> int:
        """Rows held (the table's capacity)."""
        ...

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, 2 * dim]`` on the host (pinned where the store is): the payload of ``rows`` [n]
        int64 (any device), gathered in one vectorized read of the packed list."""
        ...

    def write(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        """Store ``payload`` [n, 2 * dim] (any device) at distinct ``rows`` [n] in one scatter."""
        ...

    def permute(self, capacity: int, old_rows: torch.Tensor, new_rows: torch.Tensor) -> None:
        """The table grew to ``capacity`` rows and row ``old_rows[i]`` is now ``new_rows[i]``
        (rows not listed left the table: their payload is dropped)."""
        ...


class TensorHostStore:
    """:class:`HostStore` over one ``[capacity, 2 * dim]`` float32 tensor, pinned when
    ``pin`` (a CUDA storage's store; needs a CUDA runtime).

    >>> store = TensorHostStore(4, capacity=8, pin=False)
    >>> store.write(torch.tensor([3]), torch.ones(1, 8))
    >>> store.read(torch.tensor([3, 0])).sum().item()
    8.0
    """

    def __init__(self, dim: int, *, capacity: int, pin: bool) -> None:
        self.dim = dim
        self.pin = pin
        self._rows = self._empty(capacity)

    def _empty(self, capacity: int) -> torch.Tensor:
        """[capacity, 2 * dim] zeros; with ``pin`` page-locked in place (``cudaHostRegister``),
        not from torch's pinned allocator, which keeps a freed block cached (a store replaced on
        growth, or a storage dropped, would hold its host memory) and may round a block up to a
        power of two."""
        rows = torch.zeros(capacity, 2 * self.dim, dtype=torch.float32)
        if self.pin and rows.numel():
            _register(rows)
        return rows

    def __repr__(self) -> str:
        return f"TensorHostStore(dim={self.dim}, capacity={self.capacity}, pinned={self.pin})"

    @property
    def capacity(self) -> int:
        return self._rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self._rows.numel() * self._rows.element_size()

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        idx = rows.to("cpu", torch.int64)
        if not self.pin:
            return self._rows.index_select(0, idx)  # [n, 2 * dim]
        out = torch.empty(idx.numel(), 2 * self.dim, dtype=torch.float32, pin_memory=True)
        return torch.index_select(self._rows, 0, idx, out=out)

    def write(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        self._rows.index_copy_(0, rows.to("cpu", torch.int64), payload.to("cpu"))

    def permute(self, capacity: int, old_rows: torch.Tensor, new_rows: torch.Tensor) -> None:
        moved = self._empty(capacity)
        moved.index_copy_(
            0, new_rows.to("cpu", torch.int64), self.read(old_rows)
        )  # [moved rows, 2 * dim]
        self._rows = moved


def _register(rows: torch.Tensor) -> None:
    """Page-lock ``rows``' memory for the device's asynchronous copies, unlocked when ``rows``
    is freed."""
    cudart = torch.cuda.cudart()
    ptr = rows.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, rows.nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(
            f"TensorHostStore: page-locking {rows.nbytes / 2**30:.1f} GiB of host memory failed "
            f"(cudaError {err}): lower the CACHING tables' max_capacity or free host memory"
        )
    weakref.finalize(rows, cudart.cudaHostUnregister, ptr)
