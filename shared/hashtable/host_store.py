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
        self.width = 2 * dim  # float32s a row: values, then accumulators
        self.mapped = False
        self._rows = self._empty(capacity)

    @classmethod
    def holding(cls, rows: torch.Tensor, *, pin: bool, mapped: bool = False) -> TensorHostStore:
        """A store over ``rows`` [capacity, width] float32 as they are (no copy): serving's host
        tier, whose rows are the bundle's values only (width = dim, nothing to update), read-only
        between versions. With ``pin`` page-locked in place; with ``mapped`` also mapped into
        the device's address space (``cudaHostRegisterMapped``), so that a kernel reads rows
        through :meth:`device_pointer` (UVA) inside a CUDA graph, with no copy launched."""
        if rows.dtype != torch.float32 or rows.dim() != 2 or not rows.is_contiguous():
            raise ValueError(
                f"TensorHostStore.holding: rows must be contiguous float32 [capacity, width], got "
                f"{rows.dtype} {list(rows.shape)}"
            )
        store = cls.__new__(cls)
        store.dim = rows.shape[1]
        store.width = rows.shape[1]
        store.pin = pin
        store.mapped = pin and mapped
        store._rows = rows.cpu()
        if pin and rows.numel():
            _register(store._rows, mapped=mapped)
        return store

    @property
    def rows(self) -> torch.Tensor:
        """The rows [capacity, width] on the host (page-locked when :attr:`pin`)."""
        return self._rows

    def device_pointer(self) -> int:
        """The address a CUDA kernel reads the rows at (a :meth:`holding` store made with
        ``mapped``): the device pointer ``cudaPointerGetAttributes`` gives for the registered
        rows (the host address itself on devices that use host pointers for registered memory,
        as with UVA on 64-bit Linux)."""
        if not self.mapped:
            raise ValueError(
                "TensorHostStore.device_pointer: the store is not mapped (holding(mapped=True))"
            )
        if not self._rows.numel():
            return 0
        import cupy  # the CUDA kernels' runtime (shared.hashtable.cuda.runtime)

        attributes = cupy.cuda.runtime.pointerGetAttributes(self._rows.data_ptr())
        if not attributes.devicePointer:
            raise RuntimeError(
                "TensorHostStore.device_pointer: the page-locked rows have no device address "
                "(not mapped); the device cannot read host memory through UVA"
            )
        return int(attributes.devicePointer)

    def _empty(self, capacity: int) -> torch.Tensor:
        """[capacity, 2 * dim] zeros; with ``pin`` page-locked in place (``cudaHostRegister``),
        not from torch's pinned allocator, which keeps a freed block cached (a store replaced on
        growth, or a storage dropped, would hold its host memory) and may round a block up to a
        power of two."""
        rows = torch.zeros(capacity, self.width, dtype=torch.float32)
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
        out = torch.empty(idx.numel(), self.width, dtype=torch.float32, pin_memory=True)
        return torch.index_select(self._rows, 0, idx, out=out)

    def write(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        self._rows.index_copy_(0, rows.to("cpu", torch.int64), payload.to("cpu"))

    def permute(self, capacity: int, old_rows: torch.Tensor, new_rows: torch.Tensor) -> None:
        moved = self._empty(capacity)
        moved.index_copy_(
            0, new_rows.to("cpu", torch.int64), self.read(old_rows)
        )  # [moved rows, 2 * dim]
        self._rows = moved


def _register(rows: torch.Tensor, *, mapped: bool = False) -> None:
    """Page-lock ``rows``' memory for the device's asynchronous copies (and with ``mapped`` map
    it into the device's address space), unlocked when ``rows`` is freed."""
    cudart = torch.cuda.cudart()
    ptr = rows.data_ptr()
    flags = 1 | (2 if mapped else 0)  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = int(cudart.cudaHostRegister(ptr, rows.nbytes, flags))
    if err != 0:
        raise RuntimeError(
            f"TensorHostStore: page-locking {rows.nbytes / 2**30:.1f} GiB of host memory failed "
            f"(cudaError {err}): lower the CACHING tables' max_capacity or free host memory"
        )
    weakref.finalize(rows, cudart.cudaHostUnregister, ptr)
