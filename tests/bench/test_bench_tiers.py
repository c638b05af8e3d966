"""bench.bench_tiers runs on CPU at a small scale and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_tiers
from shared.hashtable import host_move


def test_bench_tiers_writes_every_variant_with_rows_equal_to_hbm_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    log = capsys.readouterr().err.splitlines()
    for name in ("cache_10", "cache_50", "cache_100"):  # the log line carries the counters
        c, rows = got[name]["per_step"], got[name]["host_rows"]
        assert rows == {
            "read": c["misses"] + c["bypassed"],
            "written": c["writebacks"] + c["bypassed"],
        }
        (line,) = [x for x in log if x.startswith(f"dim 4 round 0 {name}: ")]
        assert f"hit rate {got[name]['hit_rate']:.3f}" in line, line
        assert f"read {rows['read']:.0f} (misses {c['misses']:.0f}" in line, line
        assert f"written <= {rows['written']:.0f}" in line, line  # eager: an upper bound
    (line,) = [x for x in log if x.startswith("dim 4 round 0 hbm_only: ")]
    assert "hit rate" not in line


def test_bench_tiers_static_runs_every_variant_through_the_static_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    rows = got["cache_10"]["host_rows"]
    assert f"written {rows['written']:.0f} (write-backs" in capsys.readouterr().err  # exact


@pytest.mark.parametrize("cores", [None, 2], ids=["by_the_store", "by_2_cores"])
def test_bench_tiers_write_back_beside_stages_the_write_backs_and_changes_no_row(
    tmp_path: Path, cores: int | None
) -> None:
    """--write-back-beside N: the static step's caches stage their write-backs (N rows a
    step) and write them after the forward (with --write-back-cores 2: by the native mover on
    2 threads); every cache's rows still equal HBM_ONLY's and the write-backs are counted as
    without it."""
    if cores is not None and host_move.unavailable_reason() is not None:
        pytest.skip(f"the native mover cannot be built here: {host_move.unavailable_reason()}")
    out = tmp_path / "tiers.json"
    argv = ["--out", str(out), "--rows", "4000", "--lookups", "1500", "--dims", "4",
            "--warmup", "4", "--steps", "2", "--static", "--write-back-beside", "64"]  # fmt: skip
    argv += [] if cores is None else ["--write-back-cores", str(cores)]
    assert bench_tiers.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["write_back_beside"] == 64 and result["write_back_cores"] == cores
    got = result["dims"]["4"]
    for name in ("cache_10", "cache_50", "cache_100"):
        assert got[name]["equal_to_hbm_only"], name
    assert got["cache_10"]["per_step"]["writebacks"] > 0
    if cores is None:  # no native mover: no cores' time to report
        assert "host_move_ms_median" not in got["cache_10"]
    else:  # the cores' time in the timed steps' write-backs
        assert got["cache_10"]["host_move_ms_median"]["write_back"] > 0


def test_write_back_beside_is_refused_off_the_static_step(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "x.json"), "--write-back-beside", "64"]
    with pytest.raises(ValueError, match="give it with --static"):
        bench_tiers.main(out)


def test_write_back_cores_are_refused_without_the_staging(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "x.json"), "--static", "--write-back-cores", "2"]
    with pytest.raises(ValueError, match="give it with --write-back-beside"):
        bench_tiers.main(out)


def test_bench_tiers_prefetch_brings_each_next_batchs_rows(tmp_path: Path) -> None:
    """--prefetch with --static: each step prefetches the next batch's rows (the static form),
    where the caches have more lines than a step's 1536 padded keys (cache_50's 2000 and
    cache_100's 4000; cache_10's 400 would bypass: none there), and the rows stay HBM_ONLY's."""
    out = tmp_path / "tiers.json"
    argv = ["--out", str(out), "--rows", "4000", "--lookups", "1500", "--dims", "4",
            "--warmup", "2", "--steps", "2", "--static", "--prefetch"]  # fmt: skip
    assert bench_tiers.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["prefetch"]
    got = result["dims"]["4"]
    assert got["hbm_only"]["static_runs"]["prefetches"] == 0
    assert got["cache_10"]["static_runs"]["prefetches"] == 0
    for name in ("cache_50", "cache_100"):
        assert got[name]["static_runs"]["prefetches"] == 3, name  # after all steps but the last
        assert got[name]["per_step"]["prefetched"] > 0, name
        assert got[name]["equal_to_hbm_only"], name


