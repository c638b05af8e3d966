"""``torchrun -m train train`` on gloo against one process with the same global batch (48 rows).

One process with batch 48 and two ranks with batch 24 see the same rows per step (the loader's
parts), so after 4 steps they must hold the same dense weights, num_buckets tables and dynamic
tables (float tolerance: sums run in another order), and log the same losses and eval metrics.
The two-rank checkpoint of step 2 must resume on one process (batch 48) and on three ranks (batch
16) to the same step-4 state, and its serving bundle (``part_R_2``) must score as the one-process
bundle does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from shared.bundle import read_bundle
from shared.config import load_config
from shared.features import build_feature_set
from shared.hashtable.checkpoint import DEEP_COLLECTION
from tests.conftest import ROOT, SEED_CONFIG
from train.checkpoint import load_checkpoint
from train.export import export_bundle, restore_model
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import Trainer, TrainOptions

GLOBAL_BATCH = 48
STEPS = 4


def _argv(
    tiny: Path, model_dir: Path, batch: int, *extra: str, config: Path = SEED_CONFIG
) -> list[str]:
    return [
        "--config", str(config), "--train", str(tiny / "train"), "--eval", str(tiny / "eval"),
        "--model-dir", str(model_dir), "--device", "cpu", "--batch-size", str(batch),
        "--num-workers", "0", "--max-steps", str(STEPS), "--log-every", "1",
        "--checkpoint-every", "2", "--no-progress", *extra,
    ]  # fmt: skip


def _torchrun(ranks: int, argv: list[str], meanwhile: Callable[[], None] | None = None) -> None:
    """``ranks`` processes of ``python -m train train argv``; ``meanwhile`` runs in this process
    as they start (the launcher's imports keep one core busy for a second or two first)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.Popen(
        [*cmd, "--nproc_per_node", str(ranks), "-m", "train", "train", *argv],
        cwd=ROOT,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if meanwhile is not None:
            meanwhile()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:] + err[-8000:]


def _one_process(
    tiny: Path, model_dir: Path, *, resume: bool = False, config: Path = SEED_CONFIG
) -> None:
    Trainer(
        TrainOptions(
            config_path=config,
            model_dir=model_dir,
            train_path=tiny / "train",
            eval_path=tiny / "eval",
            batch_size=GLOBAL_BATCH,
            num_workers=0,
            max_steps=STEPS,
            log_every=1,
            checkpoint_every=2,
            resume=resume,
            progress_bar=False,
        )
    ).fit()


