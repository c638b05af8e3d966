"""Sample Parquet → shuffled :class:`~shared.batch.Batch` es of ``batch_size``, with worker processes.

Shuffled (the default for training), the order of an epoch is a pure function of (files, seed,
epoch, num_workers, batch_size, shuffle_rows), computed from Parquet metadata alone:

1. the row groups of all files are permuted with ``(seed, epoch)``;
2. consecutive row groups are grouped into *windows* of at least ``shuffle_rows`` rows, and window
   ``i`` goes to stream ``i % num_workers``;
3. a stream reads its windows in turn, permutes each window's rows with ``(seed, epoch, i)`` and
   cuts its row sequence into batches (a batch may span two windows; the last may be short);
4. the torch DataLoader interleaves the streams round-robin (in order; exhausted streams drop out).

A worker sends its batches in messages of a few consecutive ones (:data:`MESSAGE_ROWS`), their
tensors packed into one shared-memory buffer (:func:`shared.batch.pack`): one file descriptor per
message instead of one per tensor (the descriptor handshake was the main process's largest cost),
and one copy to pin it. The message is that buffer and where each tensor lies in it
(:class:`_Packed`): the main process builds each batch once, as views of the buffer or of its
pinned copy, instead of rebuilding every pickled tensor. A worker keeps its last
:data:`KEPT_BUFFERS` buffers referenced, so that it, rather than the main process, usually frees
their pages. :func:`interleave` turns the round-robin over messages back into the round-robin
over batches of step 4, so the order does not depend on the message size.

Because every stream's batch count follows from metadata, :meth:`Loader.epoch` can start at batch
``k`` cheaply (resume): each stream skips whole windows without reading them, reads the window it
resumes in, and the streams are rotated so that the interleaving continues where it stopped.
Changing ``num_workers`` changes the shuffled order, so resume with the same value. A
``num_workers`` above the CPU cores this process may use is lowered to them
(:func:`usable_workers`, one log line), so resume on a machine with as many cores, or pass a
value it has.

**Shuffle off** (``shuffle=False``: evaluation, and training with ``data_config.shuffle: false``,
for time-ordered data): every epoch is the files' rows in file order (files by name, then row
groups and rows as stored), cut into batches of ``batch_size`` across row-group and file ends,
only the last one short: the batches one worker reading the files front to back cuts, for any
``num_workers`` (and any ``seed``, ``shuffle_rows``, ``message_rows``), tensor for tensor. The
row sequence is cut into slices of whole batches, one worker message each, that the workers take
in turn, read by online training's in-order machinery (:class:`_InOrder`, at the end of this
module): the DataLoader's round-robin over its workers returns them in slice order, so the
workers share the reading without interleaving anything. A slice ends where a row group ends
(rounded up to a whole batch) once it has ``message_rows`` rows (:func:`in_order_slices`), so
each row group is decoded about once, and a message may hold up to a row group more than
``message_rows``. Resume from batch ``k`` starts at row
``k × batch_size``, with any ``num_workers``. (Before issue #55 the windows of an unshuffled
epoch went to the workers as the shuffled ones do, and only one worker gave the file order.)

Distributed training (``rank``/``world_size``): every rank plays the same sequence of *global*
batches of ``batch_size × world_size`` rows and keeps the contiguous part ``rank`` of each (parts
differ by at most one row in a short batch), converting only that part to tensors. So the global
batch of a step is the concatenation of the ranks' batches in rank order, and equals the batch a
``world_size=1`` loader with ``batch_size × world_size`` gives (same seed, workers, files): the
property that makes ``W`` ranks comparable with one process. Every rank reads every window (the
Parquet decode and shuffle are about a third of a worker's CPU per row, packing a tenth; feature
generation, the rest, is split: ``python -m bench.bench_loader`` reports the parts) and all
ranks get the same number of batches, so no rank waits for another at the end of an epoch. A
short global batch of fewer than ``world_size`` rows is dropped.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import itertools
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from protos import pipeline_pb2
from shared.batch import Batch, pack
from shared.features import FeatureSet
from shared.fg import ORACLE_COLUMN, FgStats, table_to_batch
from train.data.memory import keep_freed_memory, shared_buffer

log = logging.getLogger(__name__)
_CLAMPS_SAID: set[tuple[int, int]] = set()  # (asked, cores) already logged in this process
# rows of the batches a worker sends in one message (whole batches, at least one): bigger
# messages spread the per-message cost over more rows, and hold more memory in flight
MESSAGE_ROWS = 32_768
# shared buffers a worker keeps referenced after sending them (its newest ones): by the time it
# drops one, the main process has usually dropped it too (the DataLoader asks a worker for at
# most 2 messages ahead, and the main process takes a whole round of messages before the next),
# so the worker, not the main process, frees its pages (~0.6 ms per 9 MB message, in munmap)
KEPT_BUFFERS = 4


def usable_workers(requested: int, cores: int | None = None) -> int:
    """``requested`` worker processes, lowered to the CPU cores this process may use
    (``cores``, default: its affinity), saying so once per process and value: more processes
    than cores only compete (torch warns about it) and the seed config asks for 8."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(cores or 1, 1)
    if requested <= cores:
        return requested
    if (requested, cores) not in _CLAMPS_SAID:
        _CLAMPS_SAID.add((requested, cores))
        log.info(
            "num_workers %d is more than the %d CPU cores here; using %d loader workers "
            "(the batch order follows this number: resume with as many)",
            requested,
            cores,
            cores,
        )
    return cores


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    rows: int


