"""bench/stream_auc.py: the AUC phase's helpers: the stream's rows in its reading order (for the
batch run in order), the unshuffled config, and the row log's check of every row once, in
order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.stream_auc import in_order_rows, rows_once_in_order, unshuffled_config
from shared.config import load_config
from tests.conftest import SEED_CONFIG
from train.data.loader import list_row_groups
from train.stream.row_log import RowLog
from train.stream.source import Piece, Span


def _source(tmp_path: Path, sizes: list[int]) -> Path:
    """Partitions ``h000000..`` of ``sizes`` rows (a ``row`` column counting on), two files in
    the first, each complete (``_SUCCESS``)."""
    src, row = tmp_path / "src", 0
    for i, n in enumerate(sizes):
        folder = src / f"h{i:06d}"
        folder.mkdir(parents=True)
        files = [n // 2, n - n // 2] if i == 0 else [n]
        for j, k in enumerate(files):
            table = pa.table({"row": np.arange(row, row + k)})
            pq.write_table(table, folder / f"part-{j:05d}.parquet", row_group_size=3)
            row += k
        (folder / "_SUCCESS").touch()
    (src / "h000099").mkdir()  # no _SUCCESS: not landed, not read
    return src


def test_in_order_rows_list_the_stream_rows_in_its_reading_order(tmp_path: Path) -> None:
    src = _source(tmp_path, [7, 4, 5])
    out = in_order_rows(src, tmp_path / "rows")
    groups = list_row_groups(out)  # the batch loader's order without shuffling: name order
    tables = []
    for g in groups:
        tables.append(pq.ParquetFile(g.path).read_row_group(g.index))
    assert pa.concat_tables(tables).column("row").to_pylist() == list(range(16))


def test_unshuffled_config_turns_only_the_shuffle_off(tmp_path: Path) -> None:
    base = load_config(SEED_CONFIG)
    assert base.data_config.shuffle
    copy = load_config(unshuffled_config(SEED_CONFIG, tmp_path / "c.config"))
    assert not copy.data_config.shuffle
    for c in (copy, base):
        c.data_config.ClearField("shuffle")
    assert copy == base


def _log(tmp_path: Path, spans: list[list[tuple[str, int, int]]]) -> Path:
    path = tmp_path / "rows.jsonl"
    log = RowLog(path, 0)
    for step, pieces in enumerate(spans, start=1):
        log.add(step, Span(tuple(Piece(*p) for p in pieces), 0))
    log.close()
    return path


def test_rows_once_in_order_holds_only_for_every_row_once_in_order(tmp_path: Path) -> None:
    src = _source(tmp_path, [7, 4, 5])
    good = [[("h000000", 0, 4)], [("h000000", 4, 7), ("h000001", 0, 1)], [("h000001", 1, 4)],
            [("h000002", 0, 5)]]  # fmt: skip
    assert rows_once_in_order(src, _log(tmp_path / "good", good))
    bad = {
        "a skipped row": [[("h000000", 0, 4)], [("h000000", 5, 7)], *good[2:]],
        "a row twice": [[("h000000", 0, 4)], [("h000000", 3, 7), ("h000001", 0, 1)], *good[2:]],
        "the tail missing": [*good[:3], [("h000002", 0, 4)]],
        "a partition missing": [*good[:3]],
        "out of order": [good[0], good[2], good[1], good[3]],
        "an empty log": [],
    }
    for name, spans in bad.items():
        assert not rows_once_in_order(src, _log(tmp_path / name.replace(" ", "_"), spans)), name
