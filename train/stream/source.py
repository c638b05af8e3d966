"""A growing source of training rows: Parquet partitions landing under a directory, read in
order by the loader's worker processes.

A partition is a sub-directory of the source, complete once its ``_SUCCESS`` marker exists (as
Hadoop, Hive and ODPS jobs write it, after the data files). Complete partitions are read in
name order (so name them so that order is time order: ``dt=2017-05-06-13``,
``hour=000042``), each one's ``*.parquet`` files in name order, their rows in file order. A
complete partition must not change afterwards; partitions without the marker are not read yet.

The reading position is a :class:`Position`: the partition read last and how many of its rows
were consumed. It is all a restart needs (``train.stream`` commits it with each checkpoint):
the rows before it were trained, the rows after it were not.

:class:`StreamReader` plans the reading: from a position it hands the rows of the complete
partitions, in order, to an :class:`~train.data.loader.InOrderLoader` (the batch trainer's
worker processes, messages and pinned copies) a few slices ahead of training, and keeps for each
batch it planned a :class:`Span`: which rows it holds and their newest event time. A batch
goes on into the next partition where that one is complete, so batches are whole but at the
end of what has landed. The batches come back in the order they were planned, so the position
after a batch is its span's end, exactly.
Example::

    source = PartitionSource(Path("/data/samples"))
    reader = StreamReader(source, InOrderLoader(fs, batch_size=8192, num_workers=8), Position())
    batches = reader.batches()
    if reader.plan():                  # False: nothing new yet
        batch, span = next(batches), reader.take()
        train_on(batch)
        pos = span.end                 # Position(partition, row) after it
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from shared.batch import Batch
from train.data.loader import InOrderLoader, RowSlice

log = logging.getLogger(__name__)

SUCCESS_MARKER = "_SUCCESS"
EVENT_TIME_COLUMN = "time_stamp"  # Unix seconds of the impression (the samples' column)
AHEAD_SLICES_PER_WORKER = 3  # slices handed to the loader ahead of training, per worker
RELIST_S = 0.05  # while batches are planned, look for new partitions at most this often


@dataclass(frozen=True, order=True)
class Position:
    """Rows of ``partition`` consumed (``row``), every earlier partition whole; the empty
    position is before the first partition."""

    partition: str = ""
    row: int = 0


@dataclass(frozen=True)
class Piece:
    """Rows ``start .. end`` of ``partition``."""

    partition: str
    start: int
    end: int


@dataclass(frozen=True)
class Span:
    """The rows of one batch: consecutive pieces (more than one where the batch goes on into
    the next partition), and the newest event time among them."""

    pieces: tuple[Piece, ...]
    event_time: int  # the newest time_stamp of its rows (0: the column is absent)

    @property
    def rows(self) -> int:
        return sum(p.end - p.start for p in self.pieces)

    @property
    def end(self) -> Position:
        """The position after this batch."""
        return Position(self.pieces[-1].partition, self.pieces[-1].end)


@lru_cache(maxsize=4096)
def _files(partition: Path) -> tuple[tuple[str, int], ...]:
    """(file, rows) of a complete partition, in name order (cached: it never changes)."""
    files = sorted(partition.glob("*.parquet"))
    return tuple((str(f), pq.ParquetFile(f).metadata.num_rows) for f in files)


class PartitionSource:
    """The complete partitions under ``root`` and their rows (module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"--source {self.root}: no such directory; create it (partitions land there as "
                f"sub-directories, each complete once its {SUCCESS_MARKER} file exists)"
            )

    def partitions(self) -> list[str]:
        """Names of the complete partitions, in reading order."""
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith((".", "_")) and (p / SUCCESS_MARKER).exists()
        )

    def files(self, partition: str) -> tuple[tuple[str, int], ...]:
        """(file, rows) of ``partition``, in reading order."""
        return _files(self.root / partition)

    def rows(self, partition: str) -> int:
        return sum(n for _, n in self.files(partition))

    def event_times(self, partition: str) -> np.ndarray:
        """Each row's time_stamp, in reading order (zeros where the column is absent)."""
        out = []
        for path, n in self.files(partition):
            f = pq.ParquetFile(path)
            if EVENT_TIME_COLUMN not in f.schema_arrow.names:
                out.append(np.zeros(n, np.int64))
                continue
            column = f.read([EVENT_TIME_COLUMN], use_threads=False).column(0)
            out.append(column.fill_null(0).to_numpy().astype(np.int64))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def pending_rows(self, pos: Position) -> int:
        """Rows of complete partitions not consumed yet (the lag behind the source, in rows)."""
        names = [p for p in self.partitions() if p >= pos.partition]
        left = sum(self.rows(p) for p in names if p != pos.partition)
        if pos.partition in names:
            left += self.rows(pos.partition) - pos.row
        return left


