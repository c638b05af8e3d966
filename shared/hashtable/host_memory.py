"""How a CACHING storage's host tier memory is made, when the device reads and writes it itself
(page-locked and mapped into its address space): the one place of that choice.

- ``register`` (the default): plain memory page-locked in place by ``cudaHostRegister``
  (:class:`~shared.hashtable.host_store.TensorHostStore`). 4 KiB pages, which the device maps
  one by one: at 100M rows (12.8 GB at dim 16) its random UVA reads ran at 35M rows/s on an
  H100, a cost per row that reading in address order did not remove (``docs/performance.md``).
- ``driver``: made by the CUDA driver's virtual memory API (``cuMemCreate`` with a HOST location,
  at the driver's recommended granularity), mapped for the device and, by ``cuMemSetAccess``, for
  the CPU at one address, in chunks of that granularity (2 MiB). Opt-in (:func:`use`): on an
  H100 (2026-12-07, 100M rows at dim 16) the device's random reads of it ran as fast as of
  registered memory (39.5M against 39.7M rows/s) and the embedding step at a 10 % cache as slow
  (2.76× HBM-only with either, the cache full), while the CPU's gather ran 1.2× faster (134.8M against
  110.5M rows/s), which the host-node fill's cores may use (``bench.bench_host_pages
  --allocations vmm_host``, ``bench.bench_tiers --host-memory driver``).

ctypes over ``libcuda.so.1`` (the driver torch already loaded); structures as ``cuda.h`` of
CUDA 12.2+ defines them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

KINDS = ("register", "driver")
_default = "register"


def use(kind: str) -> None:
    """Make the host tiers of CACHING storages, and a table's host row arrays, built from now on
    in this process ``kind`` memory (a store keeps what it was made with, also when it grows)."""
    global _default
    if kind not in KINDS:
        raise ValueError(f"host memory: {kind!r} is not one of {', '.join(KINDS)}")
    _default = kind


def default() -> str:
    """The kind :func:`use` set (``register`` unless changed)."""
    return _default


@contextlib.contextmanager
def using(kind: str) -> Iterator[None]:
    """:func:`use` ``kind`` inside the block, and the kind before it after."""
    was = _default
    use(kind)
    try:
        yield
    finally:
        use(was)


def refuse_off_cuda(kind: str, device: str, who: str) -> None:
    """Raise, naming ``who``'s ``--host-memory``, where ``kind`` needs the CUDA driver and
    ``device`` is not a CUDA device."""
    if kind != "register" and not device.startswith("cuda"):
        raise ValueError(
            f"{who}: --host-memory {kind} is made by the CUDA driver: give it with --device cuda"
        )


LOCATION_DEVICE, LOCATION_HOST, LOCATION_HOST_NUMA = 1, 2, 3  # CUmemLocationType
ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
PROT_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> Any:
    """libcuda with the argument types of the calls made here (loaded and typed once)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    u64, size = ctypes.c_uint64, ctypes.c_size_t
    cuda.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size), ctypes.POINTER(_Prop),
                                                   ctypes.c_int]  # fmt: skip
    cuda.cuMemCreate.argtypes = [ctypes.POINTER(u64), size, ctypes.POINTER(_Prop), u64]
    cuda.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size, size, u64, u64]
    cuda.cuMemMap.argtypes = [u64, size, size, u64, u64]
    cuda.cuMemSetAccess.argtypes = [u64, size, ctypes.POINTER(_Access), size]
    cuda.cuMemUnmap.argtypes = [u64, size]
    cuda.cuMemRelease.argtypes = [u64]
    cuda.cuMemAddressFree.argtypes = [u64, size]
    return cuda


def driver_full(
    shape: tuple[int, ...], fill: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``shape`` of ``fill`` on the host in ``driver`` memory for ``device``: a CPU tensor
    whose device address is its own (:attr:`torch.Tensor.data_ptr`). The memory is freed when
    the tensor's storage is, after the device's queued work."""
    n = math.prod(shape)
    nbytes = n * dtype.itemsize
    mem = VmmHost(nbytes, torch.cuda.current_device() if device.index is None else device.index)
    t = mem.as_tensor()[:nbytes].view(dtype).view(shape)
    t.fill_(fill)  # the driver does not promise zeros
    return t


def driver_zeros(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] float32 zeros in ``driver`` memory (:func:`driver_full`)."""
    return driver_full((rows, width), 0.0, torch.float32, device)


class VmmHost:
    """``nbytes`` of pinned host memory made by ``cuMemCreate`` (HOST, else HOST_NUMA node 0),
    mapped for ``device`` and the CPU at one address; :meth:`as_tensor` views it. Collection
    unmaps and frees it, after the device's queued work."""

    _handle: int | None = None
    device = 0

    def __init__(self, nbytes: int, device: int = 0) -> None:
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{device}")  # the primary context current on this thread
        self._cuda = cuda = _driver()
        self.location = ""
        self.ptr = 0
        errors = []
        for kind, name in ((LOCATION_HOST, "host"), (LOCATION_HOST_NUMA, "host_numa")):
            prop = _Prop(type=ALLOCATION_PINNED, location=_Location(kind, 0))
            gran = ctypes.c_size_t(0)
            err = cuda.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                     GRANULARITY_RECOMMENDED)  # fmt: skip
            if err:
                errors.append(f"{name}: granularity error {err}")
                continue
            self.granularity = gran.value
            self.nbytes = -(-nbytes // gran.value) * gran.value
            handle = ctypes.c_uint64(0)
            err = cuda.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(prop), 0)
            if err:
                errors.append(f"{name}: cuMemCreate error {err}")
                continue
            self._handle = handle.value
            self.location = name
            break
        if not self.location:
            raise RuntimeError(f"cuMemCreate of host memory failed: {'; '.join(errors)}")
        ptr = ctypes.c_uint64(0)
        self._check(cuda.cuMemAddressReserve(ctypes.byref(ptr), self.nbytes, self.granularity, 0, 0),
                    "cuMemAddressReserve")  # fmt: skip
        self.ptr = ptr.value
        self._check(cuda.cuMemMap(self.ptr, self.nbytes, 0, self._handle, 0), "cuMemMap")
        err = 0
        for host in (LOCATION_HOST, LOCATION_HOST_NUMA):  # the CPU's access, as either location
            access = (_Access * 2)(
                _Access(_Location(LOCATION_DEVICE, device), PROT_READWRITE),
                _Access(_Location(host, 0), PROT_READWRITE),
            )
            err = cuda.cuMemSetAccess(self.ptr, self.nbytes, access, 2)
            if not err:
                break
        self._check(err, "cuMemSetAccess (for the device and the CPU)")
        self.device = device

    def as_tensor(self) -> torch.Tensor:
        """The memory as a CPU uint8 tensor [nbytes] that keeps it alive: the buffer it views
        holds this object (not the other way round, which would be a cycle through torch that
        the collector cannot see)."""
        buf = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        buf.owner = self  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _check(self, err: int, what: str) -> None:
        if err:
            self.close()
            raise RuntimeError(f"{what} failed with CUresult {err} ({self.location} memory)")

    def close(self) -> None:
        if self._handle is None:
            return
        if sys.is_finalizing():  # the process is ending: the driver frees what it made
            return
        torch.cuda.synchronize(self.device)  # no kernel may still read or write it
        cuda = self._cuda
        if self.ptr:
            cuda.cuMemUnmap(self.ptr, self.nbytes)
            cuda.cuMemAddressFree(self.ptr, self.nbytes)
        cuda.cuMemRelease(self._handle)
        self._handle = None
        self.ptr = 0

    def __del__(self) -> None:
        self.close()
