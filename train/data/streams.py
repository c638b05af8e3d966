"""The dataset of a shuffled epoch (:class:`Batches`): one DataLoader worker slot plays the
windows of its stream (planned by :func:`train.data.plan.plan_streams`), reading each window's
row groups, permuting its rows and cutting the row sequence into batches (step 3 of
:mod:`train.data.loader`'s doc), sent as :mod:`train.data.messages`. Unshuffled epochs are
played by :mod:`train.data.in_order` instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import IterableDataset, get_worker_info

from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg import FgStats
from train.data.messages import Message, Sender, rank_batch
from train.data.plan import Window


class Batches(IterableDataset):
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

    def __iter__(self) -> Iterator[Message]:
        """Messages of ``message_batches`` batches: packed into shared memory in a worker,
        into pinned memory in the main process when pinning, else as they are."""
        info = get_worker_info()
        stream = self.assignment[info.id if info is not None else 0]
        played = self._play(self.streams[stream], self.skips[stream] * self.batch_size)
        sender = Sender(info is not None, self.pin_memory)
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
        return rank_batch(self.fs, table, self.rank, self.world_size, stats), stats
