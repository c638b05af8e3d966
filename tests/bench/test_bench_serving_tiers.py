"""bench.bench_serving_tiers runs on CPU at a small scale and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_serving_tiers
from tests.conftest import DEVICES


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


@pytest.mark.parametrize("device", DEVICES)
def test_scale_mode_plans_from_the_budget_and_keeps_within_it(tmp_path: Path, device: str) -> None:
    """--hbm-budget-gib with a budget too small for HBM_ONLY: the server's planner gives every
    table one factor < 1, the tables' HBM bytes stay within it, the scores equal HBM_ONLY's and
    the sampled reference's (on CUDA, graphs on: within the tolerance of its atomic pooling),
    and the startup split and memory are reported."""
    out = tmp_path / "scale.json"
    budget_gib = 0.008  # 200K keys: 2.4 MB of index + 12.8 MB of values HBM_ONLY
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--keys", "200000",
            "--hbm-budget-gib", str(budget_gib), "--users", "2", "--candidates", "5",
            "--seq-len", "4", "--batches", "4", "--rounds", "1", "--reference-batches", "2",
            "--device", device]  # fmt: skip
    assert bench_serving_tiers.main(argv) == 0
    got = json.loads(out.read_text())
    checks = {"reference_scores": True, "variant_scores": True, "within_budget": True}
    assert got["checks"] == checks
    if device == "cpu":
        assert got["max_abs_diff"] == 0.0 and got["reference"]["max_abs_diff"] == 0.0
    else:
        assert got["cuda_graphs"]
        assert got["score_tolerance"] == bench_serving_tiers.CUDA_SCORE_TOLERANCE
    assert got["reference"]["batches"] == 2 and got["reference"]["rows"] > 0
    budget = got["hbm_budget_bytes"]
    assert budget == int(budget_gib * 2**30)
    cached = got["variants"]["caching"]
    assert cached["hbm_bytes"] <= budget < got["variants"]["hbm_only"]["hbm_bytes"]
    tables = cached["tables"]
    assert set(tables) == set(got["bundle"]["keys_per_table"])
    factors = {t["factor"] for t in tables.values()}
    assert len(factors) == 1 and 0 < factors.pop() < 1  # one planned factor, as the server's
    assert all(t["mode"] == "CACHING" and t["planned"] for t in tables.values())
    assert sum(t["host_bytes"] for t in tables.values()) == got["memory"]["values_bytes"]
    assert sum(t["hbm_bytes"] for t in tables.values()) <= cached["hbm_bytes"]
    stages = {"read", "table_build", "program_load", "warmup", "graphs", "total", "first_batch"}
    assert stages <= set(cached["startup"])
    if device == "cpu":
        assert cached["cuda_memory"] is None
    else:  # the tables stay within the budget; the build's peak (the keys' sort) may not
        held = cached["cuda_memory"]
        assert held["peak_allocated_bytes"] >= held["allocated_bytes"] >= cached["hbm_bytes"]
    memory = got["memory"]
    assert memory["peak_rss_bytes"] >= memory["peak_rss_after_write_bytes"] > 0


def test_caching_alone_and_contradictory_flags(tmp_path: Path) -> None:
    """--variants caching loads no HBM_ONLY model (no comparison, the reference still checks);
    a flag that cannot be honoured is refused."""
    out = tmp_path / "cached.json"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--keys", "3000",
            "--variants", "caching", "--users", "2", "--candidates", "5", "--seq-len", "4",
            "--batches", "3", "--rounds", "1", "--reference-batches", "3"]  # fmt: skip
    assert bench_serving_tiers.main(argv) == 0
    got = json.loads(out.read_text())
    assert set(got["variants"]) == {"caching"} and got["max_abs_diff"] is None
    assert got["caching_over_hbm_only"] is None and got["hbm_budget_bytes"] is None
    assert got["checks"] == {"reference_scores": True}
    assert got["variants"]["caching"]["tables"]["user_id_emb"]["factor"] == 0.1
    for bad in (["--factor", "0.2", "--hbm-budget-gib", "1"],
                ["--variants", "hbm_only", "--hbm-budget-gib", "1"],
                ["--variants", "hbm", "--factor", "0.2"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench_serving_tiers.main(["--out", str(out), *bad])
