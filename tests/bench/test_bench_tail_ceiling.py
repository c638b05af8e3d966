"""bench/bench_tail_ceiling.py on tiny data: the split, the tail and ceiling (a) are the
pipeline's (built samples, UserCounts, oracle_auc); each variant drops only its own terms."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from bench.bench_tail_ceiling import VARIANTS, ceiling_scores, main, split_rows, tail_ceiling
from train.data import synthetic, taobao
from train.evaluate import TAIL_THRESHOLD, UserCounts, _auc


@pytest.fixture(scope="module")
def sim() -> synthetic.Simulation:
    return synthetic.simulate_world("tiny", seed=0)


def _logit(p: np.ndarray) -> np.ndarray:
    p = p.astype(np.float64)
    return np.log(p / (1 - p))


def test_oracle_ceiling_is_the_pipelines(tiny_samples: Path) -> None:
    """(a) overall is synthetic.oracle_auc of the built eval split, and its head/tail AUCs and
    tail rows are those of train.evaluate's tail (UserCounts of the train split's user_id)."""
    result = tail_ceiling("tiny", seed=0)
    oracle, rows, ctr = synthetic.oracle_auc(tiny_samples, "eval")
    a = result["ceilings"]["oracle_p"]
    assert (a["auc"], result["eval_rows"]) == (oracle, rows)
    assert result["eval_ctr"] == pytest.approx(ctr)
    build = json.loads((tiny_samples / "_build_report.json").read_text())
    assert (result["train_rows"], result["dropped_rows"]) == (build["train_rows"], 0)
    table = pq.read_table(tiny_samples / "eval", columns=["user_id", "clk", taobao.ORACLE_COLUMN])
    counts = UserCounts.from_samples(tiny_samples / "train")
    tail = torch.from_numpy(counts.lookup(table.column("user_id").to_numpy()) < TAIL_THRESHOLD)
    p = torch.from_numpy(table.column(taobao.ORACLE_COLUMN).to_numpy().copy())
    y = torch.from_numpy(table.column("clk").to_numpy().astype(np.int64))
    assert 0 < result["tail_rows"] == int(tail.sum()) < rows
    assert (a["head_auc"], a["tail_auc"]) == (_auc(p[~tail], y[~tail]), _auc(p[tail], y[tail]))
    assert result["reconstruction"]["rows_differing_in_float32"] == 0
    for name, c in result["ceilings"].items():
        assert set(c) == {"what", "auc", "head_auc", "tail_auc"}, name
        assert all(0.0 <= c[k] <= 1.0 for k in ("auc", "head_auc", "tail_auc")), (name, c)


def _scores(
    sim: synthetic.Simulation, field: str | None = None, value: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """The eval rows' scores of ``sim``, with the world's array ``field`` replaced by ``value``."""
    world = copy.copy(sim.world)
    if field is not None:
        setattr(world, field, value)
    changed = dataclasses.replace(sim, world=world)
    return ceiling_scores(changed, np.flatnonzero(split_rows(sim.impressions.time)[1]))


def test_each_variant_drops_only_its_terms(sim: synthetic.Simulation) -> None:
    """(b) is the oracle logit less user_bias; replacing a user array that a variant does not
    read leaves its scores bit-identical, replacing one it reads changes them."""
    rng = np.random.default_rng(7)
    w, rows = sim.world, np.flatnonzero(split_rows(sim.impressions.time)[1])
    base = _scores(sim)
    assert list(base) == list(VARIANTS)
    back = _logit(base["no_user_bias"]) + w.user_bias[sim.impressions.user[rows]]
    np.testing.assert_allclose(back, _logit(base["oracle_p"]), atol=1e-5)
    replaced = {
        "user_bias": rng.normal(size=w.user_bias.shape),
        "user_emb": rng.normal(size=w.user_emb.shape),
        "demo_emb": rng.normal(size=w.demo_emb.shape),
        "user_fav": rng.integers(len(w.cate_emb), size=w.user_fav.shape),
        "user_price_sens": rng.normal(size=w.user_price_sens.shape),
    }
    price = {"user_price_sens"}
    reads = {  # (a) is the stored p: no world array is read again
        "oracle_p": set(),
        "no_user_bias": {"user_emb"} | price,
        "knowable_user_emb": {"demo_emb", "user_fav"} | price,
        "no_match": price,
        "demographic_match": {"demo_emb"} | price,
        "demographic_no_price": {"demo_emb"},
        "demographic_cate_match": {"demo_emb"} | price,
    }
    for field, value in replaced.items():
        other = _scores(sim, field, value)
        for name in VARIANTS:
            unchanged = np.array_equal(other[name], base[name])
            assert unchanged == (field not in reads[name]), (field, name)


def test_cli_writes_the_result(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    result = main(["--size", "tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["size"] == "tiny" and result["tail_threshold"] == TAIL_THRESHOLD
