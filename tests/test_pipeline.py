"""The README's main job end to end on `tiny`: data → train → export → serve → parity → locust."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.background import Background, start, stop

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
PIPELINE = [sys.executable, str(ROOT / "scripts" / "pipeline.py"), "--size", "tiny"]
TINY_ARGS = ["--batch-size", "256", "--num-workers", "0", "--eval-every", "8",
             "--candidates", "20", "--load-users", "2", "--load-seconds", "1"]  # fmt: skip
# test_pipeline_runs_a_config_with_another_delimiter_and_length's, beside its --config
SECOND_ARGS = ["--batch-size", "512", "--num-workers", "0", "--eval-every", "1000",
               "--candidates", "10", "--load-users", "1", "--load-seconds", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Background]]:
    """The two tests' pipelines, started together (:mod:`tests.background`): each is a chain of
    stage processes that mostly keep one core busy, so on a 2-core machine both take about the
    time of the longer."""
    root = tmp_path_factory.mktemp("pipelines")
    tiny, second = root / "tiny", root / "second"
    config = ["--config", str(_second_config(root / "second.config"))]
    started = {
        "tiny": start([*PIPELINE, "--out", str(tiny / "run"), *TINY_ARGS], tiny),
        "second": start([*PIPELINE, "--out", str(second / "run"), *config, *SECOND_ARGS], second),
    }
    yield started
    stop(started.values())


def test_pipeline_on_tiny(runs: dict[str, Background]) -> None:
    runs["tiny"].wait()
    out, cmd = runs["tiny"].folder / "run", runs["tiny"].cmd
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["train_rows"] > 0 and report["data"]["eval_rows"] > 0
    ev = report["train"]["eval"]
    assert 0 < ev["auc"] < 1 and ev["oracle_auc"] > 0.5
    assert report["parity"]["max_abs_diff"] <= 1e-5
    load = report["loadtest"]
    assert load["requests"] > 0 and load["failures"] == 0
    assert all(load["latency_ms"][p] > 0 for p in ("p50", "p95", "p99", "p99.9"))
    text = (out / "report.md").read_text()
    assert "Parity:" in text and "| requests | errors |" in text
    assert (out / "loadtest" / "latency.png").exists() and (out / "model" / "curves.png").exists()
    # the server was stopped: nothing listens on its port any more
    port = int(report["serve"]["host"].rsplit(":", 1)[1])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    # a second run skips every finished stage (outputs exist) and still serves
    again = subprocess.run([*cmd[:2], "--size", "tiny", "--out", str(out), "--load-seconds", "1",
                            "--load-users", "1", "--candidates", "20"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert (
        "stage command" not in again.stderr
        and "$ " + sys.executable + " -m train train" not in again.stderr
    )


def _second_config(path: Path) -> Path:
    """The seed config with other dims, another sequence name, ``;`` and sequence_length 20.

    Dims: the dynamic ad and category tables (shared with the sequence) 32 and 24, every other
    table 8 (training keeps the num_buckets tables in one torchrec EmbeddingCollection, which
    needs one dim for all of them)."""
    text = SEED_CONFIG.read_text()
    for name, dim in {"adgroup_id": 32, "cate_id": 24}.items():
        text = re.sub(  # every block of the feature (the sequence's sub-feature too)
            rf'(feature_name: "{name}"\n[^}}]*?)embedding_dim: 16',
            rf"\g<1>embedding_dim: {dim}",
            text,
        )
    for old, new in (("embedding_dim: 16", "embedding_dim: 8"),
                     ('sequence_delim: "|"', 'sequence_delim: ";"'),
                     ("sequence_length: 100", "sequence_length: 20"),
                     ("click_50_seq", "click_seq")):  # fmt: skip
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


def test_pipeline_runs_a_config_with_another_delimiter_and_length(
    runs: dict[str, Background],
) -> None:
    """Every fg setting (delimiter, length, names, dims) reaches data, parity and the load test
    from the config, the bundle's fg.json and the server's metadata: nothing assumes ``|``."""
    import pyarrow.dataset as ds

    runs["second"].wait()
    out = runs["second"].folder / "run"
    # the samples are written with the config's delimiter and length
    seq = ds.dataset(str(out / "data" / "samples" / "eval"), format="parquet").to_table(
        columns=["click_seq__adgroup_id"]
    )
    rows = [s for s in seq.column(0).to_pylist() if s]
    assert rows and any(";" in s for s in rows) and not any("|" in s for s in rows)
    assert max(len(s.split(";")) for s in rows) == 20  # the cap binds (and the load test's too)
    fg = json.loads((out / "bundle" / "fg.json").read_text())
    seq_spec = fg["features"]["click_seq__adgroup_id"]
    assert (seq_spec["sequence_delim"], seq_spec["sequence_length"]) == (";", 20)
    dims = {n: fg["tables"][fg["features"][n]["table"]]["dim"] for n in ("user_id", "cate_id")}
    assert dims == {"user_id": 8, "cate_id": 24}
    report = json.loads((out / "report.json").read_text())
    assert report["parity"]["max_abs_diff"] <= 1e-5 and report["parity"]["requests"] > 0
    load = report["loadtest"]
    assert load["requests"] > 0 and load["failures"] == 0
    summary = json.loads((out / "loadtest" / "summary.json").read_text())
    assert summary["request_pool"]["sequences"] == {
        "click_seq": {"delimiter": ";", "max_length": 20}
    }


def _render_module():  # scripts/ is not a package
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline", ROOT / "scripts" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("raw_dir", [None, "/data/taobao"])
def test_report_names_the_data_source(tmp_path: Path, raw_dir: str | None) -> None:
    """`data small` for synthetic data, `data raw: <dir>` for a --raw-dir run (not --size)."""
    report = {
        "config": "x.config",
        "size": "small",
        **({"raw_dir": raw_dir} if raw_dir else {}),
        "total_seconds": 1.0,
        "stage_seconds": {"data": 1.0},
        "data": {"train_rows": 10, "eval_rows": 5},
        "train": {"step": 2, "train_seconds": 1.0, "samples_per_s": 10.0},
        "bundle": {"bytes": 1e6, "dir": str(tmp_path / "bundle")},
    }
    first = _render_module().render(report, tmp_path).splitlines()[2]
    assert first.startswith(
        f"config `x.config`, data `{f'raw: {raw_dir}' if raw_dir else 'small'}`"
    )
