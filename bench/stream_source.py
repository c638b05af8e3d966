"""The source side of ``bench.bench_stream``: the train samples cut into partitions (:func:`cut`)
and landed as a ``train stream`` source at a pace (:class:`Lander`).

A module of its own because both live runs land the same partitions (phase 1 under
``work/src``, phase 2 under ``work/training/src``), each with a lander of its own, and the
cut and the landing are tested without a trainer or a server.

**Event time is landing time:** each partition's ``time_stamp`` is rewritten to the second it is
due to land (not the data's 2017 hours, whose age would be years; the model does not read the
column), so freshness is "landed → served". A partition that lands late (its files not ready
in time) keeps its due time: its lateness counts against freshness, and is reported
(``Lander.late_s``).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUP_ROWS = 32_768  # the stream loader's slice at batches of 8192 (one row group each)


def cut(samples: Path, split: str) -> list[pa.Table]:
    """The partitions of the samples: by the hour of ``time_stamp`` (``"hour"``; empty hours
    left out), rows of each in file order, each file's in time order; or ``split`` equal parts
    (rows in file order). File by file: no take over the whole table (23M rows at full size)."""
    files = sorted(samples.glob("*.parquet")) if samples.is_dir() else [samples]
    if split != "hour":
        rows = pa.concat_tables(pq.read_table(f) for f in files)
        n = -(-rows.num_rows // int(split))
        return [rows.slice(i, n) for i in range(0, rows.num_rows, n)]
    hours: dict[int, list[pa.Table]] = {}
    for f in files:
        table = pq.read_table(f).combine_chunks()
        ts = table.column("time_stamp").to_numpy()
        order = np.argsort(ts, kind="stable")
        table, hour = table.take(pa.array(order)), ts[order] // 3600
        bounds = [0, *(np.flatnonzero(np.diff(hour)) + 1), len(hour)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            hours.setdefault(int(hour[a]), []).append(table.slice(a, b - a))
    return [pa.concat_tables(hours[h]) for h in sorted(hours)]


class Lander:
    """Lands ``parts`` under ``source`` as ``h<i>/part-00000.parquet`` + ``_SUCCESS``: part 0 at
    :meth:`land_first`, the others from :meth:`replay` on, each when its rows are due at
    ``rows_per_s`` (its ``time_stamp``: that due second). ``workers`` threads write the files
    ahead into hidden directories; landing is a rename."""

    def __init__(self, parts: list[pa.Table], source: Path, rows_per_s: float, workers: int):
        self.parts, self.source, self.rate = parts, source, rows_per_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lander")
        self.late_s: list[float] = []
        self.landed: list[tuple[float, int]] = []  # (unix time, rows) of each landing
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _write(self, i: int, due: float) -> Path:
        part = self.parts[i]
        stamp = pa.array(np.full(part.num_rows, int(due), np.int64))
        part = part.set_column(part.schema.get_field_index("time_stamp"), "time_stamp", stamp)
        tmp = self.source / f".h{i:06d}.tmp"
        tmp.mkdir(parents=True)
        pq.write_table(part, tmp / "part-00000.parquet", row_group_size=ROW_GROUP_ROWS)
        return tmp

    def _land(self, i: int, tmp: Path, due: float) -> None:
        os.rename(tmp, self.source / f"h{i:06d}")
        (self.source / f"h{i:06d}" / "_SUCCESS").touch()
        now = time.time()
        self.late_s.append(max(now - due, 0.0))
        self.landed.append((now, self.parts[i].num_rows))

    def land_first(self) -> None:
        due = time.time()
        self._land(0, self._write(0, due), due)

    def replay(self, start: float) -> None:
        """Land parts 1.. from ``start`` (unix time) on, in a thread."""
        offsets = np.cumsum([0] + [p.num_rows for p in self.parts[1:]]) / self.rate
        dues = [start + float(o) for o in offsets[:-1]]
        jobs: list[Future[Path]] = [
            self.pool.submit(self._write, i, due) for i, due in enumerate(dues, start=1)
        ]

        def run() -> None:
            for i, (job, due) in enumerate(zip(jobs, dues, strict=True), start=1):
                if self.stop.wait(max(due - time.time(), 0.0)):
                    return
                self._land(i, job.result(), due)

        self.thread = threading.Thread(target=run, name="replay", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return len(self.landed) == len(self.parts)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(60)
        self.pool.shutdown(wait=True, cancel_futures=True)
