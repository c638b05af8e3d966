"""bench/bench_tail_misses.py on small data (tiny's eval day has too few rows for a fit): every
eval sample joins its impression; a "model" that is the oracle misses nothing, one without a term
misses that term (its coefficient near 1); a prediction file of other rows is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from bench.bench_tail_ceiling import split_rows
from bench.bench_tail_misses import Learned, eval_terms, join_rows, learned_terms, main
from shared.features import FeatureSet
from train.data import synthetic
from train.evaluate import TAIL_THRESHOLD, UserCounts, write_predictions

SIZE = "small"


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory, seed_fs: FeatureSet) -> Path:
    from train.data.taobao import build_samples

    root = tmp_path_factory.mktemp("small")
    synthetic.generate(SIZE, root, seed=0)
    build_samples(root / "raw", root / "samples", seed_fs)
    return root / "samples"


def _predictions(samples: Path, out: Path, logit: np.ndarray | None = None) -> Path:
    """A prediction file in the eval samples' order: the oracle's p, or sigmoid(logit)."""
    table = pq.read_table(sorted((samples / "eval").glob("*.parquet")))
    users = table["user_id"].to_numpy()
    p = table["_oracle_p"].to_numpy().astype(np.float32)
    if logit is not None:
        p = (1 / (1 + np.exp(-logit))).astype(np.float32)
    tail = UserCounts.from_samples(samples / "train").lookup(users) < TAIL_THRESHOLD
    labels = torch.from_numpy(table["clk"].to_numpy().astype(np.float32))
    write_predictions(out, users, labels, torch.from_numpy(p), tail)
    return out


@pytest.fixture(scope="module")
def world() -> synthetic.Simulation:
    """The world of ``samples`` (seed 0), simulated once for the module's tests (about 1.4 s a
    simulation on a 2-core machine); the tests and the fits only read it."""
    return synthetic.simulate_world(SIZE, seed=0)


def test_every_sample_joins_its_impression(samples: Path, world: synthetic.Simulation) -> None:
    sim = world
    rows = np.flatnonzero(split_rows(sim.impressions.time)[1])
    order = join_rows(sim, rows, samples, seed=0)
    assert sorted(order.tolist()) == list(range(len(rows)))
    table = pq.read_table(sorted((samples / "eval").glob("*.parquet")))
    np.testing.assert_array_equal(table["_oracle_p"].to_numpy(), sim.impressions.p[rows][order])
    with pytest.raises(ValueError, match="this --size and --seed"):
        join_rows(synthetic.simulate_world(SIZE, seed=1), rows, samples, seed=1)


def test_the_oracle_misses_nothing_and_a_dropped_term_is_found(
    samples: Path, world: synthetic.Simulation, tmp_path: Path
) -> None:
    oracle = _predictions(samples, tmp_path / "oracle.parquet")
    result = main(["--size", SIZE, "--samples", str(samples), "--predictions", str(oracle),
                   "--out", str(tmp_path / "o.json")])  # fmt: skip
    head = result["head"]
    assert head["rows"] > 1000
    assert all(abs(fit["auc_gain"]) < 0.01 for fit in head["plus"].values())
    carried = head["expressed"]["logit"]  # the oracle's logit is the terms' sum
    assert all(c == pytest.approx(1.0, abs=1e-3) for c in carried.values()), carried
    assert 0.0 < head["expressed"]["learnable"]["ad_bias"] < 1.0
    buckets = head["by_cate_popularity"]  # small data: cates of fewer than 100K impressions
    assert buckets and sum(b["rows"] for b in buckets.values()) == head["rows"]
    for b in buckets.values():
        assert all(c == pytest.approx(1.0, abs=1e-3) for c in b["logit"].values()), b
    rare, common = (buckets[k]["learnable_cate"] for k in ("[0, 1000)", "[10000, 100000)"))
    assert 0.0 < rare < common < 1.0

    sim = world
    rows = np.flatnonzero(split_rows(sim.impressions.time)[1])
    order = join_rows(sim, rows, samples, seed=0)
    terms = eval_terms(sim, rows)
    p = sim.impressions.p[rows].astype(np.float64)
    without = (np.log(p / (1 - p)) - terms["ad_bias"])[order]
    dropped = _predictions(samples, tmp_path / "dropped.parquet", without)
    result = main(["--size", SIZE, "--samples", str(samples), "--predictions", str(dropped),
                   "--out", str(tmp_path / "d.json")])  # fmt: skip
    fit = result["head"]["plus"]["ad_bias"]
    assert fit["auc_gain"] > 0.005
    model_coef, term_coef = fit["coefficients"][0][:2]
    assert model_coef == pytest.approx(1.0, abs=0.25) and term_coef == pytest.approx(1.0, abs=0.25)
    found = ("ad_bias", "ad_bias_learnable", "knowable", "learnable")
    assert max(abs(f["auc_gain"]) for k, f in result["head"]["plus"].items()
               if k not in found) < fit["auc_gain"]  # fmt: skip
    learnable = result["head"]["plus"]["ad_bias_learnable"]  # what the data tell of it: part
    assert 0.0 < learnable["auc_gain"] < fit["auc_gain"]


@pytest.fixture(scope="module")
def learned(world: synthetic.Simulation) -> tuple[synthetic.Simulation, np.ndarray, Learned]:
    train, _ = split_rows(world.impressions.time)
    return world, train, learned_terms(world, train)


def test_learned_ad_terms_shrink_towards_the_prior_as_the_impressions_allow(
    learned: tuple[synthetic.Simulation, np.ndarray, Learned],
) -> None:
    """An ad with no training impression keeps the prior's mean (0); the estimates follow the
    true terms, closer for ads seen more often, and shrunk (slope under 1), as a posterior's
    mode is."""
    sim, train, est = learned
    w = sim.world
    seen = np.bincount(sim.impressions.ad[train], minlength=len(w.ad_bias))
    assert (seen == 0).sum() > 1000
    assert (est.ad_bias[seen == 0] == 0).all() and (est.ad_offset[seen == 0] == 0).all()
    true_offset = w.ad_emb - w.cate_emb[w.ad_cate]
    rare, common = (seen > 0) & (seen < 10), seen >= 300
    assert rare.sum() > 1000 and common.sum() > 50
    slopes = [np.polyfit(w.ad_bias[m], est.ad_bias[m], 1)[0] for m in (rare, common)]
    assert 0.0 < slopes[0] < slopes[1] < 1.0 and slopes[1] > 0.3
    corr = [np.corrcoef(true_offset[m].ravel(), est.ad_offset[m].ravel())[0, 1]
            for m in (rare, common)]  # fmt: skip
    assert 0.0 < corr[0] < corr[1]


def test_learned_cate_vectors_are_as_good_as_their_cate_is_common(
    learned: tuple[synthetic.Simulation, np.ndarray, Learned],
) -> None:
    """A cate's vector pools the impressions of all its ads: a common cate's estimate is near
    its true vector, a rare one's shrunk towards 0 (small data: every cate is seen)."""
    sim, train, est = learned
    w = sim.world
    seen = np.bincount(w.ad_cate[sim.impressions.ad[train]], minlength=len(w.cate_emb))
    rare, common = seen < 100, seen >= 1000
    assert rare.sum() > 100 and common.sum() > 20
    slopes = [np.polyfit(w.cate_emb[m].ravel(), est.cate_emb[m].ravel(), 1)[0]
              for m in (rare, common)]  # fmt: skip
    assert 0.0 < slopes[0] < slopes[1] < 1.0 and slopes[1] > 0.6


def test_predictions_of_other_rows_are_refused(samples: Path, tmp_path: Path) -> None:
    path = _predictions(samples, tmp_path / "p.parquet")
    table = pq.read_table(path)
    shuffled = table.take(np.random.default_rng(0).permutation(table.num_rows))
    pq.write_table(shuffled, path)
    with pytest.raises(ValueError, match="not the eval samples' in order"):
        main(["--size", SIZE, "--samples", str(samples), "--predictions", str(path),
              "--out", str(tmp_path / "x.json")])  # fmt: skip
