"""bench.bench_host_rows runs on CPU at a small scale and writes its JSON (no timing checks):
the CPU gathers run and hold the source rows, every device method says why it did not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import bench_host_rows


def test_bench_host_rows_on_cpu_gathers_the_source_rows_and_names_what_did_not_run(
    tmp_path: Path,
) -> None:
    out = tmp_path / "host_rows.json"
    argv = ["--out", str(out), "--rows", "3000", "--dims", "4", "130", "--ns", "64", "1000",
            "--repeats", "2"]  # fmt: skip
    assert bench_host_rows.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["cores"] >= 1
    assert set(result["dims"]) == {"4", "130"}
    for dim, got in result["dims"].items():
        assert got["rows"] == 3000 and got["row_bytes"] == 2 * int(dim) * 4
        assert got["host_bytes"] == 3000 * got["row_bytes"]
        assert set(got["n"]) == {"64", "1000"}
        for n, methods in got["n"].items():
            for name in ("c_cpu_gather", "c_cpu_gather_1t"):
                v = methods[name]
                assert v["run"] and v["rows_equal"], (dim, n, name)  # the rows gathered
                assert len(v["ms_all"]) == 2 and v["ms"] > 0, (dim, n, name)
                assert v["rows_per_s"] == pytest.approx(int(n) / v["ms"] * 1e3, rel=1e-3)
                assert v["gb_per_s"] == pytest.approx(
                    v["rows_per_s"] * got["row_bytes"] / 1e9, rel=1e-2
                )
            for name in bench_host_rows.CUDA_METHODS:
                assert methods[name] == {"run": False, "reason": methods[name]["reason"]}
                assert "--device cuda" in methods[name]["reason"], name


def test_the_rows_pattern_tells_rows_and_columns_apart_and_is_finite() -> None:
    """The check's reference: each row's bits differ from every other row's and column's, and
    read as finite floats (no NaN that a copy could alter)."""
    got = bench_host_rows.pattern(torch.arange(30_000_000 - 4096, 30_000_000), 256)
    assert got.shape == (4096, 256) and got.dtype == torch.int32
    assert torch.unique(got[:, 0]).numel() == 4096 and torch.unique(got[0]).numel() == 256
    assert bool(torch.isfinite(got.view(torch.float32)).all())


def test_more_rows_a_call_than_the_matrix_holds_is_refused(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path / "x.json"), "--rows", "100", "--dims", "4", "--ns", "200"]
    with pytest.raises(ValueError, match="needs 200 rows at dim 4, the matrix has 100"):
        bench_host_rows.main(argv)
