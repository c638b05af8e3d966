"""remove_stale_dirs: only matching dirs whose newest mtime is older than the process go."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest

from shared.stale_dirs import PROCESS_START, remove_stale_dirs

PATTERN = re.compile(r"^\.step_\d+\.[a-z0-9_]+$")


def _old(path: Path) -> None:
    t = time.time() - 3600
    os.utime(path, (t, t), follow_symlinks=False)


def test_removes_only_old_matching_dirs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in (".step_1.aaaa", ".step_2.bbbb", ".step_3.cccc", ".nope.dddd"):
        (tmp_path / name).mkdir()
    (tmp_path / ".step_2.bbbb" / "dense.pt").write_bytes(b"x")  # written now: a live run's
    (tmp_path / ".step_5.file").write_bytes(b"x")
    (tmp_path / ".step_6.link").symlink_to(tmp_path / ".nope.dddd")
    for name in (".step_1.aaaa", ".step_2.bbbb", ".nope.dddd", ".step_5.file", ".step_6.link"):
        _old(tmp_path / name)
    with caplog.at_level(logging.INFO, logger="shared.stale_dirs"):
        removed = remove_stale_dirs(tmp_path, PATTERN)
    assert [p.name for p in removed] == [".step_1.aaaa"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".nope.dddd", ".step_2.bbbb", ".step_3.cccc", ".step_5.file", ".step_6.link"]
    assert [r.getMessage() for r in caplog.records] == [
        f"removed 1 stale temp dir(s) of killed runs in {tmp_path}: .step_1.aaaa"
    ]


def test_missing_root_and_nothing_stale(tmp_path: Path) -> None:
    assert remove_stale_dirs(tmp_path / "absent", PATTERN) == []
    (tmp_path / ".step_1.aaaa").mkdir()
    assert remove_stale_dirs(tmp_path, PATTERN) == []  # newer than the process
    assert time.time() >= PROCESS_START
