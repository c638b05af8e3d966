"""ShardedDynamicEmbedding on 2 gloo ranks against one DynamicEmbeddingCollection that sees the
whole batch: rows, Adagrad updates, scores, admission counters, eval mode (exchange_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_two_ranks_match_one_collection_on_the_global_batch() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(HERE / "exchange_worker.py"),
        ],
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "rank 0: ok" in proc.stdout and "rank 1: ok" in proc.stdout
