"""bench.bench_tiers runs on CPU at a small scale and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_tiers


def test_bench_tiers_writes_every_variant_with_rows_equal_to_hbm_only(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    argv = ["--out", str(out), "--rows", "4000", "--lookups", "1500", "--dims", "4",
            "--warmup", "2", "--steps", "2"]  # fmt: skip
    assert bench_tiers.main(argv) == 0
    got = json.loads(out.read_text())["dims"]["4"]
    assert got["hbm_only"]["ratio_to_hbm_only"] == 1.0
    for name in ("cache_10", "cache_50", "cache_100"):
        v = got[name]
        assert v["equal_to_hbm_only"], name  # the tier is transparent
        assert 0.0 <= v["hit_rate"] <= 1.0 and v["per_step"]["misses"] > 0
        assert v["bytes"]["host_payload"] == got["hbm_only"]["bytes"]["device_payload"]
    assert got["cache_10"]["cache_lines"] == -(-4000 // 10)  # 10 % of the rows
    assert got["cache_10"]["per_step"]["evictions"] > 0


def test_bench_tiers_static_runs_every_variant_through_the_static_step(tmp_path: Path) -> None:
    """--static: each variant's steps take the static sparse step (eager on CPU), the caches'
    too (cache_10's 400 lines under 1536 padded keys: rows bypassed in fixed shapes)."""
    out = tmp_path / "tiers.json"
    argv = ["--out", str(out), "--rows", "4000", "--lookups", "1500", "--dims", "4",
            "--warmup", "2", "--steps", "2", "--static"]  # fmt: skip
    assert bench_tiers.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["static"]
    got = result["dims"]["4"]
    for name in ("hbm_only", "cache_10", "cache_50", "cache_100"):
        assert got[name]["static_runs"]["eager"] == 4, name  # every step, static
    for name in ("cache_10", "cache_50", "cache_100"):
        assert got[name]["equal_to_hbm_only"], name
        assert got[name]["per_step"]["misses"] > 0, name
    assert got["cache_10"]["per_step"]["bypassed"] > 0
