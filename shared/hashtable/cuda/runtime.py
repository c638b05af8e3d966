"""Loading ``kernels.cu`` (and ``keyed.cu``) with CuPy and launching their kernels on torch tensors.

CuPy is imported lazily: importing this module costs nothing on a machine without it.
Tensors cross into CuPy through DLPack (``cupy.from_dlpack``, no copy); the views of a table's
long-lived arrays are cached per tensor object and dropped when the tensor dies. Kernels run on
torch's current stream of the tensors' device, so they order with torch's own work and need no
synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
import math
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

# Another source file of this folder, compiled as a module of its own (only ``extern "C"``
# kernels): (file name, NVRTC options added to -std=c++17), e.g. keyed.py's SOURCE.
Source = tuple[str, tuple[str, ...]]

_enabled = True
_views: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}
_dummies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_streams: dict[tuple[int, int], Any] = {}


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
    ptr = torch.cuda.current_stream(index).cuda_stream
    stream = _streams.get((index, ptr))
    if stream is None:
        stream = _streams[(index, ptr)] = cp.cuda.ExternalStream(ptr, index)
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
) -> None:
    """Launch kernel ``name`` on torch's current stream of ``device``.

    ``args``: tensors (contiguous, on ``device``) and NumPy scalars, in the kernel's order;
    tensors in ``cached`` (by identity) keep their CuPy view between calls. ``source``: the
    kernel's module when it is not in ``kernels.cu`` (see :data:`Source`).
    """
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
