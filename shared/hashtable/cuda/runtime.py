"""Loading ``kernels.cu`` (and ``keyed.cu``) with CuPy and launching their kernels on torch tensors.

CuPy is imported lazily: importing this module costs nothing on a machine without it.
Kernels run on torch's current stream of the tensors' device, so they order with torch's own
work and need no synchronisation. Two ways to launch:

- :func:`launch` / :func:`prepared`: CuPy's RawKernel call; tensors cross into CuPy through
  DLPack (``cupy.from_dlpack``, no copy); the views of a table's long-lived arrays are cached
  per tensor object and dropped when the tensor dies.
- :class:`Launcher` / :class:`Kernel` (find, keyed, insert v2, erase): the driver's
  ``cuLaunchKernel`` from a C parameter buffer per kernel, the tensors passed as their data
  pointers: no DLPack export and no CuPy argument conversion per call. A kernel's parameter
  types are a signature string (``p`` pointer, ``q`` int64, ``i`` int32, ``f`` float32; the
  tests check them against the sources). Without a current CUDA context or with
  :data:`DIRECT_LAUNCH` False, a Launcher passes the same arguments (pointers as integers) to
  CuPy's RawKernel call; ``launch(..., sig=...)`` (keyed) and ``find`` fall back to the DLPack
  path instead.

A pointer passed to a launch must stay valid until the launch is queued: tensors are read when
the launch is queued and the caller holds them until then (torch's caching allocator reuses a
freed block on the same stream only for work queued after it, so queued kernels are safe).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

SOURCE = Path(__file__).with_name("kernels.cu")
FIND_WINDOWS = (0, 4, 8, 16)  # compiled variants of ht_find / ht_insert_stage (0: binary search)
DEFAULT_WINDOW = 4  # slots a probe reads (16-byte loads): fastest on the H200 (bench_gpu_hashtable)
BLOCK = 256  # threads per block of the one-thread-per-key kernels
MAX_SHARED = 48 * 1024  # dynamic shared memory a block may use without opting in
DIRECT_LAUNCH = True  # Launcher uses cuLaunchKernel (False: CuPy's RawKernel call, to compare)

# Another source file of this folder, compiled as a module of its own (only ``extern "C"``
# kernels): (file name, NVRTC options added to -std=c++17), e.g. keyed.py's SOURCE.
Source = tuple[str, tuple[str, ...]]

_enabled = True
_views: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}
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
    """Whether HashTable on CUDA dispatches to the kernels (CUDA, CuPy, and not disabled)."""
    return _enabled and unavailable_reason() is None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch core on CUDA too (the reference the tests and benchmarks compare with)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _cupy() -> Any:
    import cupy

    return cupy


def _template_names() -> list[str]:
    return [f"{k}<{w}>" for k in ("ht_find", "ht_insert_stage") for w in FIND_WINDOWS]


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


@functools.cache
def _function(device_index: int, name: str, source: Source | None = None) -> Any:
    if source is not None:
        return _source_module(device_index, source).get_function(name)
    return _module(device_index).get_function(name)


def as_cupy(t: torch.Tensor, *, cache: bool = False) -> Any:
    """A CuPy view of CUDA tensor ``t`` (DLPack, no copy); ``cache`` for long-lived tensors."""
    if not cache:
        return _cupy().from_dlpack(t.detach())
    key = id(t)
    hit = _views.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    view = _cupy().from_dlpack(t.detach())
    _views[key] = (weakref.ref(t, lambda _, k=key: _views.pop(k, None)), view)
    return view


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


def _launcher(
    name: str,
    grid: int,
    block: int,
    args: Sequence[Any],
    device: torch.device,
    shared_mem: int,
    cached: Sequence[torch.Tensor],
    source: Source | None = None,
) -> Callable[[], None]:
    cp = _cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    keep = {id(t) for t in cached} | {id(t) for t in _dummies.values()}
    stream = _cupy_stream(index, torch.cuda.current_stream(index).cuda_stream)
    fn = _function(index, name, source)
    with cp.cuda.Device(index), stream:  # DLPack exports then need no cross-stream event
        cargs = tuple(
            as_cupy(a, cache=id(a) in keep) if isinstance(a, torch.Tensor) else a for a in args
        )

    def run() -> None:
        with cp.cuda.Device(index), stream:
            fn((grid,), (block,), cargs, shared_mem=shared_mem)

    return run


def launch(
    name: str,
    grid: int,
    block: int,
    args: Sequence[Any],
    *,
    device: torch.device,
    shared_mem: int = 0,
    cached: Sequence[torch.Tensor] = (),
    source: Source | None = None,
    sig: str | None = None,
) -> None:
    """Launch kernel ``name`` on torch's current stream of ``device``.

    ``args``: tensors (contiguous, on ``device``) and NumPy scalars, in the kernel's order;
    tensors in ``cached`` (by identity) keep their CuPy view between calls. ``source``: the
    kernel's module when it is not in ``kernels.cu`` (see :data:`Source`). With ``sig`` (the
    kernel's parameter types, see :class:`Kernel`) the launch goes through :class:`Launcher`
    (``cuLaunchKernel``, no DLPack) where it can, else through CuPy's call.
    """
    if sig is not None and DIRECT_LAUNCH:
        launcher = Launcher(device)
        with launcher:
            if launcher.direct:
                launcher(launcher.kernel(name, sig, source), grid, block, args, shared_mem)
                return
    _launcher(name, grid, block, args, device, shared_mem, cached, source)()


def prepared(
    name: str,
    grid: int,
    block: int,
    args: Sequence[Any],
    *,
    device: torch.device,
    shared_mem: int = 0,
    source: Source | None = None,
) -> Callable[[], None]:
    """A launch with its arguments converted once (for timing the kernel alone, or replaying
    it on the same tensors): the returned function only launches."""
    return _launcher(name, grid, block, args, device, shared_mem, (), source)


# ------------------------------------------------------------------------------ direct launch

_CTYPES = {"p": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float}
_NUMPY = {"q": np.int64, "i": np.int32, "f": np.float32}


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
    """Launches :class:`Kernel` functions on torch's current stream of ``device``: through
    ``cuLaunchKernel`` from the kernel's parameter buffer, or (no current context,
    :data:`DIRECT_LAUNCH` or ``direct`` False, an old CuPy) through CuPy's RawKernel call
    with the same arguments. Use inside ``with`` (the device's CUDA context)."""

    def __init__(self, device: torch.device, *, direct: bool = True) -> None:
        self.cp = _cupy()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream_ptr = _raw_stream(self.index)
        self._device: Any = None
        self._want_direct = direct
        self.direct = False

    def __enter__(self) -> Launcher:
        self._device = self.cp.cuda.Device(self.index)
        self._device.__enter__()
        drv = self.cp.cuda.driver
        self.direct = (
            self._want_direct
            and DIRECT_LAUNCH
            and hasattr(drv, "launchKernel")
            and drv.ctxGetCurrent() != 0
        )
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
