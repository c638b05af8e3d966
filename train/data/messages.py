"""What a loader worker makes and sends: a rank's part of a global batch as a
:class:`~shared.batch.Batch` (:func:`rank_batch`), and messages of a few consecutive batches
(:class:`Message`, :data:`MESSAGE_ROWS` rows, :func:`message_batches`) whose tensors are packed
into one shared-memory buffer (:class:`Packed`, sent by :class:`Sender`).

One file descriptor per message instead of one per tensor (the descriptor handshake was the main
process's largest cost), and one copy to pin it; the main process builds each batch once, as
views of the buffer or of its pinned copy. A worker keeps its last :data:`KEPT_BUFFERS` buffers
referenced, so that it, rather than the main process, usually frees their pages. Used by both
datasets (:mod:`train.data.streams`, :mod:`train.data.in_order`); the loaders that run them are
in :mod:`train.data.loader`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch, pack
from shared.features import FeatureSet
from shared.fg import FgStats, table_to_batch
from train.data.memory import shared_buffer
from train.data.plan import part_range

# rows of the batches a worker sends in one message (whole batches, at least one): bigger
# messages spread the per-message cost over more rows, and hold more memory in flight
MESSAGE_ROWS = 32_768
# shared buffers a worker keeps referenced after sending them (its newest ones): by the time it
# drops one, the main process has usually dropped it too (the DataLoader asks a worker for at
# most 2 messages ahead, and the main process takes a whole round of messages before the next),
# so the worker, not the main process, frees its pages (~0.6 ms per 9 MB message, in munmap)
KEPT_BUFFERS = 4


# (storage offset in elements, dtype, shape, strides) of one tensor of a packed buffer
_Slot = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]
# keys, stride, length_per_key, offset_per_key, and which of lengths, offsets, weights are set
_KjtLayout = tuple[list[str], int, list[int] | None, list[int] | None, tuple[bool, bool, bool]]
# user, item, sequence, labels set, oracle set, rows_are_users
_BatchLayout = tuple[_KjtLayout, _KjtLayout, _KjtLayout, bool, bool, bool]


def _kjt_parts(kjt: KeyedJaggedTensor) -> tuple[_KjtLayout, list[torch.Tensor]]:
    """``kjt``'s host metadata and its tensors (values, then lengths, offsets, weights where
    set): what :func:`_kjt_of` rebuilds it from, as :func:`shared.batch.rebase` keeps it."""
    optional = (kjt.lengths_or_none(), kjt.offsets_or_none(), kjt.weights_or_none())
    layout: _KjtLayout = (
        kjt.keys(),
        kjt.stride(),
        kjt.length_per_key_or_none(),
        kjt.offset_per_key_or_none(),
        (optional[0] is not None, optional[1] is not None, optional[2] is not None),
    )
    return layout, [kjt.values(), *(t for t in optional if t is not None)]


def _kjt_of(layout: _KjtLayout, tensors: Iterator[torch.Tensor]) -> KeyedJaggedTensor:
    """The KJT of :func:`_kjt_parts`, its tensors taken from ``tensors`` in that order and its
    per-key lengths and offsets given (nothing is recomputed from the tensors)."""
    keys, stride, length_per_key, offset_per_key, (has_lengths, has_offsets, has_weights) = layout
    values = next(tensors)
    lengths = next(tensors) if has_lengths else None
    offsets = next(tensors) if has_offsets else None
    weights = next(tensors) if has_weights else None
    return KeyedJaggedTensor(
        keys=keys,
        values=values,
        weights=weights,
        lengths=lengths,
        offsets=offsets,
        stride=stride,
        length_per_key=length_per_key,
        offset_per_key=offset_per_key,
    )


def _batch_parts(batch: Batch) -> tuple[_BatchLayout, list[torch.Tensor]]:
    """``batch``'s layout (:data:`_BatchLayout`) and its tensors in the order :func:`_batch_of`
    takes them."""
    kjts = [_kjt_parts(k) for k in (batch.user, batch.item, batch.sequence)]
    dense = [t for t in (batch.user_index, batch.labels, batch.oracle) if t is not None]
    layout: _BatchLayout = (
        kjts[0][0],
        kjts[1][0],
        kjts[2][0],
        batch.labels is not None,
        batch.oracle is not None,
        batch.rows_are_users,
    )
    return layout, [t for _, ts in kjts for t in ts] + dense


def _batch_of(layout: _BatchLayout, tensors: Iterator[torch.Tensor]) -> Batch:
    """The Batch of :func:`_batch_parts`, its tensors taken from ``tensors``."""
    user, item, sequence, has_labels, has_oracle, rows_are_users = layout
    return Batch(
        user=_kjt_of(user, tensors),
        item=_kjt_of(item, tensors),
        sequence=_kjt_of(sequence, tensors),
        user_index=next(tensors),
        labels=next(tensors) if has_labels else None,
        oracle=next(tensors) if has_oracle else None,
        rows_are_users=rows_are_users,
    )


@dataclass(frozen=True)
class Packed:
    """Batches packed into one buffer (:func:`shared.batch.pack`), as the buffer and where each
    tensor lies in it: what a worker sends. Pickled, it is one tensor (one file descriptor) and
    plain tuples, where the batches themselves pickle every tensor and KJT, each rebuilt in the
    main process (~36 tensors a message). The main process builds the batches once, as views of
    the buffer it uses them from (the shared one, or its pinned copy: :meth:`pinned`), with the
    KJTs' per-key lengths and offsets as the worker computed them.

    Views of the shared buffer are safe to hand out: a worker allocates a new buffer for every
    message (:func:`~train.data.memory.shared_buffer`) and never writes to one it has sent (it
    only keeps the newest ones referenced: :data:`KEPT_BUFFERS`); the buffer is freed when the
    last process lets go of it."""

    buffer: torch.Tensor  # [nbytes] uint8, a whole storage (offset 0)
    layouts: tuple[_BatchLayout, ...]  # one per batch
    slots: tuple[_Slot, ...]  # every batch's tensors, in :func:`_batch_parts` order

    @classmethod
    def of(cls, batches: list[Batch], alloc: Callable[[int], torch.Tensor]) -> Packed:
        """``batches`` packed into ``alloc(nbytes)`` (in a worker: shared memory)."""
        parts = [_batch_parts(b) for b in pack(batches, alloc)]
        storage = parts[0][1][0].untyped_storage()
        slots = tuple(
            (int(t.storage_offset()), t.dtype, tuple(t.shape), t.stride())
            for _, ts in parts
            for t in ts
        )
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        return cls(buffer, tuple(layout for layout, _ in parts), slots)

    def pinned(self) -> Packed:
        """The same batches in a pinned copy of the buffer (one copy)."""
        return Packed(self.buffer.pin_memory(), self.layouts, self.slots)

    def unpack(self) -> list[Batch]:
        """The batches, their tensors views of :attr:`buffer` (contiguous, as packed)."""
        storage, device = self.buffer.untyped_storage(), self.buffer.device
        tensors = (
            torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
            for offset, dtype, shape, stride in self.slots
        )
        return [_batch_of(layout, tensors) for layout in self.layouts]


@dataclass
class Message:
    """Consecutive batches of one stream and their fg defaults: packed (:class:`Packed`) when
    a worker sends them, a list in this process."""

    batches: list[Batch] | Packed
    stats: FgStats

    def pin_memory(self) -> Message:
        """Pinned, the batches built (called by the DataLoader's pin-memory thread, so that the
        main thread only takes them): one copy of a packed buffer, the batches views of it."""
        if isinstance(self.batches, Packed):
            return Message(self.batches.pinned().unpack(), self.stats)
        return Message([b.pin_memory() for b in self.batches], self.stats)

    def unpacked(self) -> list[Batch]:
        """The batches (views of the packed buffer when packed)."""
        return self.batches.unpack() if isinstance(self.batches, Packed) else self.batches


def _pinned_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class Sender:
    """How a dataset's iterator sends its messages: packed into shared memory in a worker (the
    last ``KEPT_BUFFERS`` buffers kept), into pinned memory in the main process when pinning, else
    as they are."""

    def __init__(self, in_worker: bool, pin_memory: bool) -> None:
        self.in_worker, self.pin_memory = in_worker, pin_memory
        self.kept: collections.deque[torch.Tensor] = collections.deque(maxlen=KEPT_BUFFERS)

    def message(self, batches: list[Batch], stats: FgStats) -> Message:
        if self.in_worker:
            packed = Packed.of(batches, shared_buffer)
            self.kept.append(packed.buffer)
            return Message(packed, stats)
        return Message(pack(batches, _pinned_buffer) if self.pin_memory else batches, stats)


def message_batches(batch_size: int, message_rows: int = MESSAGE_ROWS) -> int:
    """Batches of ``batch_size`` rows in one worker message of about ``message_rows`` rows."""
    return max(1, message_rows // batch_size)


def rank_batch(
    fs: FeatureSet, table: pa.Table, rank: int, world_size: int, stats: FgStats
) -> Batch:
    """Rank ``rank``'s part of the global batch ``table`` (all of it for one process), its
    feature-generation defaults counted in ``stats``."""
    if world_size > 1:
        table = table.slice(*part_range(table.num_rows, rank, world_size))
    return table_to_batch(fs, table, stats=stats)
