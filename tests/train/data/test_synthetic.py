"""The synthetic generator: the published files' quirks, the planted statistics, reproducibility."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from train.data import synthetic, taobao

FILES = (taobao.RAW_SAMPLE, taobao.AD_FEATURE, taobao.USER_PROFILE, taobao.BEHAVIOR_LOG)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, synthetic.GenerateReport]:
    out = tmp_path_factory.mktemp("tiny")
    return out / "raw", synthetic.generate("tiny", out, seed=0)


def read(path: Path) -> list[list[str]]:
    with path.open() as f:
        return list(csv.reader(f))


def test_files_have_the_published_headers_and_quirks(
    tiny: tuple[Path, synthetic.GenerateReport],
) -> None:
    raw, report = tiny
    headers = {
        taobao.RAW_SAMPLE: taobao.RAW_SAMPLE_HEADER,
        taobao.AD_FEATURE: taobao.AD_FEATURE_HEADER,
        taobao.USER_PROFILE: taobao.USER_PROFILE_HEADER,
        taobao.BEHAVIOR_LOG: taobao.BEHAVIOR_LOG_HEADER,
    }
    for name, header in headers.items():
        first = (raw / name).read_text().split("\n", 1)[0]
        assert first == ",".join(header), name
    assert (
        (raw / taobao.USER_PROFILE).read_text().split("\n", 1)[0].endswith("new_user_class_level ")
    )
    profile = read(raw / taobao.USER_PROFILE)[1:]
    assert any(r[5] == "" for r in profile) and any(r[8] == "" for r in profile)  # empty fields
    ads = read(raw / taobao.AD_FEATURE)[1:]
    assert 0.1 < sum(r[4] == "NULL" for r in ads) / len(ads) < 0.45  # NULL brands
    samples = read(raw / taobao.RAW_SAMPLE)[1:]
    assert len(samples) == report.samples == synthetic.SIZES["tiny"].samples
    assert all(re.fullmatch(r"\d+_\d+", r[3]) for r in samples)
    assert {r[3] for r in samples} == set(synthetic.PIDS)
    assert all(int(r[4]) + int(r[5]) == 1 for r in samples)
    users = {r[0] for r in samples}
    without = len(users - {r[0] for r in profile}) / len(users)
    assert 0.03 < without < 0.12  # ~7 % of users have no profile row
    seconds = [(r[0], r[1]) for r in samples]
    assert len(set(seconds)) < len(seconds)  # one user, several impressions in one second
    ts = np.array([int(r[1]) for r in samples])
    days = taobao.sample_days(ts)
    first, last = taobao.day_index(taobao.TRAIN_FIRST_DAY), taobao.day_index(taobao.EVAL_DAY)
    assert days.min() == first and days.max() == last  # 05-06 .. 05-13 in UTC+8
    assert ts.tolist() != sorted(ts.tolist())  # like the real file, not in time order


def test_planted_statistics(tiny: tuple[Path, synthetic.GenerateReport]) -> None:
    raw, r = tiny
    assert 0.035 < r.ctr < 0.07
    assert 2.5 < r.mean_sequence_length < 6.0
    assert r.max_prior_clicks >= 30  # a long tail of heavy clickers
    assert r.ads_seen_lt3 > 0.15 and r.users_seen_lt3 > 0.15  # many ids seen < 3 times
    oracle = pq.read_table(raw / taobao.ORACLE_FILE)
    assert oracle.num_rows == r.samples and str(oracle.column("p").type) == "float"
    p = oracle.column("p").to_numpy()
    assert abs(p.mean() - r.ctr) < 0.015  # calibrated probabilities


def test_generation_is_reproducible(
    tmp_path: Path, tiny: tuple[Path, synthetic.GenerateReport]
) -> None:
    raw, _ = tiny
    synthetic.generate("tiny", tmp_path / "same", seed=0)
    for name in (*FILES, taobao.ORACLE_FILE):
        assert (tmp_path / "same" / "raw" / name).read_bytes() == (raw / name).read_bytes(), name
    synthetic.generate("tiny", tmp_path / "other", seed=1)
    other = (tmp_path / "other" / "raw" / taobao.RAW_SAMPLE).read_bytes()
    assert other != (raw / taobao.RAW_SAMPLE).read_bytes()


def test_click_history_matters_in_the_planted_model(tmp_path: Path) -> None:
    """Without the history terms (same world, same draws) the probabilities change, and the
    mean probability of impressions whose user clicked before rises with history."""
    spec = synthetic.SIZES["tiny"]
    model = synthetic.ClickModel()
    flat = synthetic.ClickModel(hist_cate=0.0, hist_brand=0.0)
    runs = []
    for m in (model, flat):
        world = synthetic._make_world(spec, m, np.random.default_rng([0, 0]))
        users = np.arange(spec.users)
        runs.append(
            synthetic._simulate(world, users, spec.samples, -3.0, m, np.random.default_rng(5))
        )
    with_hist, without = runs
    first = with_hist.prior_clicks == 0  # no history yet: identical draws, identical p
    np.testing.assert_array_equal(with_hist.p[first], without.p[first])
    assert with_hist.p[~first].mean() > without.p[~first].mean()


def test_sizes_match_the_public_dataset() -> None:
    full = synthetic.SIZES["full"]
    assert (full.samples, full.users, full.ads) == (26_557_961, 1_141_729, 846_811)
    assert synthetic.SIZES["small"].samples <= 400_000


def test_public_ids_are_the_ids_of_the_files(tiny: tuple[Path, synthetic.GenerateReport]) -> None:
    """Impression i of the simulation is the raw sample of its user's and ad's public ids at its
    second: the join :mod:`bench.bench_tail_misses` makes."""
    raw, _ = tiny
    sim = synthetic.simulate_world("tiny", seed=0)
    ids = synthetic.public_ids(sim.spec, seed=0)
    imp = sim.impressions
    rows = taobao.read_raw_sample(raw)
    want = sorted(zip(ids.user[imp.user].tolist(), ids.ad[imp.ad].tolist(), imp.time.tolist(),
                      imp.clk.tolist(), strict=True))  # fmt: skip
    got = sorted(zip(rows.user.tolist(), rows.adgroup_id.tolist(), rows.time_stamp.tolist(),
                     rows.clk.tolist(), strict=True))  # fmt: skip
    assert got == want
