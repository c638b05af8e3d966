"""bench.bench_tiers_scale runs on CPU at a small scale and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import bench_tiers_scale

SMALL = ["--scale-keys", "20000", "--lookups", "3000", "--warmup", "2", "--steps", "3"]


def test_the_scale_bench_plans_host_row_arrays_populates_and_trains(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert bench_tiers_scale.main([*SMALL, "--hbm-budget-gib", "0.0007", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["command"].startswith("python -m bench.bench_tiers_scale --scale-keys 20000")
    plan = got["plan"]
    assert plan["row_arrays"] == "HOST" and 0 < plan["cache_load_factor"] < 1
    assert "row arrays on the host" in plan["line"]
    populated = got["populate"]
    assert populated["keys_inserted"] == 20_000
    stored = populated["keys_stored"]
    assert 0.99 * 20_000 <= stored <= 20_000  # a full bucket may refuse a few
    assert stored + populated["refusals"] + populated["evictions"] >= 20_000
    device, host = got["bytes"]["device"], got["bytes"]["host"]
    assert device["row_arrays"] == 0 and host["row_arrays"] == 25_088 * (8 + 4 + 8)  # slots
    # the CUDA insert kernels' scratch: planned (win, 196 buckets, stats on the device; the
    # stage with the row arrays on the host), measured 0 (the CPU's torch backend has none)
    planned, planned_host = plan["device_parts"], plan["host_parts"]
    assert planned["insert_scratch"] == 25_088 * 4 + 196 * 20 + 256
    assert planned_host["insert_stage"] == 25_088 * 8
    assert device["insert_scratch"] == host["insert_stage"] == 0
    assert sum(planned.values()) == plan["hbm_bytes"]
    assert sum(planned_host.values()) == plan["host_bytes"]
    # the planner's other device bytes are the arrays' (the arrays' sink slots aside)
    assert device["slot_arrays"] == planned["index"] and planned["counters"] == 0
    assert 0 <= device["line_map"] + device["lines"] - planned["cache"] < 1024
    assert host["rows"] == planned_host["rows"] and host["row_arrays"] == planned_host["row_arrays"]
    assert len(got["step_ms"]) == 3 and got["lookups_per_s"] > 0
    assert 0.0 < got["hit_rate"] < 1.0 and got["per_step"]["misses"] > 0
    assert got["cache_lines"] == math.ceil(plan["cache_load_factor"] * 25_088)


def test_a_budget_that_keeps_the_row_arrays_on_the_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lower --hbm-budget-gib"):
        bench_tiers_scale.main([*SMALL, "--hbm-budget-gib", "1", "--out", str(tmp_path / "x")])


def test_the_drivers_host_memory_is_refused_on_the_cpu(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path / "x.json"), "--host-memory", "driver"]
    with pytest.raises(ValueError, match="--host-memory driver is made by the CUDA driver"):
        bench_tiers_scale.main(argv)
