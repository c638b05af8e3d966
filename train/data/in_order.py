"""Reading rows in order: the dataset that plays *slices* of consecutive rows (:class:`InOrder`,
:class:`RowSlice`), for online training and for unshuffled epochs.

Online training (train.stream) reads a growing source in row order: no shuffle, no epochs,
and the rows to read are known only as they land. The same workers, messages and pinned
copies as a shuffled epoch's (:mod:`train.data.streams`, :mod:`train.data.messages`) play
slices (consecutive rows of a partition's files) that the caller hands out while the loader
runs (:class:`~train.data.loader.InOrderLoader`), slice ``i`` to worker ``i % W``: the
DataLoader's round-robin over its workers then returns the messages in slice order, so the
batches come in row order and the caller knows which rows each batch holds. An unshuffled epoch
of :class:`~train.data.loader.Loader` is played the same way, its slices planned before it
starts (:class:`Planned`, :func:`train.data.plan.in_order_slices`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import IterableDataset, get_worker_info

from shared.features import FeatureSet
from shared.fg import FgStats
from train.data.messages import Message, Sender, rank_batch


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


class Planned:
    """The slices of one worker slot known before the epoch starts (an unshuffled epoch of
    :class:`~train.data.loader.Loader`), handed out as a task queue of
    :class:`~train.data.loader.InOrderLoader` hands them: ``get``
    returns the next, then None (the end). Each worker process gets its own copy at fork."""

    def __init__(self, slices: list[RowSlice]) -> None:
        self.slices, self.next = slices, 0

    def get(self) -> RowSlice | None:
        if self.next == len(self.slices):
            return None
        self.next += 1
        return self.slices[self.next - 1]


class InOrder(IterableDataset):
    """One DataLoader worker slot: plays the slices its task source hands it (``get()``; None:
    the end): a queue the caller fills while the loader runs (:class:`InOrderLoader`), or the
    slices planned for an unshuffled epoch (:class:`Planned`). Slice ``i`` goes to slot
    ``i % W``, so the DataLoader's round-robin over its workers returns the messages in slice
    order. With ``world_size > 1`` every rank reads every slice and keeps its part of each
    batch (:func:`~train.data.plan.part_range`), as :class:`~train.data.streams.Batches` does."""

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

    def __iter__(self) -> Iterator[Message]:
        info = get_worker_info()
        tasks = self.tasks[info.id if info is not None else 0]
        sender = Sender(info is not None, self.pin_memory)
        files: dict[str, pq.ParquetFile] = {}
        while (task := tasks.get()) is not None:  # type: ignore[attr-defined]
            table, start = self._read(task, files), 0
            batches, stats = [], FgStats()
            for rows in task.batch_rows():
                part = table.slice(start, rows)
                batches.append(rank_batch(self.fs, part, self.rank, self.world_size, stats))
                start += rows
            yield sender.message(batches, stats)

    def _read(self, task: RowSlice, files: dict[str, pq.ParquetFile]) -> pa.Table:
        """The slice's rows: only the row groups they lie in are decoded (:func:`file_rows`)."""
        parts, start, left = [], task.start, task.rows
        for path, n in task.files:
            if start >= n:
                start -= n
                continue
            if path not in files:
                if len(files) >= 64:  # a long stream: forget the oldest partitions' files
                    files.pop(next(iter(files)))
                files[path] = pq.ParquetFile(path)
            parts.append(file_rows(files[path], start, min(left, n - start), self.columns))
            left -= parts[-1].num_rows
            start = 0
            if left == 0:
                break
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def file_rows(f: pq.ParquetFile, start: int, rows: int, columns: list[str]) -> pa.Table:
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
