"""Sample Parquet → shuffled :class:`~shared.batch.Batch` es of ``batch_size``, with worker processes.

The order of an epoch is a pure function of (files, seed, epoch, num_workers, batch_size,
shuffle_rows), computed from Parquet metadata alone:

1. the row groups of all files are permuted with ``(seed, epoch)``;
2. consecutive row groups are grouped into *windows* of at least ``shuffle_rows`` rows, and window
   ``i`` goes to stream ``i % num_workers``;
3. a stream reads its windows in turn, permutes each window's rows with ``(seed, epoch, i)`` and
   cuts its row sequence into batches (a batch may span two windows; the last may be short);
4. the torch DataLoader interleaves the streams round-robin (in order; exhausted streams drop out).

Because every stream's batch count follows from metadata, :meth:`Loader.epoch` can start at batch
``k`` cheaply (resume): each stream skips whole windows without reading them, reads the window it
resumes in, and the streams are rotated so that the interleaving continues where it stopped.
Changing ``num_workers`` changes the order, so resume with the same value. A ``num_workers``
above the CPU cores this process may use is lowered to them (:func:`usable_workers`, one log line),
so resume on a machine with as many cores, or pass a value it has.

Distributed training (``rank``/``world_size``): every rank plays the same sequence of *global*
batches of ``batch_size × world_size`` rows and keeps the contiguous part ``rank`` of each (parts
differ by at most one row in a short batch), converting only that part to tensors. So the global
batch of a step is the concatenation of the ranks' batches in rank order, and equals the batch a
``world_size=1`` loader with ``batch_size × world_size`` gives (same seed, workers, files): the
property that makes ``W`` ranks comparable with one process. Every rank reads every window (the
Parquet decode is ~20 % of the per-row cost; feature generation, the rest, is split) and all
ranks get the same number of batches, so no rank waits for another at the end of an epoch. A
short global batch of fewer than ``world_size`` rows is dropped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from protos import pipeline_pb2
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg import ORACLE_COLUMN, FgStats, table_to_batch

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
    ) -> None:
        self.fs, self.streams, self.assignment, self.skips = fs, streams, assignment, skips
        self.batch_size, self.shuffle, self.seed, self.epoch = batch_size, shuffle, seed, epoch
        self.drop_last, self.columns = drop_last, columns
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[tuple[Batch, FgStats]]:
        info = get_worker_info()
        stream = self.assignment[info.id if info is not None else 0]
        yield from self._play(self.streams[stream], self.skips[stream] * self.batch_size)

    def _read(self, window: Window) -> pa.Table:
        tables = [
            pq.ParquetFile(g.path).read_row_group(g.index, columns=self.columns)
            for g in window.groups
        ]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, window.index])
            table = table.take(pa.array(rng.permutation(table.num_rows)))
        return table

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
        if self.world_size > 1:
            table = table.slice(*part_range(table.num_rows, self.rank, self.world_size))
        stats = FgStats()
        return table_to_batch(self.fs, table, stats=stats), stats


def _identity(x: object) -> object:
    return x


class Loader:
    """Batches of one split for training or evaluation.

    ``shuffle_rows``: rows shuffled together (a window of whole row groups; see the module doc).
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
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        num_workers = usable_workers(num_workers)
        self.fs = fs
        self.groups = list_row_groups(path)
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
        self.rank, self.world_size = rank, world_size
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
        """Loader of ``train_input_path`` (split "train", shuffled) or ``eval_input_path``."""
        path = {"train": config.train_input_path, "eval": config.eval_input_path}[split]
        options: dict = {
            "batch_size": config.data_config.batch_size or 8192,
            "num_workers": config.data_config.num_workers,
            "shuffle": split == "train",
        }
        return cls(path, fs, **(options | overrides))

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def _streams(self, epoch: int) -> list[list[Window]]:
        return plan_streams(
            self.groups,
            streams=max(self.num_workers, 1),
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

    def epoch(self, epoch: int, *, skip_batches: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch``, from batch ``skip_batches`` on (same order as without skip)."""
        streams = self._streams(epoch)
        counts = [
            _stream_batches(
                sum(w.rows for w in s), self.global_batch_size, self.drop_last, self.world_size
            )
            for s in streams
        ]
        taken, order = resume_point(counts, skip_batches)
        dataset = _Batches(
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
        )
        if self.num_workers == 0:
            batches: Iterator = iter(dataset)
        else:
            batches = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    collate_fn=_identity,
                    pin_memory=self.pin_memory,
                )
            )
        for batch, stats in batches:
            self.stats.merge(stats)
            if self.pin_memory and self.num_workers == 0:
                batch = batch.pin_memory()
            yield batch
