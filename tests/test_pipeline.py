"""The README's main job end to end on `tiny`: data → train → export → serve → parity → locust."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_on_tiny(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, str(ROOT / "scripts" / "pipeline.py"), "--size", "tiny", "--out", str(out),
        "--batch-size", "256", "--num-workers", "0", "--eval-every", "8", "--candidates", "20",
        "--load-users", "2", "--load-seconds", "3",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
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
    again = subprocess.run([*cmd[:2], "--size", "tiny", "--out", str(out), "--load-seconds", "2",
                            "--load-users", "1", "--candidates", "20"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert (
        "stage command" not in again.stderr
        and "$ " + sys.executable + " -m train train" not in again.stderr
    )
