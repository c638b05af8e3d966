"""A growing source of training rows: Parquet partitions landing under a directory.

A partition is a sub-directory of the source, complete once its ``_SUCCESS`` marker exists (as
Hadoop, Hive and ODPS jobs write it, after the data files). Complete partitions are read in
name order (so name them so that order is time order: ``dt=2017-05-06-13``,
``hour=000042``), each one's ``*.parquet`` files in name order, their rows in file order. A
complete partition must not change afterwards; partitions without the marker are not read yet.

The reading position is a :class:`Position`: the partition read last and how many of its rows
were consumed. It is all a restart needs (``train.stream`` commits it with each checkpoint):
the rows before it were trained, the rows after it were not. Example::

    source = PartitionSource(Path("/data/samples"), columns=fs.columns())
    pos = Position()
    chunk = source.next_chunk(pos, rows=8192)   # None: nothing new yet
    if chunk is not None:
        train_on(chunk.table)
        pos = chunk.end
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

SUCCESS_MARKER = "_SUCCESS"
EVENT_TIME_COLUMN = "time_stamp"  # Unix seconds of the impression (the samples' column)


@dataclass(frozen=True, order=True)
class Position:
    """Rows of ``partition`` consumed (``row``), every earlier partition whole; the empty
    position is before the first partition."""

    partition: str = ""
    row: int = 0


@dataclass(frozen=True)
class Chunk:
    """Consecutive rows of one partition: ``table`` holds rows ``start.row .. end.row``."""

    table: pa.Table
    start: Position
    end: Position
    event_time: int  # the newest time_stamp of its rows (0: the column is absent)


@cache
def _files(partition: Path) -> tuple[tuple[Path, int], ...]:
    """(file, rows) of a complete partition, in name order (cached: it never changes)."""
    files = sorted(partition.glob("*.parquet"))
    return tuple((f, pq.ParquetFile(f).metadata.num_rows) for f in files)


class PartitionSource:
    """The complete partitions under ``root`` and their rows (module doc)."""

    def __init__(self, root: Path, *, columns: list[str]) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"--source {self.root}: no such directory; create it (partitions land there as "
                f"sub-directories, each complete once its {SUCCESS_MARKER} file exists)"
            )
        self.columns = columns

    def partitions(self) -> list[str]:
        """Names of the complete partitions, in reading order."""
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith((".", "_")) and (p / SUCCESS_MARKER).exists()
        )

    def rows(self, partition: str) -> int:
        return sum(n for _, n in _files(self.root / partition))

    def pending_rows(self, pos: Position) -> int:
        """Rows of complete partitions not consumed yet (the lag behind the source, in rows)."""
        names = [p for p in self.partitions() if p >= pos.partition]
        left = sum(self.rows(p) for p in names if p != pos.partition)
        if pos.partition in names:
            left += self.rows(pos.partition) - pos.row
        return left

    def next_chunk(self, pos: Position, rows: int) -> Chunk | None:
        """Up to ``rows`` rows from ``pos`` on, never crossing a partition (the last chunk of
        one may be short); None when no complete partition has rows after ``pos``."""
        for name in self.partitions():
            if name < pos.partition:
                continue
            start = pos.row if name == pos.partition else 0
            total = self.rows(name)
            if start > total:
                raise ValueError(
                    f"{self.root / name}: holds {total} rows, but training already consumed "
                    f"{start} of it: a complete partition changed; restore it or start a new "
                    "--model-dir"
                )
            if start == total:
                continue
            table = self._read(name, start, min(rows, total - start))
            end = Position(name, start + table.num_rows)
            return Chunk(table, Position(name, start), end, _newest(table))
        return None

    def _read(self, name: str, start: int, rows: int) -> pa.Table:
        """Rows ``start .. start + rows`` of partition ``name`` (across its files)."""
        parts = []
        for path, n in _files(self.root / name):
            if start >= n:
                start -= n
                continue
            parts.append(_read_rows(path, start, min(rows, n - start), self.columns))
            rows -= parts[-1].num_rows
            start = 0
            if rows == 0:
                break
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _read_rows(path: Path, start: int, rows: int, columns: list[str]) -> pa.Table:
    """Rows ``start .. start + rows`` of one file, reading only the row groups they are in."""
    f = pq.ParquetFile(path)
    names = [c for c in columns if c in f.schema_arrow.names]
    groups: list[int] = []
    first = seen = 0
    for i in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(i).num_rows
        if seen + n > start and seen < start + rows:
            if not groups:
                first = seen
            groups.append(i)
        seen += n
    table = f.read_row_groups(groups, columns=names, use_threads=False)
    return table.slice(start - first, rows)


def _newest(table: pa.Table) -> int:
    if EVENT_TIME_COLUMN not in table.column_names or table.num_rows == 0:
        return 0
    value = pc.max(table.column(EVENT_TIME_COLUMN)).as_py()
    return int(value or 0)
