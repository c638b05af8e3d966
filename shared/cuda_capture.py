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


def graph_pool(device: torch.device) -> Any:
    """A memory pool for graphs of ``device`` (a ``torch.cuda.MemPool``; give its ``id`` to
    :func:`capture`), alive while the caller holds it. Not ``graph_pool_handle()``: only the
    graphs captured into that id hold it, so once they are all dropped the allocator releases
    it with their blocks still cached there, and the next capture into the id fails ("use_count
    > 0 INTERNAL ASSERT FAILED": the static step's on the H100 on 2026-12-07, after its tables
    grew and it dropped every graph)."""
    with torch.cuda.device(device):
        return torch.cuda.MemPool()


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
