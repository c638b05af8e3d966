"""The rows each committed step was trained on: an audit of exactly-once online training.

One JSON line per step and partition it took rows of, ``{"step": 12, "partition": "p0003",
"start": 256, "end": 512}`` (a batch that goes on into the next partition has two).
Lines are appended as steps run and flushed (fsync) before each checkpoint; at a restart the
lines of steps after the restored checkpoint are cut off (the file is rewritten atomically),
since those steps are trained again. So after any number of kill -9 and restarts the log lists,
for the committed state, which rows went into it: each source row once. Example::

    rows = RowLog(Path("runs/online/rows.jsonl"), restored_step)
    rows.add(step, span)
    rows.flush()                   # before the checkpoint of `step`
    RowLog.read(path)              # [(partition, start, end), ...] in step order
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from train.stream.source import Span


class RowLog:
    def __init__(self, path: Path, committed_step: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut(committed_step)
        self._file: IO[str] = self.path.open("a")

    def _cut(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (trained but never committed)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                break  # a torn last line of a killed run
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, self.path)

    def add(self, step: int, span: Span) -> None:
        """The rows of ``step``: a line per partition its batch took rows of."""
        for p in span.pieces:
            line = {"step": step, "partition": p.partition, "start": p.start, "end": p.end}
            self._file.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: Path) -> list[tuple[str, int, int]]:
        """(partition, start, end) of every line, in file order."""
        out = []
        for line in Path(path).read_text().splitlines():
            d = json.loads(line)
            out.append((d["partition"], d["start"], d["end"]))
        return out