@dataclass(frozen=True)
class Window:
    """Row groups whose rows are shuffled together; ``index`` seeds the shuffle."""

    index: int
    groups: tuple[RowGroup, ...]

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)


def list_row_groups(path: str | Path) -> list[RowGroup]:
    """Row groups of ``path`` (a Parquet file, or a directory of ``*.parquet``), in name order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such samples file or directory; build it with python -m train.data "
            "build, or point --train/--eval (or the config's *_input_path) at it"
        )
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no Parquet files (expected part-*.parquet)")
    groups = []
    for f in files:
        meta = pq.ParquetFile(f).metadata
        groups += [
            RowGroup(str(f), i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)
        ]
    return groups


def plan_streams(
    groups: list[RowGroup], *, streams: int, shuffle: bool, seed: int, epoch: int, shuffle_rows: int
) -> list[list[Window]]:
    """The windows of each stream for one epoch (steps 1–2 of the module doc)."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(len(groups))
        if shuffle
        else range(len(groups))
    )
    windows: list[Window] = []
    pending: list[RowGroup] = []
    for i in order:
        pending.append(groups[i])
        if sum(g.rows for g in pending) >= shuffle_rows:
            windows.append(Window(len(windows), tuple(pending)))
            pending = []
    if pending:
        windows.append(Window(len(windows), tuple(pending)))
    return [windows[s::streams] for s in range(streams)]


