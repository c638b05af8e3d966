"""Capturing a CUDA graph without ``torch.cuda.graph``'s side effects, for the trainer and the
server alike.

``torch.cuda.graph`` (the context manager) synchronizes the device and empties the caching
allocator before every capture, and recent torch releases also empty the pinned host cache
(``torch._C._host_emptyCache``). A process that captures one graph per shape bucket while it
works pays for that at each capture: the next steps allocate the freed device blocks again
(``cudaMalloc``), the data loader's next batches pin fresh host memory (``cudaHostAlloc``), and
the synchronize drains the queue. A server loading a new version beside the one it serves
feels all of it. :func:`capture` does only what a capture needs: a side stream (one per device)
that waits for the current stream, ``capture_begin``/``capture_end`` in ``thread_local`` mode
(other threads may use CUDA meanwhile), and the current stream waiting for the side stream
afterwards. Example::

    graph = torch.cuda.CUDAGraph()
    with capture(graph, pool=pool):
        out = body(static_inputs)
    graph.replay()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The capture stream of ``device`` (one per device: a stream per capture would strand the
    allocator's blocks on streams nobody uses again)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


class GraphPool:
    """A memory pool for graphs of one device: give :attr:`id` to :func:`capture`. It stays
    usable while its owner holds it, even after every graph captured into it is dropped.

    ``graph_pool_handle()`` alone is not enough: torch counts a pool's users by the graphs
    captured into it, in the device allocator and (in torch 2.11 and 2.13 at least) in the
    pinned host allocator alike. Once the last graph is dropped the host allocator marks the
    pool freeable, and the next capture into the id fails its ``use_count > 0`` INTERNAL ASSERT
    (``CachingHostAllocator.h``; the static step's and the graph test's on the H100, 2026-12-07,
    torch 2.11; a ``torch.cuda.MemPool`` holds only the device allocator's count). So the pool
    keeps one graph of its own, captured into it at construction (one fill of one element),
    which holds both counts for the pool's life."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.id: Any = torch.cuda.graph_pool_handle()
            self._keeper = torch.cuda.CUDAGraph()
            with capture(self._keeper, pool=self.id, device=device):
                torch.empty(1, device=device).zero_()


def graph_pool(device: torch.device) -> GraphPool:
    """A :class:`GraphPool` for ``device`` (made outside any capture)."""
    return GraphPool(device)


@contextlib.contextmanager
def capture(
    graph: torch.cuda.CUDAGraph, *, pool: Any = None, device: torch.device | None = None
) -> Iterator[None]:
    """Capture the CUDA work of the ``with`` body into ``graph`` (memory from ``pool``, the
    ``id`` of a :func:`graph_pool` or another graph's ``pool()``, shared by graphs that never run at
    the same time). The body runs on the capture stream; work queued before the ``with`` on the
    current stream is ordered before it, and work after it after the capture. A failed body
    ends the capture and re-raises."""
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    current = torch.cuda.current_stream(dev)
    stream = capture_stream(dev)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            raise
        graph.capture_end()
    current.wait_stream(stream)
