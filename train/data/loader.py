"""Sample Parquet → shuffled :class:`~shared.batch.Batch` es of ``batch_size``, with worker processes.

Shuffled (the default for training), the order of an epoch is a pure function of (files, seed,
epoch, num_workers, batch_size, shuffle_rows), computed from Parquet metadata alone:

1. the row groups of all files are permuted with ``(seed, epoch)``;
2. consecutive row groups are grouped into *windows* of at least ``shuffle_rows`` rows, and window
   ``i`` goes to stream ``i % num_workers``;
3. a stream reads its windows in turn, permutes each window's rows with ``(seed, epoch, i)`` and
   cuts its row sequence into batches (a batch may span two windows; the last may be short);
4. the torch DataLoader interleaves the streams round-robin (in order; exhausted streams drop out).

A worker sends its batches in messages of a few consecutive ones
(:data:`~train.data.messages.MESSAGE_ROWS`), their tensors packed into one shared-memory buffer
(:func:`shared.batch.pack`): one file descriptor per message instead of one per tensor (the
descriptor handshake was the main process's largest cost), and one copy to pin it. The message is
that buffer and where each tensor lies in it (:class:`~train.data.messages.Packed`): the main
process builds each batch once, as views of the buffer or of its pinned copy, instead of rebuilding
every pickled tensor. A worker keeps its last :data:`~train.data.messages.KEPT_BUFFERS` buffers
referenced, so that it, rather than the main process, usually frees their pages.
:func:`~train.data.plan.interleave` turns the round-robin over messages back into the round-robin
over batches of step 4, so the order does not depend on the message size.

Because every stream's batch count follows from metadata, :meth:`Loader.epoch` can start at batch
``k`` cheaply (resume): each stream skips whole windows without reading them, reads the window it
resumes in, and the streams are rotated so that the interleaving continues where it stopped.
Changing ``num_workers`` changes the shuffled order, so resume with the same value. A
``num_workers`` above the CPU cores this process may use is lowered to them
(:func:`usable_workers`, one log line), so resume on a machine with as many cores, or pass a
value it has.

**Shuffle off** (``shuffle=False``: evaluation, and training with ``data_config.shuffle: false``,
for time-ordered data): every epoch is the files' rows in file order (files by name, then row groups
and rows as stored), cut into batches of ``batch_size`` across row-group and file ends, only the
last one short: the batches one worker reading the files front to back cuts, for any ``num_workers``
(and any ``seed``, ``shuffle_rows``, ``message_rows``), tensor for tensor. The row sequence is cut
into slices of whole batches, one worker message each, that the workers take in turn, read by online
training's in-order machinery (:class:`~train.data.in_order.InOrder`): the DataLoader's round-robin
over its workers returns them in slice order, so the workers share the reading without interleaving
anything. A slice ends where a row group ends (rounded up to a whole batch) once it has
``message_rows`` rows (:func:`~train.data.plan.in_order_slices`), so each row group is decoded about
once, and a message may hold up to a row group more than ``message_rows``. Resume from batch ``k``
starts at row ``k × batch_size``, with any ``num_workers``. (Before issue #55 the windows of an
unshuffled epoch went to the workers as the shuffled ones do, and only one worker gave the file
order.)

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

Where the parts live: this module holds the public loaders (:class:`Loader`; online training's
:class:`InOrderLoader`) and :func:`usable_workers`. The epoch plan from metadata (row groups,
windows, slices, rank parts, resume, interleave) is :mod:`train.data.plan`; a shuffled epoch's
dataset, :mod:`train.data.streams`; the in-order dataset (the stream, unshuffled epochs),
:mod:`train.data.in_order`; a worker's batches and packed messages, :mod:`train.data.messages`;
worker-process set-up, :mod:`train.data.workers`. The names other modules take from the loader
are importable from here (``__all__``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from protos import pipeline_pb2
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg import ORACLE_COLUMN, FgStats
from train.data.in_order import InOrder, Planned, RowSlice
from train.data.messages import MESSAGE_ROWS, Message, message_batches
from train.data.plan import (
    RowGroup,
    Window,
    in_order_slices,
    interleave,
    list_row_groups,
    part_range,
    plan_streams,
    resume_point,
    stream_batches,
)
from train.data.streams import Batches
from train.data.workers import (
    die_with_parent,
    freeze_inherited_objects_at_fork,
    identity,
    in_order_worker_init,
    worker_init,
)

# the names other modules import from here, wherever they are defined (see the module doc)
__all__ = [
    "MESSAGE_ROWS",
    "InOrderLoader",
    "Loader",
    "RowGroup",
    "RowSlice",
    "Window",
    "die_with_parent",
    "in_order_slices",
    "interleave",
    "list_row_groups",
    "part_range",
    "resume_point",
    "usable_workers",
]

log = logging.getLogger(__name__)
_CLAMPS_SAID: set[tuple[int, int]] = set()  # (asked, cores) already logged in this process


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
            n = stream_batches(rows, gb, self.drop_last, w)
            sizes.append([gb] * (rows // gb) + [rows % gb] * (n - rows // gb))
        return [s[i] for i in range(max(map(len, sizes), default=0)) for s in sizes if i < len(s)]

    def dataset(
        self,
        epoch: int,
        streams: list[list[Window]],
        order: list[int],
        taken: list[int],
        cls: type[Batches] | None = None,
    ) -> Batches:
        """The DataLoader dataset of ``epoch``'s ``streams`` (played in ``order``, ``taken`` batches
        of each skipped), as ``cls`` (default :class:`~train.data.streams.Batches`; a benchmark's
        subclass times its steps) with this loader's settings."""
        return (cls or Batches)(
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
            received: Iterator[Message] = iter(dataset)
        else:
            freeze_inherited_objects_at_fork()
            received = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    collate_fn=identity,
                    worker_init_fn=worker_init,
                    pin_memory=self.pin_memory,
                )
            )  # the workers start here
        return self._played(received, messages)

    def _shuffled(self, epoch: int, skip_batches: int) -> tuple[Batches, list[int]]:
        """The dataset of a shuffled epoch (a stream per worker, steps 1–4 of the module doc)
        and the messages of each DataLoader slot (for :func:`interleave`)."""
        streams = self._streams(epoch)
        counts = [
            stream_batches(
                sum(w.rows for w in s), self.global_batch_size, self.drop_last, self.world_size
            )
            for s in streams
        ]
        taken, order = resume_point(counts, skip_batches)
        k = message_batches(self.global_batch_size, self.message_rows)
        messages = [-(-(counts[s] - taken[s]) // k) for s in order]  # per DataLoader slot
        return self.dataset(epoch, streams, order, taken), messages

    def _in_order(self, epoch: int, skip_batches: int) -> tuple[InOrder, list[int]]:
        """The dataset of an unshuffled epoch: the files' rows as one sequence, cut into slices of
        whole batches at row-group ends (:func:`in_order_slices`; one message each) that the workers
        take in turn, read by the stream's in-order machinery
        (:class:`~train.data.in_order.InOrder`); and its messages as one stream's (they arrive in
        slice order). Every epoch is the same; resume starts at row ``skip_batches × global batch``
        (every batch but the last is whole)."""
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
        tasks: list[object] = [Planned(slices[w::slots]) for w in range(slots)]
        dataset = InOrder(
            self.fs,
            self.columns,
            tasks,
            self.pin_memory,
            rank=self.rank,
            world_size=self.world_size,
        )
        return dataset, [len(slices)]

    def _played(self, received: Iterator[Message], messages: list[int]) -> Iterator[Batch]:
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
        dataset = InOrder(fs, fs.columns(), list(self._tasks), pin_memory)
        if self.num_workers == 0:
            self._received: Iterator[Message] = iter(dataset)
        else:
            freeze_inherited_objects_at_fork()
            self._received = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    collate_fn=identity,
                    worker_init_fn=functools.partial(in_order_worker_init, os.getpid()),
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
