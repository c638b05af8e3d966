"""Loading ``kernels.cu`` (and ``keyed.cu``) with CuPy and launching their kernels on torch tensors.

CuPy is imported once, at the first compile or launch (the CUDA backend's construction asks
:func:`unavailable_reason` first): importing this module costs nothing on a machine without it.
Kernels run on torch's current stream of the tensors' device, so they order with torch's own
work and need no synchronisation.

Every launch goes through :class:`Launcher` / :class:`Kernel` (:func:`launch` and
:func:`prepared` wrap them): the driver's ``cuLaunchKernel`` from a C parameter buffer per
kernel, the tensors passed as their data pointers: no DLPack export and no CuPy argument
conversion per call (13.3 G keys/s for a find of 1M keys on the H200, 5.4 G through CuPy's
RawKernel call on DLPack views: ``bench/results/bench_gpu_hashtable.json``). A kernel's parameter
types are a signature string (``p`` pointer, ``q`` int64, ``i`` int32, ``f`` float32; the tests
check them against the sources). Only where the driver launch cannot run (no current CUDA
context, a CuPy without ``driver.launchKernel``) does a Launcher pass the same arguments
(pointers as integers) to CuPy's RawKernel call.

A pointer passed to a launch must stay valid until the launch is queued: tensors are read when
the launch is queued and the caller holds them until then (torch's caching allocator reuses a
freed block on the same stream only for work queued after it, so queued kernels are safe).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

SOURCE = Path(__file__).with_name("kernels.cu")
FIND_WINDOWS = (0, 4, 8, 16)  # compiled variants of ht_find (0: binary search)
DEFAULT_WINDOW = 4  # slots a probe reads (16-byte loads): fastest on the H200 (bench_gpu_hashtable)
BLOCK = 256  # threads per block of the one-thread-per-key kernels
MAX_SHARED = 48 * 1024  # dynamic shared memory a block may use without opting in

# Another source file of this folder, compiled as a module of its own (only ``extern "C"``
# kernels): (file name, NVRTC options added to -std=c++17), e.g. keyed.py's SOURCE.
Source = tuple[str, tuple[str, ...]]

_cp: Any = None  # the cupy module, once imported
_dummies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_streams: dict[tuple[int, int], Any] = {}  # (device, stream pointer) -> cupy ExternalStream
_local = threading.local()  # .kernels: this thread's Launcher.kernel cache


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None when they can): no CUDA device, or no CuPy."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return (
            f"cupy is not installed ({e}); install cupy-cuda12x/cupy-cuda13x for the CUDA kernels"
        )
    return None


def available() -> bool:
    """Whether the kernels can run here (CUDA and CuPy); see :func:`unavailable_reason`."""
    return unavailable_reason() is None


def _cupy() -> Any:
    """The cupy module, imported at the first call."""
    global _cp
    if _cp is None:
        import cupy

        _cp = cupy
    return _cp


def load() -> None:
    """Import CuPy now (the CUDA backend does at its construction, not at its first call)."""
    _cupy()


def _template_names() -> list[str]:
    return [f"ht_find<{w}>" for w in FIND_WINDOWS]


@functools.cache
def _module(device_index: int) -> Any:
    cp = _cupy()
    with cp.cuda.Device(device_index):
        mod = cp.RawModule(
            code=SOURCE.read_text(), options=("-std=c++17",), name_expressions=_template_names()
        )
        mod.compile()
    return mod


@functools.cache
def _source_module(device_index: int, source: Source) -> Any:
    cp = _cupy()
    file, options = source
    with cp.cuda.Device(device_index):
        mod = cp.RawModule(
            code=SOURCE.with_name(file).read_text(), options=("-std=c++17", *options)
        )
        mod.compile()
    return mod


def device_index(device: torch.device) -> int:
    """The CUDA device ``device`` names (the current one for plain ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def compile_modules(device: torch.device, sources: Sequence[Source]) -> None:
    """Compile kernels.cu and ``sources`` for ``device`` now (each once a process), not at their
    first launch: a table's first training steps would otherwise stall on NVRTC (1.6 s on the
    H200 host with a cold cache, 2026-12-02, inside the epoch's first 100 steps) and a
    compiler error would surface mid-run."""
    index = device_index(device)
    _module(index)
    for source in sources:
        _source_module(index, source)


@functools.cache
def _function(device_index: int, name: str, source: Source | None = None) -> Any:
    if source is not None:
        return _source_module(device_index, source).get_function(name)
    return _module(device_index).get_function(name)


def dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor passed where a kernel's optional array is absent."""
    key = (device, dtype)
    if key not in _dummies:
        _dummies[key] = torch.zeros(1, dtype=dtype, device=device)
    return _dummies[key]


def i64(x: int) -> np.int64:
    return np.int64(x)


def i32(x: int) -> np.int32:
    return np.int32(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def blocks(n: int, block: int = BLOCK) -> int:
    return max(1, math.ceil(n / block))


def launch(
    name: str,
    sig: str,
    grid: int,
    block: int,
    args: Sequence[Any],
    *,
    device: torch.device,
    shared_mem: int = 0,
    source: Source | None = None,
) -> None:
    """Launch kernel ``name`` (parameter types ``sig``, see :class:`Kernel`) through a
    :class:`Launcher` on torch's current stream of ``device``.

    ``args``: tensors (contiguous, on ``device``; None for a null pointer) and numbers, in the
    kernel's order. ``source``: the kernel's module when it is not in ``kernels.cu`` (see
    :data:`Source`).
    """
    launcher = Launcher(device)
    with launcher:
        launcher(launcher.kernel(name, sig, source), grid, block, args, shared_mem)


def prepared(
    name: str,
    sig: str,
    grid: int,
    block: int,
    args: Sequence[Any],
    *,
    device: torch.device,
    shared_mem: int = 0,
    source: Source | None = None,
) -> Callable[[], None]:
    """A launch of ``name`` on fixed ``args`` (for timing the kernel alone, or replaying it on
    the same tensors): the returned function only launches, on the stream current now, from a
    parameter buffer of its own. Call it on the thread that made it."""
    launcher = Launcher(device)
    kernel = Kernel(launcher.index, name, sig, source)

    def run() -> None:
        with launcher:
            launcher(kernel, grid, block, args, shared_mem)

    return run


# ------------------------------------------------------------------------------ launches

_CTYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {
    "p": ctypes.c_uint64,
    "q": ctypes.c_int64,
    "i": ctypes.c_int32,
    "f": ctypes.c_float,
}
# Any: arg_values gives ints for q/i and floats for f, which the union type cannot say
_NUMPY: dict[str, Callable[[Any], np.generic]] = {"q": np.int64, "i": np.int32, "f": np.float32}


def _cupy_stream(index: int, ptr: int) -> Any:
    """The CuPy view of the CUDA stream ``ptr`` of device ``index`` (kept between calls)."""
    stream = _streams.get((index, ptr))
    if stream is None:
        stream = _streams[(index, ptr)] = _cupy().cuda.ExternalStream(ptr, index)
    return stream


def _raw_stream(index: int) -> int:
    """The pointer of torch's current stream of device ``index``."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object made
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


class Address:
    """A raw device address passed where a launch takes a tensor (its ``data_ptr``): memory no
    tensor of the device describes, such as page-locked host rows mapped into the device's
    address space (``TensorHostStore.device_pointer``)."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def arg_values(sig: str, args: Sequence[Any]) -> list[int | float]:
    """Plain numbers of ``args`` for signature ``sig``: tensors become data pointers (None: 0)."""
    if len(args) != len(sig):
        raise TypeError(f"kernel takes {len(sig)} arguments ({sig}), got {len(args)}")
    out: list[int | float] = []
    for kind, a in zip(sig, args, strict=True):
        if kind == "p":
            out.append(0 if a is None else a.data_ptr())
        elif kind == "f":
            out.append(float(a))
        else:
            out.append(int(a))
    return out


class Kernel:
    """Function ``name`` of kernels.cu (or of ``source``: see :data:`Source`) on device
    ``index``, with a C buffer of its parameters (``sig``: ``p`` pointer, a tensor or None;
    ``q`` int64; ``i`` int32; ``f`` float32, in the kernel's order). A launch stores each
    argument in its slot and hands the buffer to ``cuLaunchKernel``, which copies it: a buffer
    is not shared between threads (:meth:`Launcher.kernel` keeps one per thread)."""

    def __init__(self, index: int, name: str, sig: str, source: Source | None = None) -> None:
        self.name = name
        self.sig = sig
        # the cache entry other code uses (insert's shared-memory opt-in sets an attribute on
        # _function(index, name)): functools.cache keys an explicit None apart
        self.fn = _function(index, name) if source is None else _function(index, name, source)
        self.slots = [_CTYPES[c]() for c in sig]
        self.params = (ctypes.c_void_p * len(sig))(*(ctypes.addressof(s) for s in self.slots))
        self.params_ptr = ctypes.addressof(self.params)
        self.ptr = 0  # the CUfunction, read at the first direct launch (in the device's context)

    def bind(self, args: Sequence[Any]) -> None:
        for slot, value in zip(self.slots, arg_values(self.sig, args), strict=True):
            slot.value = value

    def cupy_args(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The arguments as CuPy's RawKernel call takes them (pointers as Python ints, of 8
        bytes; NumPy scalars of each width)."""
        return tuple(
            v if kind == "p" else _NUMPY[kind](v)
            for kind, v in zip(self.sig, arg_values(self.sig, args), strict=True)
        )


class Launcher:
    """Launches :class:`Kernel` functions on torch's current stream of ``device`` (the one
    current when the Launcher is made): through ``cuLaunchKernel`` from the kernel's parameter
    buffer, or, where that cannot run (no current context, a CuPy without
    ``driver.launchKernel``: :attr:`direct` False), through CuPy's RawKernel call with the same
    arguments. Use inside ``with`` (the device's CUDA context)."""

    def __init__(self, device: torch.device) -> None:
        self.cp = _cupy()
        self.index = device_index(device)
        self.stream_ptr = _raw_stream(self.index)
        self._device: Any = None
        self.direct = False

    def __enter__(self) -> Launcher:
        self._device = self.cp.cuda.Device(self.index)
        self._device.__enter__()
        drv = self.cp.cuda.driver
        self.direct = hasattr(drv, "launchKernel") and drv.ctxGetCurrent() != 0
        return self

    def __exit__(self, *exc: object) -> None:
        self._device.__exit__(*exc)

    @property
    def torch_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.index)

    def kernel(self, name: str, sig: str, source: Source | None = None) -> Kernel:
        """This thread's :class:`Kernel` of ``name`` on the launcher's device (kept)."""
        cache = getattr(_local, "kernels", None)
        if cache is None:
            cache = _local.kernels = {}
        key = (self.index, name, source)
        k = cache.get(key)
        if k is None:
            k = cache[key] = Kernel(self.index, name, sig, source)
        return k

    def __call__(
        self, kernel: Kernel, grid: int, block: int, args: Sequence[Any], shared_mem: int = 0
    ) -> None:
        if self.direct:
            kernel.bind(args)
            if not kernel.ptr:
                kernel.ptr = kernel.fn.kernel.ptr
            self.cp.cuda.driver.launchKernel(
                kernel.ptr, grid, 1, 1, block, 1, 1, shared_mem, self.stream_ptr,
                kernel.params_ptr, 0,
            )  # fmt: skip
        else:
            kernel.fn(
                (grid,),
                (block,),
                kernel.cupy_args(args),
                shared_mem=shared_mem,
                stream=_cupy_stream(self.index, self.stream_ptr),
            )

    def event(self) -> Any:
        return torch.cuda.Event()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, event: Any) -> None:
        """Queue the copy of ``src`` into pinned ``dst`` and ``event`` after it."""
        dst.copy_(src, non_blocking=True)
        event.record(self.torch_stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)
