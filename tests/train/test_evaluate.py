"""train.evaluate's prediction file: one row per evaluated row in the eval samples' order, its
figures the evaluation's own; written through ``python -m train evaluate --predictions``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from tests.conftest import SEED_CONFIG
from train.__main__ import main
from train.trainer import Trainer, TrainOptions


def _auc(p: np.ndarray, y: np.ndarray) -> float:
    return float(binary_auroc(torch.from_numpy(p.copy()), torch.from_numpy(y.astype(np.int64))))


def test_predictions_are_the_evaluated_rows_in_the_samples_order(
    tiny_samples: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "run"
    options = TrainOptions(config_path=SEED_CONFIG, model_dir=model_dir, train_path=tiny_samples /
                           "train", eval_path=tiny_samples / "eval", device="cpu", num_workers=0,
                           batch_size=256, max_steps=4, checkpoint_every=100)  # fmt: skip
    Trainer(options).fit()
    out = tmp_path / "preds" / "eval.parquet"
    main(["evaluate", "--config", str(SEED_CONFIG), "--model-dir", str(model_dir), "--device",
          "cpu", "--batch-size", "300", "--train", str(tiny_samples / "train"), "--eval",
          str(tiny_samples / "eval"), "--predictions", str(out)])  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    table = pq.read_table(out)
    assert table.column_names == ["row", "user_id", "label", "probability", "tail"]
    assert not out.with_name(out.name + ".tmp").exists()
    samples = pq.read_table(sorted((tiny_samples / "eval").glob("*.parquet")))
    assert table.num_rows == result["rows"] == samples.num_rows
    np.testing.assert_array_equal(table["row"].to_numpy(), np.arange(table.num_rows))
    np.testing.assert_array_equal(table["label"].to_numpy(), samples["clk"].to_numpy())
    np.testing.assert_array_equal(
        table["user_id"].to_numpy(), samples["user_id"].fill_null(-1).to_numpy()
    )
    p, y, tail = (table[c].to_numpy() for c in ("probability", "label", "tail"))
    assert _auc(p, y) == pytest.approx(result["auc"], abs=1e-6)
    assert int(tail.sum()) == result["tail_rows"] > 0
    assert _auc(p[tail], y[tail]) == pytest.approx(result["tail_auc"], abs=1e-6)
    assert _auc(p[~tail], y[~tail]) == pytest.approx(result["head_auc"], abs=1e-6)
