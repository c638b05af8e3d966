"""bench/stream_source.py: the hourly (or equal) cut of the samples, and the lander that lands
the partitions in order, on time, with the due second as event time."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.stream_source import Lander, cut


def _samples(tmp_path: Path) -> Path:
    """Two files of rows at random seconds over 5 hours (hour 2 empty)."""
    rng = np.random.default_rng(0)
    out = tmp_path / "train"
    out.mkdir(parents=True)
    for i in range(2):
        hours = rng.choice([0, 1, 3, 4], size=500)
        ts = 1_494_000_000 - 1_494_000_000 % 3600 + hours * 3600 + rng.integers(0, 3600, 500)
        table = pa.table({"time_stamp": ts.astype(np.int64), "row": np.arange(500) + 500 * i})
        pq.write_table(table, out / f"part-{i}.parquet", row_group_size=64)
    return out


def test_cut_by_hour_keeps_every_row_once_in_hour_order(tmp_path: Path) -> None:
    parts = cut(_samples(tmp_path), "hour")
    assert len(parts) == 4
    hours = [np.unique(p.column("time_stamp").to_numpy() // 3600) for p in parts]
    assert all(len(h) == 1 for h in hours) and [h[0] for h in hours] == sorted(h[0] for h in hours)
    rows = np.concatenate([p.column("row").to_numpy() for p in parts])
    assert sorted(rows.tolist()) == list(range(1000))
    for p in parts:  # each file's rows of the hour in time order
        ts, row = p.column("time_stamp").to_numpy(), p.column("row").to_numpy()
        for mine in (row < 500, row >= 500):
            assert (np.diff(ts[mine]) >= 0).all()
    equal = cut(_samples(tmp_path / "b"), "3")
    assert [p.num_rows for p in equal] == [334, 334, 332]


def test_the_lander_lands_in_order_with_the_due_second_as_event_time(tmp_path: Path) -> None:
    parts = cut(_samples(tmp_path), "hour")
    lander = Lander(parts, tmp_path / "src", rows_per_s=20_000, workers=2)
    lander.land_first()
    start = time.time()
    lander.replay(start)
    try:
        deadline = time.monotonic() + 30
        while not lander.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        lander.close()
    assert lander.done()
    names = sorted(p.name for p in (tmp_path / "src").iterdir())
    assert names == [f"h{i:06d}" for i in range(4)]  # no hidden directory left
    stamps = []
    for i, name in enumerate(names):
        assert (tmp_path / "src" / name / "_SUCCESS").exists()
        table = pq.read_table(tmp_path / "src" / name / "part-00000.parquet")
        assert table.num_rows == parts[i].num_rows
        assert table.column("row").to_pylist() == parts[i].column("row").to_pylist()
        assert len(set(table.column("time_stamp").to_pylist())) == 1
        stamps.append(table.column("time_stamp")[0].as_py())
    due = start + np.cumsum([0] + [p.num_rows for p in parts[1:-1]]) / 20_000
    assert stamps[1:] == [int(d) for d in due]