def test_bench_tiers_profile_writes_each_variants_figures_and_tables(tmp_path: Path) -> None:
    """--profile N: after the timed runs each variant is profiled over N steps: its figures a
    step in the JSON (CPU: no kernels), every variant's tables in one file beside the JSON, a
    section each (a device call returns at most 8 files); a cached step runs the resolve's ops
    on top of HBM_ONLY's."""
    out = tmp_path / "tiers.json"
    argv = ["--out", str(out), "--rows", "4000", "--lookups", "1500", "--dims", "4", "8",
            "--warmup", "2", "--steps", "2", "--static", "--profile", "2"]  # fmt: skip
    assert bench_tiers.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiers.json", "tiers.profiles.txt"]
    text = (tmp_path / "tiers.profiles.txt").read_text()
    sections = text.split("=" * 24 + " dim ")[1:]  # "<dim> <variant> ====...\n<tables>"
    result = json.loads(out.read_text())["dims"]
    titles = [section.split(" " + "=" * 24, 1)[0].split() for section in sections]
    variants = ["hbm_only", "cache_10", "cache_50", "cache_100"]
    assert titles == [[dim, name] for dim in ("4", "8") for name in variants]
    for (dim, name), section in zip(titles, sections, strict=True):
        prof = result[dim][name]["profile"]
        assert prof["profiled_steps"] == 2, name
        assert prof["ops_per_step"] > 0 and prof["allocated_bytes_per_step"] > 0, name
        assert "kernels_per_step" not in prof, name  # no device work on CPU
        assert "operators by self CPU time" in section and "aten::" in section, name
    got = result["4"]
    assert got["cache_100"]["profile"]["ops_per_step"] > got["hbm_only"]["profile"]["ops_per_step"]


def test_the_host_node_fill_is_refused_off_the_static_step_on_cuda(tmp_path: Path) -> None:
    """--host-node is the captured static step's fill: without --static and CUDA it is an
    error, not a flag silently ignored."""
    for extra in ([], ["--static"]):
        with pytest.raises(ValueError, match="--host-node is the static step's fill on CUDA"):
            bench_tiers.main(["--out", str(tmp_path / "x.json"), "--host-node", *extra])


def test_host_node_threads_are_refused_without_the_host_node_or_below_one(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "x.json")]
    with pytest.raises(ValueError, match="--host-node-threads 4: give a count >= 1, with --host"):
        bench_tiers.main([*out, "--host-node-threads", "4"])
    cuda = ["--static", "--device", "cuda", "--host-node"]
    with pytest.raises(ValueError, match="--host-node-threads 0: give a count >= 1"):
        bench_tiers.main([*out, *cuda, "--host-node-threads", "0"])


def test_a_cache_that_filled_during_the_timed_steps_is_told_apart() -> None:
    """Timed steps of which only some evicted (the cache filled during them) get the median of
    those that did beside the count; steps that all evicted (the steady state) only the count."""
    got = bench_tiers.filling([0.008, 0.0105, 0.0104, 0.008], [False, True, True, False])
    assert got["evicting_steps"] == 2
    assert got["step_ms_median_evicting"] == pytest.approx(10.45)
    assert bench_tiers.filling([0.01, 0.01], [True, True]) == {"evicting_steps": 2}
    assert bench_tiers.filling([0.01], [False]) == {"evicting_steps": 0}