def in_order_slices(
    groups: list[RowGroup], rows: int, batch_size: int, min_rows: int
) -> list[tuple[int, int]]:
    """(start, end) of the slices of an unshuffled epoch: its first ``rows`` rows in file order
    (``groups`` in order), cut where a row group ends once a slice has ``min_rows`` rows,
    rounded up to a whole batch so that every slice starts a batch. A worker reading a slice
    decodes its row groups once, the rows before its start (less than a batch, the previous
    slice's) in its first one, and the head of the next group (:func:`_file_rows`); slices cut
    at ``min_rows`` alone would split each large row group between workers that all decode it
    (a third more CPU per row with groups of twice the message rows)."""
    bounds, at, last = [], 0, 0
    for g in groups:
        at += g.rows
        end = min(-(-at // batch_size) * batch_size, rows)
        if at - last >= min_rows and end > last:
            bounds.append((last, end))
            last = end
    if last < rows:
        bounds.append((last, rows))
    return bounds


def _stream_batches(rows: int, batch_size: int, drop_last: bool, min_rows: int = 1) -> int:
    return rows // batch_size + (0 if drop_last or rows % batch_size < min_rows else 1)


def part_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of rank ``rank``'s contiguous part of a global batch of ``rows``."""
    base, extra = divmod(rows, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def resume_point(counts: list[int], skip: int) -> tuple[list[int], list[int]]:
    """Where a round-robin over streams with ``counts`` batches stands after ``skip`` batches.

    Returns per stream the batches already taken, and the stream order that continues the
    interleaving (a DataLoader always starts its round-robin at worker 0). Round ``r`` takes one
    batch from each stream with ``counts > r``, in stream order.
    """
    taken = [0] * len(counts)
    rnd, left = 0, skip
    while True:
        active = [s for s in range(len(counts)) if counts[s] > rnd]
        if not active or left == 0:
            return taken, active + [s for s in range(len(counts)) if s not in active]
        full = min(min(counts[s] for s in active) - rnd, left // len(active))
        if full == 0:  # stop inside round `rnd`: continue with the rest of it
            done, rest = active[:left], active[left:]
            for s in done:
                taken[s] += 1
            return taken, rest + done + [s for s in range(len(counts)) if s not in active]
        for s in active:
            taken[s] += full
        rnd, left = rnd + full, left - full * len(active)


def interleave(messages: Iterator[list[Batch]], counts: list[int]) -> Iterator[Batch]:
    """The batches of a round-robin over streams (step 4 of the module doc), from the
    round-robin over their messages: ``counts[i]`` messages from DataLoader slot ``i``, each of
    consecutive batches of its stream, all of the same length but a stream's last one.

    Message round ``j`` holds message ``j`` of every slot with ``counts > j``, in slot order; batch
    ``r`` of those messages is batch round ``j·k + r``, which takes one batch from each stream
    whose message has more than ``r``.
    """
    for j in range(max(counts, default=0)):
        group = [next(messages, None) for c in counts if c > j]
        if any(g is None for g in group):
            raise RuntimeError(
                f"loader: the workers sent fewer messages than the epoch plan's {sum(counts)}; "
                "were the Parquet files changed during the epoch?"
            )
        msgs: list[list[Batch]] = [g for g in group if g is not None]
        for r in range(max(map(len, msgs))):
            yield from (m[r] for m in msgs if r < len(m))


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
class _Packed:
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
    def of(cls, batches: list[Batch], alloc: Callable[[int], torch.Tensor]) -> _Packed:
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

    def pinned(self) -> _Packed:
        """The same batches in a pinned copy of the buffer (one copy)."""
        return _Packed(self.buffer.pin_memory(), self.layouts, self.slots)

    def unpack(self) -> list[Batch]:
        """The batches, their tensors views of :attr:`buffer` (contiguous, as packed)."""
        storage, device = self.buffer.untyped_storage(), self.buffer.device
        tensors = (
            torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
            for offset, dtype, shape, stride in self.slots
        )
        return [_batch_of(layout, tensors) for layout in self.layouts]


@dataclass
class _Message:
    """Consecutive batches of one stream and their fg defaults: packed (:class:`_Packed`) when
    a worker sends them, a list in this process."""

    batches: list[Batch] | _Packed
    stats: FgStats

    def pin_memory(self) -> _Message:
        """Pinned, the batches built (called by the DataLoader's pin-memory thread, so that the
        main thread only takes them): one copy of a packed buffer, the batches views of it."""
        if isinstance(self.batches, _Packed):
            return _Message(self.batches.pinned().unpack(), self.stats)
        return _Message([b.pin_memory() for b in self.batches], self.stats)

    def unpacked(self) -> list[Batch]:
        """The batches (views of the packed buffer when packed)."""
        return self.batches.unpack() if isinstance(self.batches, _Packed) else self.batches


def _worker_init(_worker_id: int) -> None:
    """Keep freed arrays for reuse in the worker (:func:`~train.data.memory.keep_freed_memory`)."""
    keep_freed_memory()


@functools.cache
def _freeze_inherited_objects_at_fork() -> None:
    """From now on, a child forked from this process (a DataLoader worker) leaves the objects it
    inherits out of its garbage collection, from its first instruction on: a full collection over
    them (~340K objects) took ~350 ms and copied their pages, and a collection that frees an
    inherited CUDA object (a model's CUDA graph left in a reference cycle, e.g. by a model trained
    earlier in the same process) kills the worker with a CUDA initialization error. Registered
    once per process; objects the child makes are collected as usual."""
    os.register_at_fork(after_in_child=gc.freeze)


def _pinned_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _Sender:
    """How a dataset's iterator sends its messages: packed into shared memory in a worker (the
    last ``KEPT_BUFFERS`` buffers kept), into pinned memory in the main process when pinning, else
    as they are."""

    def __init__(self, in_worker: bool, pin_memory: bool) -> None:
        self.in_worker, self.pin_memory = in_worker, pin_memory
        self.kept: collections.deque[torch.Tensor] = collections.deque(maxlen=KEPT_BUFFERS)

    def message(self, batches: list[Batch], stats: FgStats) -> _Message:
        if self.in_worker:
            packed = _Packed.of(batches, shared_buffer)
            self.kept.append(packed.buffer)
            return _Message(packed, stats)
        return _Message(pack(batches, _pinned_buffer) if self.pin_memory else batches, stats)


def message_batches(batch_size: int, message_rows: int = MESSAGE_ROWS) -> int:
    """Batches of ``batch_size`` rows in one worker message of about ``message_rows`` rows."""
    return max(1, message_rows // batch_size)


class _Batches(IterableDataset):
    """One DataLoader worker slot: plays the stream that ``assignment`` gives it."""

    def __init__(
        self,
        fs: FeatureSet,
        streams: list[list[Window]],
        assignment: list[int],
        skips: list[int],
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        epoch: int,
        drop_last: bool,
        columns: list[str],
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
        message_batches: int = 1,
    ) -> None:
        self.message_batches = message_batches
        self.fs, self.streams, self.assignment, self.skips = fs, streams, assignment, skips
        self.batch_size, self.shuffle, self.seed, self.epoch = batch_size, shuffle, seed, epoch
        self.drop_last, self.columns = drop_last, columns
        self.rank, self.world_size, self.pin_memory = rank, world_size, pin_memory

    def __iter__(self) -> Iterator[_Message]:
        """Messages of ``message_batches`` batches: packed into shared memory in a worker,
        into pinned memory in the main process when pinning, else as they are."""
        info = get_worker_info()
        stream = self.assignment[info.id if info is not None else 0]
        played = self._play(self.streams[stream], self.skips[stream] * self.batch_size)
        sender = _Sender(info is not None, self.pin_memory)
        while chunk := list(itertools.islice(played, self.message_batches)):
            stats = FgStats()
            for _, s in chunk:
                stats.merge(s)
            yield sender.message([b for b, _ in chunk], stats)

    def _read(self, window: Window) -> pa.Table:
        """The rows of ``window``, shuffled. One thread: a worker is one of a process per core,
        and Arrow's thread pool only added CPU (about 30 % more for the same decode)."""
        tables = [
            self._file(g.path).read_row_group(g.index, columns=self.columns, use_threads=False)
            for g in window.groups
        ]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, window.index])
            table = table.take(pa.array(rng.permutation(table.num_rows)))
        return table

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "_files"}  # open files stay here

    def _file(self, path: str) -> pq.ParquetFile:
        """``path`` opened once per worker (its footer parsed once, not once per row group)."""
        files: dict[str, pq.ParquetFile] = self.__dict__.setdefault("_files", {})
        if path not in files:
            files[path] = pq.ParquetFile(path)
        return files[path]

    def _play(self, windows: list[Window], skip_rows: int) -> Iterator[tuple[Batch, FgStats]]:
        carry: pa.Table | None = None
        for window in windows:
            if skip_rows >= window.rows:  # resume: skipped without reading
                skip_rows -= window.rows
                continue
            table = self._read(window).slice(skip_rows)
            skip_rows = 0
            if carry is not None:
                table = pa.concat_tables([carry, table])
            start = 0
            while table.num_rows - start >= self.batch_size:
                yield self._batch(table.slice(start, self.batch_size))
                start += self.batch_size
            carry = table.slice(start) if start < table.num_rows else None
        if carry is not None and carry.num_rows >= self.world_size and not self.drop_last:
            yield self._batch(carry)

    def _batch(self, table: pa.Table) -> tuple[Batch, FgStats]:
        stats = FgStats()
        return _rank_batch(self.fs, table, self.rank, self.world_size, stats), stats


def _rank_batch(
    fs: FeatureSet, table: pa.Table, rank: int, world_size: int, stats: FgStats
) -> Batch:
    """Rank ``rank``'s part of the global batch ``table`` (all of it for one process), its
    feature-generation defaults counted in ``stats``."""
    if world_size > 1:
        table = table.slice(*part_range(table.num_rows, rank, world_size))
    return table_to_batch(fs, table, stats=stats)


def _identity(x: object) -> object:
    return x


class Loader:
    """Batches of one split for training or evaluation.

    ``shuffle``: False reads the files' rows in order, the same batches for any
    ``num_workers`` (module doc, "Shuffle off").
    ``shuffle_rows``: rows shuffled together (a window of whole row groups; see the module doc).
    ``message_rows``: rows of the whole batches a worker sends at once (no effect on the order;
    unshuffled, at least that many, up to the end of a row group).
    ``stats`` accumulates the feature-generation defaults of all batches (workers included).
    Example::

        loader = Loader("data/small/samples/train", fs, batch_size=8192, num_workers=2)
        for batch in loader.epoch(0):  # resume mid-epoch: loader.epoch(0, skip_batches=k)
            ...
        print(loader.stats.report())
    """

    def __init__(
        self,
        path: str | Path,
        fs: FeatureSet,
        *,
        batch_size: int,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_rows: int = 262_144,
        drop_last: bool = False,
        pin_memory: bool | None = None,
        rank: int = 0,
        world_size: int = 1,
        message_rows: int = MESSAGE_ROWS,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if message_rows < 1:
            raise ValueError(
                f"message_rows must be >= 1 (rows a worker sends at once), got {message_rows}"
            )
        num_workers = usable_workers(num_workers)
        self.fs = fs
        self.groups = list_row_groups(path)
        rows_of: dict[str, int] = {}
        for g in self.groups:
            rows_of[g.path] = rows_of.get(g.path, 0) + g.rows
        self.files = tuple(rows_of.items())  # (path, rows) in name order: the unshuffled order
        schema = pq.read_schema(self.groups[0].path)
        self.columns = [*fs.columns(), *([ORACLE_COLUMN] if ORACLE_COLUMN in schema.names else [])]
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise ValueError(
                f"{path}: columns {missing} missing; rebuild the samples for this config"
            )
        self.batch_size, self.num_workers, self.shuffle, self.seed = (
            batch_size,
            num_workers,
            shuffle,
            seed,
        )
        self.shuffle_rows, self.drop_last = shuffle_rows, drop_last
        self.rank, self.world_size, self.message_rows = rank, world_size, message_rows
        self.global_batch_size = batch_size * world_size  # rows of one step over all ranks
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.stats = FgStats()

    @classmethod
    def from_config(
        cls,
        config: pipeline_pb2.EasyRecConfig,
        fs: FeatureSet,
        split: str,
        **overrides: object,
    ) -> Loader:
        """Loader of ``train_input_path`` (split "train", shuffled unless
        ``data_config.shuffle`` is false) or ``eval_input_path`` (in file order)."""
        path = {"train": config.train_input_path, "eval": config.eval_input_path}[split]
        options: dict = {
            "batch_size": config.data_config.batch_size or 8192,
            "num_workers": config.data_config.num_workers,
            "shuffle": split == "train" and config.data_config.shuffle,
        }
        return cls(path, fs, **(options | overrides))

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def _streams(self, epoch: int) -> list[list[Window]]:
        return plan_streams(
            self.groups,
            # unshuffled: one stream, the files' row sequence, whatever the workers (_in_order)
            streams=max(self.num_workers, 1) if self.shuffle else 1,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            shuffle_rows=self.shuffle_rows,
        )

    def num_batches(self, epoch: int = 0) -> int:
        """Batches in an epoch (partial batches at the end of each worker's stream count)."""
        return len(self.batch_rows(epoch))

    def batch_rows(self, epoch: int = 0) -> list[int]:
        """Rows of each global batch of ``epoch`` (all ranks together), in order; from metadata."""
        gb, w = self.global_batch_size, self.world_size
        sizes = []
        for s in self._streams(epoch):
            rows = sum(win.rows for win in s)
            n = _stream_batches(rows, gb, self.drop_last, w)
            sizes.append([gb] * (rows // gb) + [rows % gb] * (n - rows // gb))
        return [s[i] for i in range(max(map(len, sizes), default=0)) for s in sizes if i < len(s)]

    def dataset(
        self,
        epoch: int,
        streams: list[list[Window]],
        order: list[int],
        taken: list[int],
        cls: type[_Batches] | None = None,
    ) -> _Batches:
        """The DataLoader dataset of ``epoch``'s ``streams`` (played in ``order``, ``taken``
        batches of each skipped), as ``cls`` (default :class:`_Batches`; a benchmark's subclass
        times its steps) with this loader's settings."""
        return (cls or _Batches)(
            self.fs,
            streams,
            order,
            taken,
            batch_size=self.global_batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            drop_last=self.drop_last,
            columns=self.columns,
            rank=self.rank,
            world_size=self.world_size,
            pin_memory=self.pin_memory,
            message_batches=message_batches(self.global_batch_size, self.message_rows),
        )

    def epoch(self, epoch: int, *, skip_batches: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch``, from batch ``skip_batches`` on (same order as without skip).

        The workers start at this call, not at the first ``next()``: a caller can start them
        before other set-up (the trainer does so before it builds the model), so that their
        first batches are read meanwhile, and they fork from a process without CUDA yet."""
        plan = self._shuffled if self.shuffle else self._in_order
        dataset, messages = plan(epoch, skip_batches)
        if self.num_workers == 0:
            received: Iterator[_Message] = iter(dataset)
        else:
            _freeze_inherited_objects_at_fork()
            received = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    collate_fn=_identity,
                    worker_init_fn=_worker_init,
                    pin_memory=self.pin_memory,
                )
            )  # the workers start here
        return self._played(received, messages)

    def _shuffled(self, epoch: int, skip_batches: int) -> tuple[_Batches, list[int]]:
        """The dataset of a shuffled epoch (a stream per worker, steps 1–4 of the module doc)
        and the messages of each DataLoader slot (for :func:`interleave`)."""
        streams = self._streams(epoch)
        counts = [
            _stream_batches(
                sum(w.rows for w in s), self.global_batch_size, self.drop_last, self.world_size
            )
            for s in streams
        ]
        taken, order = resume_point(counts, skip_batches)
        k = message_batches(self.global_batch_size, self.message_rows)
        messages = [-(-(counts[s] - taken[s]) // k) for s in order]  # per DataLoader slot
        return self.dataset(epoch, streams, order, taken), messages

    def _in_order(self, epoch: int, skip_batches: int) -> tuple[_InOrder, list[int]]:
        """The dataset of an unshuffled epoch: the files' rows as one sequence, cut into
        slices of whole batches at row-group ends (:func:`in_order_slices`; one message each)
        that the workers take in turn, read by the stream's in-order machinery
        (:class:`_InOrder`); and its messages as one stream's (they arrive in slice order).
        Every epoch is the same; resume starts at row ``skip_batches × global batch`` (every
        batch but the last is whole)."""
        gb = self.global_batch_size
        rows = sum(self.batch_rows(epoch))  # without a last batch dropped (drop_last, ranks)
        step = message_batches(gb, self.message_rows) * gb
        begin = min(skip_batches * gb, rows)
        slices = [
            RowSlice(self.files, max(first, begin), end - max(first, begin), gb)
            for first, end in in_order_slices(self.groups, rows, gb, step)
            if end > begin
        ]
        slots = max(self.num_workers, 1)
        tasks: list[object] = [_Planned(slices[w::slots]) for w in range(slots)]
        dataset = _InOrder(
            self.fs,
            self.columns,
            tasks,
            self.pin_memory,
            rank=self.rank,
            world_size=self.world_size,
        )
        return dataset, [len(slices)]

    def _played(self, received: Iterator[_Message], messages: list[int]) -> Iterator[Batch]:
        """The batches of the workers' ``received`` messages in the epoch plan's order."""

        def unpacked() -> Iterator[list[Batch]]:
            for message in received:
                self.stats.merge(message.stats)
                yield message.unpacked()

        batches = unpacked()
        yield from interleave(batches, messages)
        for _ in batches:  # runs the DataLoader to its end (and its workers to their exit)
            raise RuntimeError(
                "loader: the workers sent more messages than the epoch plan's; were the Parquet "
                "files changed during the epoch?"
            )


# --------------------------------------------------------------------------- in order
# Online training (train.stream) reads a growing source in row order: no shuffle, no epochs,
# and the rows to read are known only as they land. The same workers, messages and pinned
# copies as above play *slices* (consecutive rows of a partition's files) that the caller
# hands out while the loader runs, slice ``i`` to worker ``i % W``: the DataLoader's
# round-robin over its workers then returns the messages in slice order, so the batches come
# in row order and the caller knows which rows each batch holds. An unshuffled epoch of
# :class:`Loader` is played the same way, its slices planned before it starts (_Planned).


@dataclass(frozen=True)
class RowSlice:
    """Rows ``start .. start + rows`` of ``files`` (``(path, rows)`` each, read as one row
    sequence in this order), cut into batches of ``batch_size`` (the last may be short)."""

    files: tuple[tuple[str, int], ...]
    start: int
    rows: int
    batch_size: int

    def batch_rows(self) -> list[int]:
        full, rest = divmod(self.rows, self.batch_size)
        return [self.batch_size] * full + ([rest] if rest else [])


class _Planned:
    """The slices of one worker slot known before the epoch starts (an unshuffled epoch of
    :class:`Loader`), handed out as a task queue of :class:`InOrderLoader` hands them: ``get``
    returns the next, then None (the end). Each worker process gets its own copy at fork."""

    def __init__(self, slices: list[RowSlice]) -> None:
        self.slices, self.next = slices, 0

    def get(self) -> RowSlice | None:
        if self.next == len(self.slices):
            return None
        self.next += 1
        return self.slices[self.next - 1]


class _InOrder(IterableDataset):
    """One DataLoader worker slot: plays the slices its task source hands it (``get()``; None:
    the end): a queue the caller fills while the loader runs (:class:`InOrderLoader`), or the
    slices planned for an unshuffled epoch (:class:`_Planned`). Slice ``i`` goes to slot
    ``i % W``, so the DataLoader's round-robin over its workers returns the messages in slice
    order. With ``world_size > 1`` every rank reads every slice and keeps its part of each
    batch (:func:`part_range`), as :class:`_Batches` does."""

    def __init__(
        self,
        fs: FeatureSet,
        columns: list[str],
        tasks: list[object],
        pin_memory: bool,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.fs, self.columns, self.tasks, self.pin_memory = fs, columns, tasks, pin_memory
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[_Message]:
        info = get_worker_info()
        tasks = self.tasks[info.id if info is not None else 0]
        sender = _Sender(info is not None, self.pin_memory)
        files: dict[str, pq.ParquetFile] = {}
        while (task := tasks.get()) is not None:  # type: ignore[attr-defined]
            table, start = self._read(task, files), 0
            batches, stats = [], FgStats()
            for rows in task.batch_rows():
                part = table.slice(start, rows)
                batches.append(_rank_batch(self.fs, part, self.rank, self.world_size, stats))
                start += rows
            yield sender.message(batches, stats)

    def _read(self, task: RowSlice, files: dict[str, pq.ParquetFile]) -> pa.Table:
        """The slice's rows: only the row groups they lie in are decoded (:func:`_file_rows`)."""
        parts, start, left = [], task.start, task.rows
        for path, n in task.files:
            if start >= n:
                start -= n
                continue
            if path not in files:
                if len(files) >= 64:  # a long stream: forget the oldest partitions' files
                    files.pop(next(iter(files)))
                files[path] = pq.ParquetFile(path)
            parts.append(_file_rows(files[path], start, min(left, n - start), self.columns))
            left -= parts[-1].num_rows
            start = 0
            if left == 0:
                break
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _file_rows(f: pq.ParquetFile, start: int, rows: int, columns: list[str]) -> pa.Table:
    """Rows ``start .. start + rows`` of ``f``. Only the row groups they lie in are decoded, and
    of the last one only its head when they need at most half of it: an unshuffled epoch's
    slice ends a little into the next row group (to finish the batch that spans the two). On
    the small synthetic data (row groups of 65,536 rows) a group decodes in 17 ms, its first
    8,192 rows streamed alone in 4 ms, its first half in 11 ms: streaming costs more per row,
    so a larger head is read with its group."""
    end, seen, first, last = start + rows, 0, 0, 0
    groups: list[int] = []
    for i in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(i).num_rows
        if seen + n > start and seen < end:
            first = seen if not groups else first
            groups.append(i)
            last = seen
        seen += n
    head = end - last  # rows needed of the last group, from its start
    if 2 * head > f.metadata.row_group(groups[-1]).num_rows:
        table = f.read_row_groups(groups, columns=columns, use_threads=False)
    else:
        whole = [f.read_row_groups(groups[:-1], columns=columns, use_threads=False)]
        batches, got = [], 0
        for batch in f.iter_batches(
            batch_size=head, row_groups=groups[-1:], columns=columns, use_threads=False
        ):
            batches.append(batch)
            got += batch.num_rows
            if got >= head:
                break
        tail = pa.Table.from_batches(batches).slice(0, head)
        table = pa.concat_tables(whole + [tail]) if len(groups) > 1 else tail
    return table.slice(start - first, rows)


def die_with_parent(parent: int) -> None:
    """Call in a child process: on Linux it is killed when ``parent`` (its parent's pid) dies,
    kill -9 included (``PR_SET_PDEATHSIG``); it exits now if that already happened. A worker
    that waits for work it is handed (:class:`InOrderLoader`'s) would otherwise outlive a
    killed parent, since the DataLoader's own check runs only between items."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(1)


def _in_order_worker_init(parent: int, _worker_id: int) -> None:
    keep_freed_memory()
    die_with_parent(parent)


class InOrderLoader:
    """Batches of the slices handed to :meth:`put`, in the order they were put, read by
    ``num_workers`` processes (0: in this process) as :class:`Loader`'s are. The workers start
    here and wait for slices; :meth:`batches` yields each slice's batches once it is read (ask
    only for batches of slices already put: it waits for them), :meth:`close` ends the workers.
    A slice is one worker message: :meth:`slices` cuts rows into slices of whole batches of
    about ``message_rows``. Example::

        loader = InOrderLoader(fs, batch_size=8192, num_workers=4)
        for s in loader.slices(files, start=0, rows=100_000):
            loader.put(s)
        batches = loader.batches()
        first = next(batches)   # rows 0 .. 8192 of files
        loader.close()
    """

    def __init__(
        self,
        fs: FeatureSet,
        *,
        batch_size: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        message_rows: int = MESSAGE_ROWS,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.num_workers = batch_size, usable_workers(num_workers)
        self.slice_rows = message_batches(batch_size, message_rows) * batch_size
        context = torch.multiprocessing.get_context("fork")
        self._tasks = [context.SimpleQueue() for _ in range(max(self.num_workers, 1))]
        self._put = 0
        self.stats = FgStats()
        dataset = _InOrder(fs, fs.columns(), list(self._tasks), pin_memory)
        if self.num_workers == 0:
            self._received: Iterator[_Message] = iter(dataset)
        else:
            _freeze_inherited_objects_at_fork()
            self._received = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    collate_fn=_identity,
                    worker_init_fn=functools.partial(_in_order_worker_init, os.getpid()),
                    pin_memory=pin_memory,
                    multiprocessing_context=context,  # the workers inherit the task queues
                )
            )  # the workers start here

    def slices(
        self, files: tuple[tuple[str, int], ...], start: int, rows: int
    ) -> Iterator[RowSlice]:
        """Rows ``start .. start + rows`` of ``files`` as slices of :attr:`slice_rows`."""
        end = start + rows
        for first in range(start, end, self.slice_rows):
            yield RowSlice(files, first, min(self.slice_rows, end - first), self.batch_size)

    def put(self, piece: RowSlice) -> None:
        """Read ``piece`` next (by the worker whose turn it is)."""
        self._tasks[self._put % len(self._tasks)].put(piece)
        self._put += 1

    def batches(self) -> Iterator[Batch]:
        """The batches of the slices put, in order, as they are read."""
        for message in self._received:
            self.stats.merge(message.stats)
            yield from message.unpacked()

    def close(self) -> None:
        """End the workers (each after the slices put to it)."""
        for tasks in self._tasks:
            tasks.put(None)
