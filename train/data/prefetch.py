"""Batches to the device one step ahead: batch i+1's host-to-device copy runs on a side CUDA
stream while the caller computes on batch i (as TorchRec's ``TrainPipelineBase`` copies).

Correctness on CUDA, per batch:

- the copy is enqueued on the side stream and an event recorded after it; when the batch is
  handed out, the caller's current stream waits for that event (not for the whole side stream,
  which may already be copying the next batch);
- the device memory was allocated on the side stream, so each device tensor is marked as used by
  the caller's stream (``record_stream``): the caching allocator does not reuse it before the
  caller's work on it is done, even if the caller drops the batch early;
- the pinned host batch stays referenced until its batch is handed out (the host allocator also
  keeps a pinned block of a pending copy alive).

One copy (``one_copy=True``, the default): a batch whose tensors all lie in one host storage (the
loader packs them so, :func:`shared.batch.pack`) is copied as one byte range, and its device
tensors are views of that copy (:func:`shared.batch.rebase`); otherwise each tensor is copied
(:meth:`Batch.to`). Elsewhere than on CUDA the batches pass through unchanged (CPU) or are moved
with :meth:`Batch.to` (other devices). Example::

    for batch in prefetch_to_device(loader.epoch(0), torch.device("cuda")):
        loss = train_step(model, optimizers, batch, ...)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from shared.batch import Batch, byte_span, rebase


@dataclass
class _InFlight:
    device_batch: Batch  # allocated on the side stream, being written by the copy
    copied: torch.cuda.Event  # recorded on the side stream after the copy
    host_batch: Batch  # kept alive until the batch is handed out


def to_device(batch: Batch, device: torch.device, *, one_copy: bool = True) -> Batch:
    """``batch`` on ``device`` with non-blocking copies: one copy of the byte range its tensors
    span when they share one pinned storage and ``one_copy``, else one copy per tensor. Copies
    run on the current stream."""
    span = byte_span(batch) if one_copy else None
    if span is None or not batch.user_index.is_pinned():
        return batch.to(device, non_blocking=True)
    storage, first, end = span
    host = torch.empty(0, dtype=torch.uint8).set_(storage, first, (end - first,), (1,))
    return rebase(batch, host.to(device, non_blocking=True), first)


def _start(
    batch: Batch, device: torch.device, stream: torch.cuda.Stream, one_copy: bool
) -> _InFlight:
    with torch.cuda.stream(stream):
        moved = to_device(batch, device, one_copy=one_copy)
        copied = torch.cuda.Event()
        copied.record(stream)
    return _InFlight(moved, copied, batch)


def _hand_out(flight: _InFlight, device: torch.device) -> Batch:
    consumer = torch.cuda.current_stream(device)
    consumer.wait_event(flight.copied)
    for t in flight.device_batch.tensors():
        t.record_stream(consumer)
    return flight.device_batch


def prefetch_to_device(
    batches: Iterable[Batch], device: torch.device, *, one_copy: bool = True
) -> Iterator[Batch]:
    """``batches`` on ``device``, in order, the next one's copy started before this one is
    handed out (see the module doc). On CPU: the same Batch objects."""
    if device.type == "cpu":
        yield from batches
        return
    if device.type != "cuda":
        for batch in batches:
            yield batch.to(device, non_blocking=True)
        return
    stream = torch.cuda.Stream(device)
    ahead: _InFlight | None = None
    for batch in batches:
        flight = _start(batch, device, stream, one_copy)
        if ahead is not None:
            yield _hand_out(ahead, device)
        ahead = flight
    if ahead is not None:
        yield _hand_out(ahead, device)
