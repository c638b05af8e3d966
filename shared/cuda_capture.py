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

**Graphs that may replay at the same time need capture streams of their own**
(:class:`CaptureStreams`). A GEMM captured into a graph keeps the address of the cuBLAS (and
cuBLASLt) workspace torch gave it, and torch keys that workspace by (the thread's handle, the
stream): every graph one thread captured on one stream writes the same workspace, even with
memory pools of their own (pytorch#193402). Replayed one after another that is harmless (the
trainer's graphs; one model's graphs on its serving stream); replayed at once on two streams
they overwrite each other's partial sums. A server replays two models' graphs at once: the
served version's, while the next one is checked and warmed up on the load stream (on the H200
on 2026-12-07, three answers of the served version just before a swap had neither version's
scores, in both runs of the whole GPU suite). So each model's graphs are captured on a stream
no other live model's graphs were captured on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
S = TypeVar("S")


class CaptureStreams(Generic[S]):
    """Streams handed to owners (sets of graphs) such that no two live owners share one
    (module doc): :meth:`take` gives back the stream of an owner that is gone, else a new one
    from ``make``, skipping any whose ``key`` (the raw stream: torch hands streams out of a
    fixed pool, round robin, so a new one may be an old one again) a live owner's or a
    ``reserved`` key has. Thread-safe."""

    def __init__(
        self, make: Callable[[], S], key: Callable[[S], int], reserved: Callable[[], set[int]]
    ) -> None:
        self._make, self._key, self._reserved = make, key, reserved
        self._lock = threading.Lock()
        self._held: list[tuple[S, weakref.ref[Any]]] = []  # (stream, its owner)

    def take(self, owner: object) -> S:
        """A stream for ``owner`` (held while it lives)."""
        with self._lock:
            for i, (stream, ref) in enumerate(self._held):
                if ref() is None:
                    self._held[i] = (stream, weakref.ref(owner))
                    return stream
            taken = {self._key(s) for s, _ in self._held} | self._reserved()
            for _ in range(256):  # torch's pools: 32 streams a priority
                stream = self._make()
                if self._key(stream) not in taken:
                    self._held.append((stream, weakref.ref(owner)))
                    return stream
        raise RuntimeError(
            f"no capture stream free of {len(self._held)} live graph sets' streams: a process "
            "holds too many sets of CUDA graphs at once (drop some, or run eagerly)"
        )

    def __len__(self) -> int:
        """The streams made so far."""
        return len(self._held)


_OWNED: dict[torch.device, CaptureStreams[torch.cuda.Stream]] = {}
_OWNED_LOCK = threading.Lock()


def capture_streams(device: torch.device) -> CaptureStreams[torch.cuda.Stream]:
    """The :class:`CaptureStreams` of ``device``: streams apart from each other's and from
    :func:`capture_stream`'s."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _OWNED_LOCK:
        if device not in _OWNED:
            _OWNED[device] = CaptureStreams(
                lambda: torch.cuda.Stream(device),
                lambda s: int(s.cuda_stream),
                lambda: {int(capture_stream(device).cuda_stream)},
            )
        return _OWNED[device]


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
    graph: torch.cuda.CUDAGraph,
    *,
    pool: Any = None,
    device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
) -> Iterator[None]:
    """Capture the CUDA work of the ``with`` body into ``graph`` (memory from ``pool``, the
    ``id`` of a :func:`graph_pool` or another graph's ``pool()``, shared by graphs that never run at
    the same time). The body runs on the capture stream (``stream``: one of
    :func:`capture_streams` for graphs that may replay beside others, see the module doc; else
    the device's :func:`capture_stream`); work queued before the ``with`` on the current stream
    is ordered before it, and work after it after the capture. A failed body ends the capture
    and re-raises."""
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    current = torch.cuda.current_stream(dev)
    stream = stream if stream is not None else capture_stream(dev)
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
