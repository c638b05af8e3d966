"""A partition writer and a ``train stream`` process for the online-training tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import ROOT, SEED_CONFIG
from train.stream.source import SUCCESS_MARKER

T = TypeVar("T")


def train_rows(tiny_samples: Path) -> pa.Table:
    return pq.read_table(next((tiny_samples / "train").glob("*.parquet")))


def write_partition(
    source: Path, name: str, rows: pa.Table, *, event_time: int | None = None
) -> Path:
    """``source/name/part-00000.parquet`` (row groups of 100 rows), then ``_SUCCESS``; the rows'
    ``time_stamp`` set to ``event_time`` (default: now), as if they had just happened."""
    stamp = int(time.time()) if event_time is None else event_time
    column = pa.array([stamp] * rows.num_rows, pa.int64())
    rows = rows.set_column(rows.schema.get_field_index("time_stamp"), "time_stamp", column)
    folder = source / name
    folder.mkdir(parents=True)
    pq.write_table(rows, folder / "part-00000.parquet", row_group_size=100)
    (folder / SUCCESS_MARKER).touch()
    return folder


def split(rows: pa.Table, parts: int) -> list[pa.Table]:
    n = -(-rows.num_rows // parts)
    return [rows.slice(i * n, n) for i in range(parts) if i * n < rows.num_rows]


def start_stream(
    source: Path, model_dir: Path, *extra: str, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """``python -m train stream`` on the seed config, CPU, batches of 256 rows."""
    args = [sys.executable, "-m", "train", "stream", "--config", str(SEED_CONFIG),
            "--source", str(source), "--model-dir", str(model_dir), "--device", "cpu",
            "--batch-size", "256", "--poll-s", "0.1", "--log-every-s", "1", *extra]  # fmt: skip
    out = open(log or model_dir.parent / f"{model_dir.name}.log", "ab")  # noqa: SIM115
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def records(model_dir: Path, kind: str) -> list[dict]:
    path = model_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if r.get("kind") == kind]


def wait_for(
    what: str, check: Callable[[], T], timeout: float, proc: subprocess.Popen | None = None
) -> T:
    """Poll ``check()`` until it is truthy; fail after ``timeout`` s or if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}")
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")
