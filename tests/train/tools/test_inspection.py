"""inspect on a checkpoint: sizes, histogram, top keys and admission backlog match the tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shared.hashtable.checkpoint import module_dir, read_table
from shared.hashtable.summary import score_histogram, top_keys
from train.checkpoint import DYNAMIC_MODULE
from train.tools.__main__ import main
from train.tools.inspection import format_report, inspect_checkpoint


def test_checkpoint_report_matches_the_table_files(dyn_run) -> None:
    report = inspect_checkpoint(dyn_run.model_dir, top_k=5)  # a model dir: its newest checkpoint
    assert report["where"] == str(dyn_run.checkpoint)
    directory = module_dir(dyn_run.checkpoint, DYNAMIC_MODULE)
    names = [t["name"] for t in report["tables"]]
    assert names == sorted(
        [
            "user_id_emb",
            "adgroup_id_emb",
            "brand_emb",
            "campaign_id_emb",
            "customer_emb",
            "cate_id_emb",
        ]
    )
    for t in report["tables"]:
        state, args = read_table(directory, t["name"])
        keys, scores = state.keys.numpy(), state.scores.numpy()
        assert t["size"] == len(keys) > 0
        assert t["capacity"] == args["max_capacity"]  # world size 1
        assert t["load_factor"] == len(keys) / args["max_capacity"]
        assert sum(b["count"] for b in t["score_histogram"]) == len(keys)
        # LFU: power-of-two bins; every admitted key was seen >= threshold (3) times
        assert all(b["upper"] == 2 * b["lower"] for b in t["score_histogram"])
        assert min(b["lower"] for b in t["score_histogram"]) >= 2
        best = np.lexsort((keys, -scores))[:5]
        assert t["top_keys"] == [{"key": int(keys[i]), "score": int(scores[i])} for i in best]
        counts = state.counter_counts.numpy()
        assert t["admission_threshold"] == 3 and t["admission_pending"] == len(counts)
        assert all(int(c) < 3 for c in t["admission_pending_by_count"])
        assert sum(t["admission_pending_by_count"].values()) == len(counts)
    text = format_report(report, top_k=5)
    assert "user_id_emb" in text and "top 5 key:score" in text


def test_histogram_bins() -> None:
    s = np.array([0, 1, 2, 3, 4, 100])
    assert score_histogram(s, "LFU") == [
        {"lower": 0, "upper": 1, "count": 1},
        {"lower": 1, "upper": 2, "count": 1},
        {"lower": 2, "upper": 4, "count": 2},
        {"lower": 4, "upper": 8, "count": 1},
        {"lower": 64, "upper": 128, "count": 1},
    ]
    steps = score_histogram(np.array([10, 11, 19, 25]), "STEP", bins=2)
    assert steps == [{"lower": 10, "upper": 18, "count": 2}, {"lower": 18, "upper": 26, "count": 2}]
    assert top_keys(np.array([5, 3, 9]), np.array([1, 7, 7]), 2) == [
        {"key": 3, "score": 7},
        {"key": 9, "score": 7},
    ]


def test_cli_json(dyn_run, capsys) -> None:
    assert main(["inspect", "--checkpoint", str(dyn_run.checkpoint), "--json", "--top-k", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "checkpoint"
    assert all(len(t["top_keys"]) <= 3 for t in report["tables"])
    assert main(["inspect", "--checkpoint", str(Path(dyn_run.checkpoint).parent / "nope")]) == 2
