"""bench.bench_serving_tiers runs on CPU at a small scale and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_serving_tiers


def test_bench_serving_tiers_writes_both_variants_with_equal_scores(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--keys", "3000",
            "--users", "2", "--candidates", "5", "--seq-len", "4", "--batches", "3",
            "--rounds", "2"]  # fmt: skip
    assert bench_serving_tiers.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["max_abs_diff"] == 0.0  # the tier is transparent
    hbm, cached = got["variants"]["hbm_only"], got["variants"]["caching"]
    assert hbm["modes"] == ["HBM_ONLY"] and cached["modes"] == ["CACHING"]
    keys = got["bundle"]["keys_total"]  # 3000 split over the six tables (rounded)
    assert hbm["host_bytes"] == 0 and cached["host_bytes"] == keys * 16 * 4
    assert cached["hbm_bytes"] < hbm["hbm_bytes"]
    assert hbm["hbm_hit_rate"] == 1.0 and 0.0 < cached["hbm_hit_rate"] < 1.0
    assert len(got["rounds"]) == 2 and set(got["caching_over_hbm_only"]) == {
        "candidates_per_s",
        "p99",
    }
