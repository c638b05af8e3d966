"""bench.bench_host_node runs on CPU at a small scale and writes its JSON (no timing checks): the
native mover's gather holds the rows asked for, and every device method says why it did not
run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_host_node
from shared.hashtable import host_move


@pytest.mark.skipif(
    host_move.unavailable_reason() is not None,
    reason=f"the native mover cannot be built here: {host_move.unavailable_reason()}",
)
def test_bench_host_node_on_cpu_moves_the_rows_and_names_what_did_not_run(tmp_path: Path) -> None:
    out = tmp_path / "node.json"
    argv = ["--out", str(out), "--rows", "5000", "--dims", "4", "16", "--ns", "300", "1000",
            "--repeats", "2", "--threads", "3"]  # fmt: skip
    assert bench_host_node.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["threads"] == 3
    for dim, entry in result["dims"].items():
        assert entry["rows"] == 5000 and entry["row_bytes"] == 8 * int(dim)
        for n, methods in entry["n"].items():
            v = methods["host_move"]
            assert v["run"] and v["rows_equal"] and len(v["ms_all"]) == 2, (dim, n)
            for name in bench_host_node.DEVICE_METHODS:
                assert methods[name]["run"] is False and "--device cuda" in methods[name]["reason"]


def test_more_rows_than_half_the_tier_are_refused(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path / "x.json"), "--rows", "100", "--ns", "60"]
    with pytest.raises(ValueError, match="at most half of --rows"):
        bench_host_node.main(argv)
