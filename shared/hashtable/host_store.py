"""The host tier of a CACHING storage: every row's payload (values and Adagrad state), by row id.

A CACHING storage (:mod:`shared.hashtable.row_cache`) keeps its hash index on the device and an
HBM cache of hot rows; the payload of *every* row lives here. A row id is the table's row (slot):
the store is as long as the table's capacity and is permuted when the table grows (rows move
then). One row's payload is ``values | accumulators`` packed, ``[2 * dim]`` float32, so that one
gather brings both.

:class:`HostStore` is the seam, as dynamicemb's ``Storage`` (``dynamicemb/types.py``:
find / insert / dump / load) is for its ``external_storage``: four operations on row ids.
:class:`TensorHostStore` is the one implementation: a torch tensor in plain memory on CPU and,
for a CUDA storage, page-locked and mapped into the device's address space (``mapped``): then
``read`` and ``write`` of row ids on the device are one kernel each
(:mod:`shared.hashtable.cuda.host_rows`) that moves the rows over PCIe through UVA, on torch's
current stream, with no host read. Before that (issue #52's first H100 run) they moved the row
ids to the host (a sync) and gathered ~100K rows a step with one CPU thread; that path stays
for a pinned store that is not mapped (no CUDA kernels here) and for row ids on the CPU. Device
writes land in host memory asynchronously, so every CPU-side access of the rows (a read or
write of CPU row ids, :attr:`~TensorHostStore.rows`, growth) first waits for the device.

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
from typing import Any, Protocol

import torch

from shared.hashtable import host_memory

MOVE_BYTES = 256 << 20  # the device buffer of a growth's row moves (TensorHostStore.permute)


class HostStore(Protocol):
    """Every row's packed payload ``[2 * dim]`` float32 (values, then accumulators), by row id."""

    @property
    def capacity(self) -> int:
        """Rows held (the table's capacity)."""
        ...

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, 2 * dim]``: the payload of ``rows`` [n] int64 (any device; zeros for rows < 0,
        a fixed-size read's unused slots), gathered in one vectorized read of the packed list,
        on the rows' device where the store can reach it from there (else on the host, pinned
        where the store is: the caller copies)."""
        ...

    def write(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        """Store ``payload`` [n, 2 * dim] (on the rows' device, or any) at ``rows`` [n] in one
        scatter; rows < 0 are skipped (a masked write-back needs no host read of which rows),
        the others distinct."""
        ...

    def swap(
        self, write_rows: torch.Tensor, payload: torch.Tensor, read_rows: torch.Tensor
    ) -> torch.Tensor:
        """``write(write_rows, payload)``, then ``read(read_rows)`` (as many rows each, read
        rows < 0 read as zeros, none of them among the rows written): a cache's write-back of its evicted
        lines and the read of the rows that take them, in one pass where the store can overlap
        the two."""
        ...

    def permute(self, capacity: int, old_rows: torch.Tensor, new_rows: torch.Tensor) -> None:
        """The table grew to ``capacity`` rows and row ``old_rows[i]`` is now ``new_rows[i]``
        (rows not listed left the table: their payload is dropped)."""
        ...

    def why_not_static(self, device: torch.device) -> str | None:
        """Why ``read``, ``write`` and ``swap`` of row ids on ``device`` would read the device
        on the host (and so cannot run in a captured CUDA graph); None where they need no host
        read (the static training step can take them; every call on the CPU)."""
        ...

    def used_by_device(self, device: torch.device) -> None:
        """Work queued on ``device`` outside this store's own calls (a CUDA graph replaying a
        captured ``swap``) reads and writes the rows: a CPU-side access waits for it first."""
        ...


class TensorHostStore:
    """:class:`HostStore` over one ``[capacity, 2 * dim]`` float32 tensor, pinned when
    ``pin`` (a CUDA storage's store; needs a CUDA runtime) and with ``mapped`` also mapped into
    the device's address space, so that row ids on the device are read and written there by
    :mod:`shared.hashtable.cuda.host_rows` kernels (needs the CUDA kernels' runtime, CuPy).

    >>> store = TensorHostStore(4, capacity=8, pin=False)
    >>> store.write(torch.tensor([3]), torch.ones(1, 8))
    >>> store.read(torch.tensor([3, 0])).sum().item()
    8.0
    """

    memory = "register"  # how mapped rows are made (shared.hashtable.host_memory)
    device: torch.device | None = None  # the device that maps ``driver`` memory
    # the end of the latest writes to the rows on a stream of their own (written_beside)
    _beside: Any = None

    def __init__(
        self,
        dim: int,
        *,
        capacity: int,
        pin: bool,
        mapped: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if mapped and not pin:
            raise ValueError("TensorHostStore: mapped rows must be pinned (pass pin=True)")
        self.dim = dim
        self.pin = pin
        self.width = 2 * dim  # float32s a row: values, then accumulators
        self.mapped = mapped
        if mapped and host_memory.default() == "driver":
            if device is None or device.type != "cuda":
                raise ValueError(
                    f"TensorHostStore: driver host memory is made for a CUDA device, got "
                    f"device={device}"
                )
            self.memory, self.device = "driver", device
        self._pending: torch.device | None = None  # a device whose kernels may use the rows
        self._set_rows(self._empty(capacity))

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
        store._pending = None
        store._set_rows(rows.cpu())
        if pin and rows.numel():
            _register(store._rows, mapped=mapped)
        return store

    def _set_rows(self, rows: torch.Tensor) -> None:
        """Hold ``rows`` from now on (a new tensor on growth: its device address is another)."""
        self._rows = rows
        self._pointer: int | None = None

    @property
    def rows(self) -> torch.Tensor:
        """The rows [capacity, width] on the host (page-locked when :attr:`pin`), with every
        device write queued so far landed."""
        self._wait()
        return self._rows

    @property
    def address(self) -> int:
        """The rows' host address, without waiting for the device (:attr:`rows` waits): it
        changes only when the rows move (growth)."""
        return int(self._rows.data_ptr())

    def device_pointer(self) -> int:
        """The address a CUDA kernel reads the rows at (a store made with ``mapped``; another
        one after growth, which replaces the rows): the device pointer
        ``cudaPointerGetAttributes`` gives for the registered rows (the host address itself on
        devices that use host pointers for registered memory, as with UVA on 64-bit Linux)."""
        if not self.mapped:
            raise ValueError(
                "TensorHostStore.device_pointer: the store is not mapped (make it with mapped=True)"
            )
        if self._pointer is None:
            if self.memory == "driver":  # mapped at one address for the device and the CPU
                self._pointer = self._rows.data_ptr()
            else:
                self._pointer = _device_pointer(self._rows) if self._rows.numel() else 0
        return self._pointer

    def _empty(self, capacity: int) -> torch.Tensor:
        """[capacity, 2 * dim] zeros; with ``pin`` page-locked in place (``cudaHostRegister``),
        not from torch's pinned allocator, which keeps a freed block cached (a store replaced on
        growth, or a storage dropped, would hold its host memory) and may round a block up to a
        power of two. ``driver`` memory is the CUDA driver's (:mod:`~shared.hashtable.host_memory`)."""
        if self.memory == "driver" and self.device is not None and capacity:
            return host_memory.driver_zeros(capacity, self.width, self.device)
        rows = torch.zeros(capacity, self.width, dtype=torch.float32)
        if self.pin and rows.numel():
            _register(rows, mapped=self.mapped, drain=self.mapped)
        return rows

    def __repr__(self) -> str:
        return (
            f"TensorHostStore(dim={self.dim}, capacity={self.capacity}, pinned={self.pin}, "
            f"mapped={self.mapped}, memory={self.memory})"
        )

    @property
    def capacity(self) -> int:
        return self._rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self._rows.numel() * self._rows.element_size()

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        if self._on_device(rows):
            from shared.hashtable.cuda import host_rows

            self.join_writes(rows.device)
            out = torch.empty(rows.numel(), self.width, dtype=torch.float32, device=rows.device)
            host_rows.gather(self.device_pointer(), rows.to(torch.int64).contiguous(), out)
            self._pending = rows.device
            return out  # [n, 2 * dim] on the rows' device
        self._wait()
        idx = rows.to("cpu", torch.int64)
        unused = idx < 0  # zeros there, as the device kernel reads them
        some_unused = bool(unused.any())  # on the host already: no sync
        if some_unused:
            idx = idx.clamp(min=0)
        if not self.pin:
            out = self._rows.index_select(0, idx)  # [n, 2 * dim]
        else:
            out = torch.empty(idx.numel(), self.width, dtype=torch.float32, pin_memory=True)
            torch.index_select(self._rows, 0, idx, out=out)
        if some_unused:
            out.masked_fill_(unused.unsqueeze(1), 0.0)
        return out

    def write(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        if self._on_device(rows):
            from shared.hashtable.cuda import host_rows

            self.join_writes(rows.device)
            payload = payload.to(rows.device, torch.float32).contiguous()  # [n, 2 * dim]
            host_rows.scatter(self.device_pointer(), rows.to(torch.int64).contiguous(), payload)
            self._pending = rows.device
            return
        self._wait()
        idx, payload = rows.to("cpu", torch.int64), payload.to("cpu")
        kept = idx >= 0
        if not bool(kept.all()):
            idx, payload = idx[kept], payload[kept]
        self._rows.index_copy_(0, idx, payload)

    def swap(
        self, write_rows: torch.Tensor, payload: torch.Tensor, read_rows: torch.Tensor
    ) -> torch.Tensor:
        if write_rows.numel() != read_rows.numel():
            raise ValueError(
                f"TensorHostStore.swap: {write_rows.numel()} rows to write and "
                f"{read_rows.numel()} to read; pass as many of each (-1 writes nothing)"
            )
        if not (self._on_device(write_rows) and self._on_device(read_rows)):
            self.write(write_rows, payload)
            return self.read(read_rows)
        from shared.hashtable.cuda import host_rows

        self.join_writes(read_rows.device)
        out = payload.to(read_rows.device, torch.float32).contiguous()  # [n, 2 * dim]
        into = torch.empty_like(out)  # [n, 2 * dim]
        host_rows.swap(
            self.device_pointer(),
            write_rows.to(torch.int64).contiguous(),
            out,
            read_rows.to(torch.int64).contiguous(),
            into,
        )
        self._pending = read_rows.device
        return into

    def permute(self, capacity: int, old_rows: torch.Tensor, new_rows: torch.Tensor) -> None:
        moved = self._empty(capacity)
        if self._on_device(old_rows):
            self._move_on_device(moved, old_rows, new_rows)
            return
        moved.index_copy_(
            0, new_rows.to("cpu", torch.int64), self.read(old_rows)
        )  # [moved rows, 2 * dim]
        self._set_rows(moved)

    def _move_on_device(
        self, moved: torch.Tensor, old_rows: torch.Tensor, new_rows: torch.Tensor
    ) -> None:
        """:meth:`permute` by the device: rows from the current host rows to ``moved`` (mapped)
        through a device buffer of at most :data:`MOVE_BYTES` (a table larger than the device
        grows too), then ``moved`` held."""
        from shared.hashtable.cuda import host_rows

        dev = old_rows.device
        self.join_writes(dev)
        src, dst = self.device_pointer(), 0
        if moved.numel():  # the driver's memory is at one address for the device and the CPU
            dst = moved.data_ptr() if self.memory == "driver" else _device_pointer(moved)
        old_rows = old_rows.to(torch.int64).contiguous()
        new_rows = new_rows.to(dev, torch.int64).contiguous()
        n, chunk = old_rows.numel(), max(1, MOVE_BYTES // (4 * self.width))
        buf = torch.empty(min(n, chunk), self.width, dtype=torch.float32, device=dev)
        for a in range(0, n, chunk):
            part = buf[: min(n - a, chunk)]  # [rows of this chunk, 2 * dim]
            host_rows.gather(src, old_rows[a : a + chunk], part)
            host_rows.scatter(dst, new_rows[a : a + chunk], part)
        self._pending = dev
        self._wait()  # the old rows are read (they are freed with them) and the new written
        self._set_rows(moved)
        self._pointer = dst

    def why_not_static(self, device: torch.device) -> str | None:
        if device.type != "cuda" or self.mapped:
            return None
        return (
            "its host rows are not mapped into the device's address space (the CUDA kernels "
            "cannot run here: shared.hashtable.cuda.unavailable_reason() says why), so row ids "
            "would go to the host; install CuPy with a CUDA runtime to map them"
        )

    def used_by_device(self, device: torch.device) -> None:
        if self.mapped and device.type == "cuda":
            self.device_pointer()  # looked up now, outside the capture that will launch on it
            self._pending = device

    def written_beside(self, done: Any, device: torch.device) -> None:
        """Kernels on a stream of their own write the rows until CUDA event ``done`` (a static
        cache's staged write-backs, :mod:`shared.hashtable.write_back_beside`): this store's
        device calls wait for it on their stream (:meth:`join_writes`), its CPU-side accesses
        for the whole device."""
        self._beside = done
        self._pending = device

    def join_writes(self, device: torch.device) -> None:
        """The current stream of ``device`` waits for the rows' writes on another stream
        (:meth:`written_beside`), on the host and outside any capture: before a graph or a
        kernel that reads or writes the rows is queued there."""
        if self._beside is not None:
            torch.cuda.current_stream(device).wait_event(self._beside)

    def _on_device(self, rows: torch.Tensor) -> bool:
        """Whether the device moves these rows (ids on CUDA, a mapped store)."""
        return self.mapped and rows.is_cuda

    def _wait(self) -> None:
        """Wait for the device kernels that used the rows (before a CPU-side access: a device
        write lands when its kernel has run, and a CPU write must not overtake a queued read).
        The whole device: the kernels may be queued on any of its streams."""
        if self._pending is not None:
            torch.cuda.synchronize(self._pending)
            self._pending = None
            self._beside = None  # done with the rest


def mapped_device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` aliasing the memory of the contiguous CPU tensor ``host``,
    which is page-locked and mapped into the device's address space (UVA) in place: torch ops
    and the CUDA kernels work on it as on any CUDA tensor, each access crossing PCIe. The view
    keeps ``host`` alive (torch holds the ``__cuda_array_interface__`` object it is made from);
    the memory is unlocked when both are gone, after the device's queued work. It is not torch's
    allocator's memory: ``torch.cuda.memory_allocated`` does not count it. Needs the CUDA
    kernels' runtime (CuPy) for the device address.

    A hash table's per-row arrays on the host (:class:`~shared.hashtable.layout.RowArrays`)
    are made here."""
    from shared.hashtable.cuda import runtime

    if device.type != "cuda":
        raise ValueError(f"mapped_device_view: {device} is not a CUDA device")
    reason = runtime.unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"mapped_device_view: host memory cannot be mapped into {device} here: {reason}"
        )
    if host.device.type != "cpu" or not host.is_contiguous():
        raise ValueError("mapped_device_view: host must be a contiguous CPU tensor")
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    if device.index is None:  # "cuda": the current device, as torch places "cuda" tensors
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        _register(host, mapped=True, drain=True)
        pointer = _device_pointer(host)
    return _view_at(host, pointer, device)


def _view_at(host: torch.Tensor, pointer: int, device: torch.device) -> torch.Tensor:
    """The CUDA tensor on ``device`` at ``pointer``, the device address of mapped ``host``,
    keeping ``host`` alive; refused where torch would copy instead of viewing."""
    view = torch.as_tensor(_MappedHost(host, pointer), device=device)
    if view.data_ptr() != pointer:
        raise RuntimeError(
            f"mapped_device_view: torch copied the mapped memory to {view.device} instead of "
            f"viewing it (the memory is mapped for another device than {device})"
        )
    return view


def mapped_device_full(n: int, fill: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n] ``fill`` in host memory, as a CUDA tensor on ``device`` that aliases it (as
    :func:`mapped_device_view`): the CUDA driver's memory where :mod:`~shared.hashtable.host_memory`
    says ``driver``, else plain memory registered in place."""
    if host_memory.default() != "driver" or n == 0:
        return mapped_device_view(torch.full((n,), fill, dtype=dtype), device)
    if device.type != "cuda":
        raise ValueError(f"mapped_device_full: {device} is not a CUDA device")
    host = host_memory.driver_full((n,), fill, dtype, device)
    return _view_at(host, host.data_ptr(), device)


class _MappedHost:
    """``host``'s memory at its device address, as ``__cuda_array_interface__`` (version 3)."""

    def __init__(self, host: torch.Tensor, pointer: int) -> None:
        self.host = host  # alive as long as torch's view holds this object
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": host.numpy().dtype.str,
            "data": (pointer, False),
            "strides": None,  # contiguous
            "version": 3,
        }


def _device_pointer(rows: torch.Tensor) -> int:
    """The device address of page-locked, mapped ``rows`` (see
    :meth:`TensorHostStore.device_pointer`)."""
    import cupy  # the CUDA kernels' runtime (shared.hashtable.cuda.runtime)

    attributes = cupy.cuda.runtime.pointerGetAttributes(rows.data_ptr())
    if not attributes.devicePointer:
        raise RuntimeError(
            "TensorHostStore.device_pointer: the page-locked rows have no device address "
            "(not mapped); the device cannot read host memory through UVA"
        )
    return int(attributes.devicePointer)


def _register(rows: torch.Tensor, *, mapped: bool = False, drain: bool = False) -> None:
    """Page-lock ``rows``' memory for the device's asynchronous copies (and with ``mapped`` map
    it into the device's address space), unlocked when ``rows`` is freed; with ``drain`` after
    the device's queued work (kernels of :mod:`~shared.hashtable.cuda.host_rows` may still read
    or write the rows through UVA when a storage is dropped)."""
    cudart = torch.cuda.cudart()
    ptr = rows.data_ptr()
    flags = 1 | (2 if mapped else 0)  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = int(cudart.cudaHostRegister(ptr, rows.nbytes, flags))
    if err != 0:
        raise RuntimeError(
            f"TensorHostStore: page-locking {rows.nbytes / 2**30:.1f} GiB of host memory failed "
            f"(cudaError {err}): lower the CACHING tables' max_capacity or free host memory"
        )
    weakref.finalize(rows, _unregister, cudart, ptr, drain)


def _unregister(cudart: Any, ptr: int, drain: bool) -> None:
    if drain:
        torch.cuda.synchronize()
    cudart.cudaHostUnregister(ptr)
