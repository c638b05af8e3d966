"""Raw per-request latencies, exact to the nanosecond, one file per locust process.

Locust rounds response times below 100 ms to whole milliseconds, which makes sub-millisecond
percentiles meaningless, so every request is also recorded here. A record is three little-endian
int64: ``start_unix_ns`` (``time.time_ns()`` when the call started, to align processes on one
clock), ``latency_ns`` (``time.perf_counter_ns()`` difference around the RPC), ``ok`` (1/0).
Files are ``<dir>/latency-<pid>.bin``; :func:`read_raw_latencies` concatenates a directory.
"""

from __future__ import annotations

import os
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE_GLOB = "latency-*.bin"
_FIELDS = 3


class RawLatencyWriter:
    """Buffers records in memory and appends them to this process's file.

    Appends are cheap (one ``array.extend``); :meth:`flush` runs every ``flush_every`` records
    and when the test stops, so a crash loses at most one buffer.
    """

    def __init__(self, directory: str | Path, flush_every: int = 8192) -> None:
        self.path = Path(directory) / f"latency-{os.getpid()}.bin"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._buf = array("q")
        self._flush_every = flush_every * _FIELDS
        self.count = 0

    def record(self, start_unix_ns: int, latency_ns: int, ok: bool) -> None:
        self._buf.extend((start_unix_ns, latency_ns, 1 if ok else 0))
        self.count += 1
        if len(self._buf) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        buf = self._buf
        if sys.byteorder == "big":  # the file is little-endian
            buf.byteswap()
        with open(self.path, "ab") as f:
            f.write(buf.tobytes())
        self._buf = array("q")


@dataclass(frozen=True)
class RawLatencies:
    start_unix_ns: np.ndarray  # int64 [R]
    latency_ns: np.ndarray  # int64 [R]
    ok: np.ndarray  # bool [R]
    files: tuple[Path, ...]

    def __len__(self) -> int:
        return len(self.latency_ns)


def read_raw_latencies(directory: str | Path) -> RawLatencies:
    """All records of all processes in ``directory``, sorted by start time."""
    files = tuple(sorted(Path(directory).glob(FILE_GLOB)))
    chunks = [np.fromfile(f, dtype="<i8") for f in files]
    data = np.concatenate(chunks) if chunks else np.zeros(0, dtype="<i8")
    if data.size % _FIELDS:
        raise ValueError(
            f"raw latency files in {directory} are truncated ({data.size} int64s); run the load "
            "test again"
        )
    data = data.reshape(-1, _FIELDS)
    data = data[np.argsort(data[:, 0], kind="stable")]
    return RawLatencies(data[:, 0].copy(), data[:, 1].copy(), data[:, 2] == 1, files)
