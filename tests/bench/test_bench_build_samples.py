"""bench/bench_build_samples.py on tiny data: both builds timed, their files compared."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_build_samples import main


def test_both_builds_are_timed_and_identical(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    result = main(["--size", "tiny", "--threads", "3", "--repeats", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == result and result["identical_files"] and result["files"] >= 2
    assert len(result["seconds_one_thread"]) == len(result["seconds_threads"]) == 2
    assert result["speedup"] > 0 and result["threads"] == 3