@pytest.fixture(scope="module")
def runs(tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    _torchrun(
        2,
        _argv(tiny_samples, root / "two", GLOBAL_BATCH // 2),
        meanwhile=lambda: _one_process(tiny_samples, root / "one"),
    )
    return root


def _records(model_dir: Path, kind: str) -> list[dict]:
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _load(ckpt: Path) -> MultiTowerDIN:
    config = load_config(SEED_CONFIG)
    model = MultiTowerDIN.from_config(config, build_feature_set(config))
    load_checkpoint(ckpt, model)  # world size 1: every rank's keys
    return model


def assert_same_model(a_ckpt: Path, b_ckpt: Path) -> None:
    a, b = _load(a_ckpt), _load(b_ckpt)
    tol = dict(rtol=1e-4, atol=1e-5)  # Adam divides by sqrt(v): summation order shows a little
    for (name, p), q in zip(
        a.dense.state_dict().items(), b.dense.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, **tol, msg=name)  # type: ignore[arg-type]
    for (name, p), q in zip(
        a.sparse.dense.state_dict().items(), b.sparse.dense.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    for name in a.sparse.dynamic.tables:
        sa, sb = a.sparse.dynamic.table_state(name), b.sparse.dynamic.table_state(name)
        assert torch.equal(sa.keys, sb.keys) and torch.equal(sa.scores, sb.scores), name
        torch.testing.assert_close(sa.values, sb.values, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(sa.accumulators, sb.accumulators, rtol=1e-4, atol=1e-9)
        assert sa.counter_keys is not None and sb.counter_keys is not None
        ca = sorted(zip(sa.counter_keys.tolist(), sa.counter_counts.tolist(), strict=True))  # type: ignore[union-attr]
        cb = sorted(zip(sb.counter_keys.tolist(), sb.counter_counts.tolist(), strict=True))  # type: ignore[union-attr]
        assert ca == cb, name
    pa_, pb_ = (
        torch.load(c / "dense.pt", weights_only=False)["progress"] for c in (a_ckpt, b_ckpt)
    )
    assert pa_ == pb_


def test_two_ranks_train_like_one_process_with_the_global_batch(runs: Path) -> None:
    one, two = runs / "one", runs / "two"
    assert_same_model(one / "checkpoints" / "step_4", two / "checkpoints" / "step_4")
    t1, t2 = _records(one, "train"), _records(two, "train")
    assert [r["step"] for r in t2] == list(range(1, STEPS + 1))
    for r1, r2 in zip(t1, t2, strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
        assert r2["samples"] == r1["samples"]
        for name, s1 in r1["tables"].items():  # capacities differ: each rank has its own
            for k in ("size", "admitted", "admission_rejections", "evictions", "refusals"):
                assert r2["tables"][name][k] == s1[k], (name, k)
        a2a = r2["all_to_all"]
        assert a2a["bytes_rows"] > 0 and a2a["bytes_grads"] > 0 and 0 <= a2a["share"] <= 1
        assert a2a["unique"] <= a2a["lookups"]
    (e1,), (e2,) = _records(one, "eval"), _records(two, "eval")
    assert e2["rows"] == e1["rows"] and e2["tail_rows"] == e1["tail_rows"]
    for k in ("auc", "logloss", "oracle_auc", "head_auc", "tail_auc"):
        assert e2[k] == pytest.approx(e1[k], abs=1e-4), k
    (summary,) = _records(two, "summary")
    assert summary["world_size"] == 2 and summary["peak_memory_bytes"] > 0


def test_checkpoint_of_two_ranks_resumes_on_one_and_on_three(
    runs: Path, tiny_samples: Path
) -> None:
    start = runs / "two" / "checkpoints" / "step_2"
    for name in ("resumed1", "resumed3"):
        shutil.copytree(start, runs / name / "checkpoints" / "step_2")
    _torchrun(
        3,
        _argv(tiny_samples, runs / "resumed3", GLOBAL_BATCH // 3, "--resume"),
        meanwhile=lambda: _one_process(tiny_samples, runs / "resumed1", resume=True),
    )
    files = runs / "resumed3" / "checkpoints" / "step_4" / "dynamicemb" / DEEP_COLLECTION
    assert (files / "user_id_emb_emb_keys.rank_2.world_size_3").exists()
    assert not (files / "user_id_emb_emb_keys.rank_0.world_size_2").exists()
    want = runs / "one" / "checkpoints" / "step_4"
    assert_same_model(want, runs / "resumed1" / "checkpoints" / "step_4")
    assert_same_model(want, runs / "resumed3" / "checkpoints" / "step_4")


def test_bundle_of_two_ranks_scores_like_the_one_process_bundle(
    runs: Path, tiny_samples: Path
) -> None:
    from serve.offline import score_rows

    bundles = {
        n: export_bundle(SEED_CONFIG, out_dir=runs / f"bundle_{n}", model_dir=runs / n)
        for n in ("one", "two")
    }
    two = read_bundle(bundles["two"])
    assert two.manifest["tables"]["user_id_emb"]["parts"] == 2
    table = pq.read_table(next((tiny_samples / "eval").glob("*.parquet")))
    scores = {n: score_rows(b, table, tiled=False) for n, b in bundles.items()}
    np.testing.assert_allclose(scores["two"], scores["one"], rtol=1e-4, atol=1e-6)
    model, _, _ = restore_model(SEED_CONFIG, model_dir=runs / "two")  # the checkpoint itself
    from shared.fg import table_to_batch

    with torch.no_grad():
        direct = torch.sigmoid(model(table_to_batch(model.fs, table))).numpy()
    np.testing.assert_allclose(scores["two"], direct, rtol=1e-6, atol=1e-7)


def test_schedules_and_the_dense_ema_train_on_two_ranks_as_on_one(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """Learning-rate schedules on both optimizers (the sharded dynamic tables take each step's
    rate through the distributed collection) and the dense EMA: two ranks log the same rates and
    end with the one process's model and averages."""
    text = (
        SEED_CONFIG.read_text()
        .replace("constant_learning_rate {}",
                 "manual_step_learning_rate { schedule_sizes: [2] learning_rates: [0.05] }", 1)
        .replace("constant_learning_rate {}", "cosine_annealing_learning_rate { T_max: 4 }")
        .replace("adam_optimizer { lr: 0.001 }", "adam_optimizer { lr: 0.001 }\nema { decay: 0.5 }")
    )  # fmt: skip
    config = tmp_path / "scheduled.config"
    config.write_text(text)
    _torchrun(
        2,
        _argv(tiny_samples, tmp_path / "two", GLOBAL_BATCH // 2, config=config),
        meanwhile=lambda: _one_process(tiny_samples, tmp_path / "one", config=config),
    )
    one, two = (tmp_path / n / "checkpoints" / "step_4" for n in ("one", "two"))
    assert_same_model(one, two)
    t1, t2 = _records(tmp_path / "one", "train"), _records(tmp_path / "two", "train")
    rates = [(r["sparse_lr"], r["dense_lr"]) for r in t1]
    assert [(r["sparse_lr"], r["dense_lr"]) for r in t2] == rates
    assert len({s for s, _ in rates}) == 2 and len({d for _, d in rates}) == STEPS
    e1, e2 = (torch.load(c / "dense.pt", weights_only=False)["dense_ema"] for c in (one, two))
    assert e1.keys() == e2.keys() and e1
    for name, value in e1.items():
        torch.testing.assert_close(e2[name], value, rtol=1e-4, atol=1e-5, msg=name)
