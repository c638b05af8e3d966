"""Batches to the device ahead of the step: a feeder thread takes each batch from the loader,
enqueues its host-to-device copy on a side CUDA stream and builds the device batch, while the
caller computes on the batches before it (as TorchRec's ``TrainPipelineBase`` copies one
batch ahead; here up to ``depth``, and off the caller's thread).

Why a thread: the caller's own host time bounded the training step on the H200 (GPU 78 % busy,
0 syncs a step), and taking a batch there (the loader's message, the copy, the device batch's
views and KJTs) cost 0.5 ms of a 5.4 ms step (``input_wait``, 2026-12-04). The feeder does it
while the caller waits in the backward or in CUDA calls, which release the GIL: the epoch's input
wait went from 1.3-1.5 s to 0.4 s, and the loop became bound by the GPU
(``bench/results/bench_train_full_s13_h200.json``).

Correctness on CUDA, per batch:

- the copy is enqueued on the side stream and an event recorded after it; when the batch is
  handed out, the caller's current stream waits for that event (not for the whole side stream,
  which may already be copying the next batch);
- the device memory was allocated on the side stream, so the device batch is marked as used by
  the caller's stream (``record_stream``) when it is handed out: the caching allocator does not
  reuse it before the caller's work on it is done, even if the caller drops the batch early;
- the pinned host batch stays referenced until its batch is handed out (the host allocator also
  keeps a pinned block of a pending copy alive);
- the batches come out in the loader's order; an error of the loader (or of a copy) is raised
  in the caller at the batch where it happened; a caller that stops early stops the feeder
  (after the batch it is taking, if any), which then lets go of the loader, and waits for the
  feeder to end (up to :data:`JOIN_S`: a daemon thread still inside torch's C++ while the
  interpreter exits can abort the process, "terminate called without an active exception",
  the likely cause of the stream trainer's abort at SIGTERM on the H100 on 2026-12-07, not
  proven). A caller whose loader can block for good (the stream trainer's, waiting for new
  rows) ends the loader first.

One copy (``one_copy=True``, the default): a batch whose tensors all lie in one host storage (the
loader packs them so, :func:`shared.batch.pack`) is copied as one byte range, and its device
tensors are views of that copy (:func:`shared.batch.rebase`); otherwise each tensor is copied
(:meth:`Batch.to`). Elsewhere than on CUDA the batches pass through unchanged (CPU) or are moved
with :meth:`Batch.to` (other devices). Example::

    for batch in prefetch_to_device(loader.epoch(0), torch.device("cuda")):
        loss = train_step(model, optimizers, batch, ...)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from shared.batch import Batch, byte_span, rebase


@dataclass
class _InFlight:
    device_batch: Batch  # allocated on the side stream, being written by the copy
    copied: torch.cuda.Event  # recorded on the side stream after the copy
    host_batch: Batch  # kept alive until the batch is handed out
    # the device buffers to mark as used by the caller's stream: the one copy's buffer, which
    # every tensor of the batch views, or else each tensor
    buffers: list[torch.Tensor]


@dataclass
class _Failed:
    error: BaseException  # raised in the caller's thread, where the producer met it


log = logging.getLogger(__name__)
T = TypeVar("T")
JOIN_S = 30.0  # how long a caller that stopped waits for the feeder to end
_END = object()  # the items are exhausted
DEPTH = 2  # device batches the feeder keeps ready (besides the one it is copying)


def to_device(batch: Batch, device: torch.device, *, one_copy: bool = True) -> Batch:
    """``batch`` on ``device`` with non-blocking copies: one copy of the byte range its tensors
    span when they share one pinned storage and ``one_copy``, else one copy per tensor. Copies
    run on the current stream."""
    return _copy(batch, device, one_copy)[0]


def _copy(batch: Batch, device: torch.device, one_copy: bool) -> tuple[Batch, list[torch.Tensor]]:
    """(the device batch, the device buffers its tensors live in)."""
    span = byte_span(batch) if one_copy else None
    if span is None or not batch.user_index.is_pinned():
        moved = batch.to(device, non_blocking=True)
        return moved, list(moved.tensors())
    storage, first, end = span
    host = torch.empty(0, dtype=torch.uint8).set_(storage, first, (end - first,), (1,))
    buffer = host.to(device, non_blocking=True)
    return rebase(batch, buffer, first), [buffer]


def _start(
    batch: Batch, device: torch.device, stream: torch.cuda.Stream, one_copy: bool
) -> _InFlight:
    with torch.cuda.stream(stream):
        moved, buffers = _copy(batch, device, one_copy)
        copied = torch.cuda.Event()
        copied.record(stream)
    return _InFlight(moved, copied, batch, buffers)


def _hand_out(flight: _InFlight, device: torch.device) -> Batch:
    consumer = torch.cuda.current_stream(device)
    consumer.wait_event(flight.copied)
    for t in flight.buffers:
        t.record_stream(consumer)
    return flight.device_batch


def _started(batches: Iterable[Batch], device: torch.device, one_copy: bool) -> Iterator[_InFlight]:
    """Each batch with its copy started on a side stream (run by the feeder thread)."""
    stream = torch.cuda.Stream(device)
    for batch in batches:
        yield _start(batch, device, stream, one_copy)


def ahead(items: Iterator[T], depth: int, *, name: str = "prefetch") -> Iterator[T]:
    """``items``, in order, produced by a thread of their own up to ``depth`` ahead of the
    caller. An error of ``items`` is raised in the caller where it happened; a caller that
    stops early stops the thread at its next hand-over (it then lets go of ``items``).
    Example: ``for x in ahead(slow(), 2): ...`` overlaps ``slow()``'s next items with the body."""
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as error:  # noqa: BLE001 - handed to the caller, raised there
            put(_Failed(error))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := out.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()  # the thread ends at its next hand-over (a caller that stopped early)
        thread.join(JOIN_S)
        if thread.is_alive():
            log.warning("%s: the feeder thread did not end within %.0f s of the caller's stop "
                        "(its source still blocks)", name, JOIN_S)  # fmt: skip


def with_next(items: Iterable[T]) -> Iterator[tuple[T, T | None]]:
    """Each item with the one after it (None for the last): what a caller needs to start
    work on item i+1 (a CACHING table's row prefetch, ``Trainer``) once item i's is issued.
    Takes item i+1 from ``items`` before handing out item i."""
    it = iter(items)
    current = next(it, _END)
    while current is not _END:
        upcoming = next(it, _END)
        yield current, None if upcoming is _END else upcoming  # type: ignore[misc]
        current = upcoming


def prefetch_to_device(
    batches: Iterable[Batch],
    device: torch.device,
    *,
    one_copy: bool = True,
    depth: int = DEPTH,
) -> Generator[Batch, None, None]:
    """``batches`` on ``device``, in order, copied ahead by a feeder thread (see the module
    doc; ``depth`` batches ready at most). On CPU: the same Batch objects."""
    if device.type == "cpu":
        yield from batches
        return
    if device.type != "cuda":
        for batch in batches:
            yield batch.to(device, non_blocking=True)
        return
    for flight in ahead(_started(batches, device, one_copy), depth):
        yield _hand_out(flight, device)
