"""bench.bench_static_step runs on CPU at a small scale and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_static_step


def test_bench_static_step_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "static.json"
    argv = ["--out", str(out), "--device", "cpu", "--scale", "0.005", "--keys", "6000",
            "--span", "20000", "--fill", "2", "--warmup", "2", "--steps", "2"]  # fmt: skip
    assert bench_static_step.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["same_table_stats"], "the static step kept other keys than the eager lookup"
    assert got["static_runs"]["deep"]["eager"] == 2
    assert set(got["sections_ms_median"]) == {
        "unique", "find", "counter", "insert", "resolve", "erase", "values", "backward"
    }  # fmt: skip
    assert got["stats"]["static"]["user_id_emb"]["evictions"] > 0  # the storage was full