class StreamReader:
    """Plans the source's rows from ``position`` on into ``loader`` and says which rows each of
    its batches holds (module doc). ``ahead_slices``: slices handed out ahead of training
    (default: :data:`AHEAD_SLICES_PER_WORKER` per worker).

    A slice takes up to the loader's ``slice_rows`` rows of the complete partitions from where
    planning stands, going on into the next partition where one ends: behind the source, every
    batch is whole (the same shape, so CUDA graphs replay); at its end, the rows there are
    planned at once, and the last batch is short."""

    def __init__(
        self,
        source: PartitionSource,
        loader: InOrderLoader,
        position: Position,
        *,
        ahead_slices: int | None = None,
    ) -> None:
        self.source, self.loader = source, loader
        self.ahead = ahead_slices or AHEAD_SLICES_PER_WORKER * max(loader.num_workers, 1)
        self._planned: collections.deque[Span] = collections.deque()
        self._slice_ends: collections.deque[int] = collections.deque()  # planned counts at ends
        self._taken = self._spans = 0  # spans taken, and planned, since the start
        self._next = position  # where planning goes on
        self._known: list[str] = []  # complete partitions after the planned one, in order
        self._times: dict[str, np.ndarray] = {}  # event times of the partitions being planned
        self._listed = 0.0

    def batches(self) -> Iterator[Batch]:
        """The batches of the planned spans, in order (ask only while :meth:`plan` is True)."""
        return self.loader.batches()

    def take(self) -> Span:
        """The span of the batch just taken from :meth:`batches`."""
        self._taken += 1
        while self._slice_ends and self._slice_ends[0] <= self._taken:
            self._slice_ends.popleft()
        return self._planned.popleft()

    def plan(self) -> bool:
        """Hand out slices of new rows (up to ``ahead`` in flight); True when a batch is
        planned and not taken yet."""
        if not self._planned or time.monotonic() - self._listed >= RELIST_S:
            self._relist()
        while len(self._slice_ends) < self.ahead:
            pieces = self._pieces(self.loader.slice_rows)
            if not pieces:
                break
            self._hand_out(pieces)
        return bool(self._planned)

    def _relist(self) -> None:
        self._listed = time.monotonic()
        last = self._known[-1] if self._known else self._next.partition
        self._known += [p for p in self.source.partitions() if p > last]

    def _pieces(self, rows: int) -> list[Piece]:
        """Up to ``rows`` rows from where planning stands (planning moves past them)."""
        out: list[Piece] = []
        while rows > 0:
            name, row = self._next.partition, self._next.row
            total = self.source.rows(name) if name else 0
            if row > total:
                raise ValueError(
                    f"{self.source.root / name}: holds {total} rows, but training already "
                    f"consumed {row} of it: a complete partition changed; restore it or start "
                    "a new --model-dir"
                )
            if row == total:
                if not self._known:
                    break
                self._next = Position(self._known.pop(0), 0)
                continue
            end = min(total, row + rows)
            out.append(Piece(name, row, end))
            rows -= end - row
            self._next = Position(name, end)
        return out

    def _hand_out(self, pieces: list[Piece]) -> None:
        """One slice of ``pieces`` to the loader, and the span of each of its batches."""
        names = list(dict.fromkeys(p.partition for p in pieces))
        files = tuple(f for name in names for f in self.source.files(name))
        rows = sum(p.end - p.start for p in pieces)
        piece = RowSlice(files, pieces[0].start, rows, self.loader.batch_size)
        self.loader.put(piece)
        at = [(p, p.start) for p in pieces]  # (piece, the next row of it to give a batch)
        for n in piece.batch_rows():
            taken: list[Piece] = []
            while n > 0:
                p, row = at[0]
                end = min(p.end, row + n)
                taken.append(Piece(p.partition, row, end))
                n -= end - row
                if end == p.end:
                    at.pop(0)
                else:
                    at[0] = (p, end)
            newest = max(int(self._event_times(q.partition)[q.start : q.end].max()) for q in taken)
            self._planned.append(Span(tuple(taken), newest))
        self._spans += len(piece.batch_rows())
        self._slice_ends.append(self._spans)

    def _event_times(self, name: str) -> np.ndarray:
        if name not in self._times:
            if len(self._times) >= 8:  # partitions planned long ago
                self._times.pop(next(iter(self._times)))
            self._times[name] = self.source.event_times(name)
        return self._times[name]

    def close(self) -> None:
        """End the loader's workers."""
        self.loader.close()
