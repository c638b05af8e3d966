"""convert: num_buckets checkpoint → dynamic checkpoint (rows, Adagrad sums, scores, AUC)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import torch

from shared.fg import table_to_batch
from shared.hashtable.checkpoint import read_table
from tests.conftest import SEED_CONFIG, write_config
from train.export import restore_model
from train.tools.__main__ import main


@pytest.fixture(scope="module")
def converted(
    baseline_config: Path, baseline_run: Path, tiny_samples: Path, tmp_path_factory, capsys_module
) -> dict:
    """The CLI's JSON report of a conversion with the AUC comparison."""
    out = tmp_path_factory.mktemp("converted")
    args = ["convert", "--from-config", str(baseline_config), "--checkpoint", str(baseline_run)]
    args += ["--to-config", str(SEED_CONFIG), "--samples", str(tiny_samples / "train")]
    args += ["--eval", str(tiny_samples / "eval"), "--out", str(out), "--json"]
    assert main(args) == 0
    report = json.loads(capsys_module())
    report["checkpoint"] = Path(report["checkpoint"])
    return report


@pytest.fixture(scope="module")
def capsys_module():
    """stdout of the CLI (module-scoped fixtures cannot use capsys)."""
    import contextlib
    import io

    buf = io.StringIO()
    stack = contextlib.redirect_stdout(buf)
    stack.__enter__()
    yield lambda: (stack.__exit__(None, None, None), buf.getvalue())[1]


def test_converted_rows_equal_the_old_matrix_rows(
    converted, baseline_run: Path, tiny_samples: Path
) -> None:
    old = torch.load(baseline_run / "dense.pt", weights_only=False)
    order = [k.split(".")[1] for k in old["dense_tables"]]  # Adagrad param order
    train = pads.dataset(str(tiny_samples / "train"), format="parquet").to_table()
    collided = 0
    for table in ("user_id_emb", "adgroup_id_emb", "brand_emb", "cate_id_emb"):
        weight = old["dense_tables"][f"embeddings.{table}.weight"]
        sums = old["optimizers"]["sparse"]["state"][order.index(table)]["sum"]
        nb = weight.shape[0]
        state, _ = read_table(converted["checkpoint"], table)
        keys = state.keys.numpy()
        rows = torch.from_numpy(keys % nb)
        torch.testing.assert_close(state.values, weight[rows], rtol=0, atol=0)
        torch.testing.assert_close(state.accumulators, sums[rows], rtol=0, atol=0)
        # the keys are exactly the ids of the data set (top-level column + click sequences)
        col = table.removesuffix("_emb")
        ids = set(train.column(col).drop_null().to_numpy().tolist())
        seq = f"click_50_seq__{col}"
        if seq in train.column_names:
            for s in train.column(seq).drop_null().to_pylist():
                ids.update(int(t) if t else 0 for t in s.split("|") if s)
        assert set(keys.tolist()) == ids, table
        collided += len(keys) - len(np.unique(keys % nb))
        if table == "user_id_emb":  # LFU scores = occurrences in the data set
            uid, counts = np.unique(train.column("user_id").to_numpy(), return_counts=True)
            assert dict(zip(keys.tolist(), state.scores.tolist(), strict=True)) == dict(
                zip(uid.tolist(), counts.tolist(), strict=True)
            )
    assert collided > 0, "the test must exercise colliding ids"


def test_converted_model_scores_like_the_original_on_seen_ids(
    converted, baseline_config: Path, baseline_run: Path, tiny_samples: Path
) -> None:
    rows = pads.dataset(str(tiny_samples / "train"), format="parquet").head(300)
    old, _, _ = restore_model(baseline_config, checkpoint=baseline_run)
    new, _, _ = restore_model(SEED_CONFIG, checkpoint=converted["checkpoint"])
    with torch.no_grad():
        want = old(table_to_batch(old.fs, rows))
        got = new(table_to_batch(new.fs, rows))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert set(converted["eval"]) == {"original", "converted"}
    assert (
        converted["tables"]["user_id_emb"]["stored"] == converted["tables"]["user_id_emb"]["keys"]
    )
    for r in converted["eval"].values():
        assert 0.0 < r["auc"] < 1.0 and r["rows"] == 621
    assert abs(converted["eval"]["original"]["auc"] - converted["eval"]["converted"]["auc"]) < 0.05


def test_different_dense_layers_are_refused(
    baseline_config: Path, baseline_run: Path, tiny_samples: Path, tmp_path: Path, capsys
) -> None:
    other = write_config(
        SEED_CONFIG,
        tmp_path / "other.config",
        train=tiny_samples / "train",
        eval_=tiny_samples / "eval",
        replace={"hidden_units: [512, 256, 128]": "hidden_units: [64, 32]"},
    )
    args = ["convert", "--from-config", str(baseline_config), "--checkpoint", str(baseline_run)]
    args += ["--to-config", str(other), "--samples", str(tiny_samples / "train")]
    assert main([*args, "--out", str(tmp_path / "out"), "--no-eval"]) == 2
    err = capsys.readouterr().err
    assert "dense layers (DenseArch) of the two configs differ" in err
    assert "tower.layers.0.weight: source [512, 256] vs target [64, 256]" in err
