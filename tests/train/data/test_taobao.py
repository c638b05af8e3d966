"""Joining the raw Taobao files into samples: the join, leakage, the split, bad files."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from shared.features import FeatureSet, feature_set_from_text
from train.data import synthetic, taobao

ROOT = Path(__file__).resolve().parents[3]
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
T0 = taobao.day_start(taobao.TRAIN_FIRST_DAY)  # 2017-05-06 00:00:00 UTC+8
EVAL0 = taobao.day_start(taobao.EVAL_DAY)  # 2017-05-13 00:00:00 UTC+8
SEQ = ("click_50_seq__adgroup_id", "click_50_seq__cate_id", "click_50_seq__brand")

# rows in file order; the file is deliberately not sorted
RAW = [
    (1, T0 + 300, 14, "430548_1007", 0, 1),  # sees 10, 12 (the clicks at +100, file order)
    (2, T0 + 50, 11, "430539_1007", 1, 0),  # user 2: no profile row, no clicks before
    (1, T0 + 100, 10, "430548_1007", 0, 1),  # click; sees nothing
    (1, T0 + 100, 11, "430548_1007", 1, 0),  # same second as two clicks: sees nothing
    (1, T0 + 100, 12, "430548_1007", 0, 1),  # click in the same second: sees nothing
    (1, T0 + 200, 13, "430539_1007", 1, 0),  # sees 10, 12
    (1, T0 + 300, 10, "430548_1007", 1, 0),  # same second as the click on 14: sees 10, 12
    (2, EVAL0 - 1, 13, "430548_1007", 0, 1),  # last second of 05-12: train
    (2, EVAL0, 99, "430548_1007", 1, 0),  # first second of 05-13: eval; ad 99 unknown
    (1, EVAL0 + 5, 11, "430539_1007", 1, 0),  # eval; sees 10, 12, 14
    (1, EVAL0 + 86400, 11, "430539_1007", 1, 0),  # 05-14: dropped
    (3, T0 - 1, 11, "430539_1007", 1, 0),  # 05-05: dropped
]
ADS = [
    ("adgroup_id", "cate_id", "campaign_id", "customer", "brand", "price"),
    (10, 100, 1000, 1, "NULL", "170.0"),
    (11, 101, 1001, 1, "7", "1.1"),
    (12, 102, 1002, 2, "", "-3"),  # brand empty, bad price → null (counted)
    (13, 103, 1003, 2, "8", "38"),
    (14, 104, 1004, 3, "9", "99.5"),
]
PROFILE = [
    taobao.USER_PROFILE_HEADER,  # with the trailing space of the published file
    (1, 0, 5, 2, 5, "", 3, 0, 3),
]


def write_csv(path: Path, rows: list[tuple]) -> None:
    with path.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


@pytest.fixture(scope="module")
def fs() -> FeatureSet:
    return feature_set_from_text(SEED_TEXT, "seed")


@pytest.fixture(scope="module")
def hand(
    tmp_path_factory: pytest.TempPathFactory, fs: FeatureSet
) -> tuple[Path, taobao.BuildReport]:
    raw = tmp_path_factory.mktemp("hand") / "raw"
    raw.mkdir()
    write_csv(raw / taobao.RAW_SAMPLE, [taobao.RAW_SAMPLE_HEADER, *RAW])
    write_csv(raw / taobao.AD_FEATURE, ADS)
    write_csv(raw / taobao.USER_PROFILE, PROFILE)
    write_csv(raw / taobao.BEHAVIOR_LOG, [taobao.BEHAVIOR_LOG_HEADER])
    assert (raw / taobao.USER_PROFILE).read_text().startswith("userid,")
    assert "new_user_class_level \n" in (raw / taobao.USER_PROFILE).read_text()
    out = raw.parent / "samples"
    return out, taobao.build_samples(raw, out, fs, row_group_rows=4)


def rows_of(out: Path, split: str) -> list[dict]:
    rows = pq.read_table(out / split).to_pylist()
    return sorted(rows, key=lambda r: (r["user_id"], r["time_stamp"], r["adgroup_id"]))


def test_join_split_and_tie_rule_on_hand_written_files(
    hand: tuple[Path, taobao.BuildReport],
) -> None:
    out, report = hand
    train, evals = rows_of(out, "train"), rows_of(out, "eval")
    assert (report.train_rows, report.eval_rows, report.dropped_other_days) == (8, 2, 2)
    assert [len(train), len(evals)] == [8, 2]
    seqs = {
        (r["user_id"], r["time_stamp"], r["adgroup_id"]): tuple(r[s] for s in SEQ)
        for r in train + evals
    }
    empty = ("", "", "")
    assert seqs[(1, T0 + 100, 10)] == empty  # own click and same-second clicks are not visible
    assert seqs[(1, T0 + 100, 11)] == empty
    assert seqs[(1, T0 + 100, 12)] == empty
    assert seqs[(1, T0 + 200, 13)] == ("10|12", "100|102", "|")  # both clicked ads lack brand
    assert seqs[(1, T0 + 300, 14)] == ("10|12", "100|102", "|")
    assert seqs[(1, T0 + 300, 10)] == ("10|12", "100|102", "|")
    assert seqs[(1, EVAL0 + 5, 11)] == ("10|12|14", "100|102|104", "||9")
    assert seqs[(2, EVAL0, 99)] == ("13", "103", "8")  # the 05-12 click is visible on 05-13
    assert seqs[(2, EVAL0 - 1, 13)] == empty
    # scalars: profile join (user 2 has none), ad join (ad 99 unknown), NULL/empty brand, price
    u1 = next(r for r in train if r["user_id"] == 1)
    assert (
        u1["cms_group_id"],
        u1["age_level"],
        u1["pvalue_level"],
        u1["new_user_class_level"],
    ) == (5, 5, None, 3)
    u2 = next(r for r in train if r["user_id"] == 2)
    assert all(u2[c] is None for c in ("cms_segid", "age_level", "occupation"))
    unknown = next(r for r in evals if r["adgroup_id"] == 99)
    assert all(unknown[c] is None for c in ("cate_id", "campaign_id", "customer", "brand", "price"))
    by_ad = {r["adgroup_id"]: r for r in train}
    assert by_ad[10]["brand"] is None and by_ad[11]["brand"] == 7 and by_ad[12]["brand"] is None
    assert by_ad[11]["price"] == 1.1 and by_ad[12]["price"] is None
    row13 = next(r for r in train if (r["user_id"], r["adgroup_id"]) == (1, 13))
    assert (row13["pid"], row13["clk"], row13["price"], row13["cate_id"]) == (
        "430539_1007",
        0,
        38.0,
        103,
    )
    assert report.samples_without_profile == 4 and report.samples_with_unknown_ad == 1
    assert report.ads_with_bad_price == 1 and not report.has_oracle
    assert "_oracle_p" not in pq.read_schema(next((out / "train").glob("*.parquet"))).names
    assert (out / "_build_report.json").is_file()


def test_sample_schema_follows_the_feature_set(
    hand: tuple[Path, taobao.BuildReport], fs: FeatureSet
) -> None:
    out, _ = hand
    schema = pq.read_schema(next((out / "train").glob("*.parquet")))
    assert schema.names == [*fs.features, "clk", "time_stamp"]
    assert (
        str(schema.field("user_id").type) == "int64" and str(schema.field("pid").type) == "string"
    )
    assert (
        str(schema.field("price").type) == "double" and str(schema.field(SEQ[2]).type) == "string"
    )
    assert (
        pq.ParquetFile(next((out / "train").glob("*.parquet"))).metadata.row_group(0).num_rows <= 4
    )


def test_sequence_cap_keeps_the_most_recent(
    tmp_path: Path, hand: tuple[Path, taobao.BuildReport]
) -> None:
    fs2 = feature_set_from_text(SEED_TEXT.replace("sequence_length: 100", "sequence_length: 2"))
    out = tmp_path / "samples"
    report = taobao.build_samples(hand[0].parent / "raw", out, fs2)
    last = next(r for r in rows_of(out, "eval") if r["user_id"] == 1)
    assert (last[SEQ[0]], last[SEQ[2]]) == ("12|14", "|9")
    assert report.samples_at_sequence_cap == 4 and report.max_sequence_length == 2


def test_no_sample_sees_its_own_or_a_later_click(tmp_path: Path, fs: FeatureSet) -> None:
    """Brute force on generated data (ties included): the sequence is exactly the user's clicks
    of strictly earlier seconds, in (second, file row) order, the last 100."""
    gen = synthetic.generate("tiny", tmp_path, seed=3)
    report = taobao.build_samples(tmp_path / "raw", tmp_path / "samples", fs, chunk_rows=1000)
    with (tmp_path / "raw" / taobao.RAW_SAMPLE).open() as f:
        raw = [
            tuple(int(x) if i != 3 else x for i, x in enumerate(r)) for r in list(csv.reader(f))[1:]
        ]
    ads = {
        int(r[0]): r for r in list(csv.reader((tmp_path / "raw" / taobao.AD_FEATURE).open()))[1:]
    }
    clicks: dict[int, list[tuple[int, int, int]]] = {}
    for i, (user, ts, ad, _, _, clk) in enumerate(raw):
        if clk:
            clicks.setdefault(user, []).append((ts, i, ad))
    ties = 0
    samples = rows_of(tmp_path / "samples", "train") + rows_of(tmp_path / "samples", "eval")
    assert len(samples) == len(raw) == gen.samples
    for r in samples:
        seen = sorted(c for c in clicks.get(r["user_id"], []) if c[0] < r["time_stamp"])[-100:]
        ties += sum(c[0] == r["time_stamp"] for c in clicks.get(r["user_id"], []))
        assert r[SEQ[0]] == "|".join(str(c[2]) for c in seen)
        assert r[SEQ[1]] == "|".join(ads[c[2]][1] for c in seen)
        brands = [ads[c[2]][4] for c in seen]
        assert r[SEQ[2]] == "|".join("" if b == "NULL" else b for b in brands)
    assert ties > 0, "the generated data must contain same-second clicks"
    total = sum(len(r[SEQ[0]].split("|")) if r[SEQ[0]] else 0 for r in samples)
    assert total == round(gen.mean_sequence_length * gen.samples)  # the generator's own count
    assert report.has_oracle and report.missing_sequence_tokens.get(SEQ[2], 0) > 0


def test_oracle_is_attached_by_raw_row(tmp_path: Path, fs: FeatureSet) -> None:
    synthetic.generate("tiny", tmp_path, seed=1)
    taobao.build_samples(tmp_path / "raw", tmp_path / "samples", fs)
    oracle = pq.read_table(tmp_path / "raw" / taobao.ORACLE_FILE)
    built = pq.read_table(tmp_path / "samples")
    assert built.column("_oracle_p").type == oracle.column("p").type  # float32
    want = sorted(
        zip(oracle.column("user").to_pylist(), oracle.column("p").to_pylist(), strict=True)
    )
    got = sorted(
        zip(built.column("user_id").to_pylist(), built.column("_oracle_p").to_pylist(), strict=True)
    )
    assert got == want
    # a side file that does not belong to raw_sample.csv is refused
    pq.write_table(oracle.slice(1), tmp_path / "raw" / taobao.ORACLE_FILE)
    with pytest.raises(ValueError, match="row-aligned"):
        taobao.build_samples(tmp_path / "raw", tmp_path / "again", fs)


def test_bad_inputs_are_refused(
    tmp_path: Path, hand: tuple[Path, taobao.BuildReport], fs: FeatureSet
) -> None:
    raw = hand[0].parent / "raw"
    bad = tmp_path / "raw"
    bad.mkdir()
    for name in (taobao.AD_FEATURE, taobao.USER_PROFILE, taobao.BEHAVIOR_LOG):
        (bad / name).write_bytes((raw / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="raw_sample.csv"):
        taobao.build_samples(bad, tmp_path / "out", fs)
    write_csv(bad / taobao.RAW_SAMPLE, [("user", "time", "adgroup_id", "pid", "nonclk", "clk")])
    with pytest.raises(ValueError, match="raw_sample.csv: header"):
        taobao.build_samples(bad, tmp_path / "out", fs)
    write_csv(bad / taobao.RAW_SAMPLE, [taobao.RAW_SAMPLE_HEADER, (1, T0, 10, "x", 1, 1)])
    with pytest.raises(ValueError, match="nonclk = 1 - clk"):
        taobao.build_samples(bad, tmp_path / "out", fs)
    write_csv(bad / taobao.RAW_SAMPLE, [taobao.RAW_SAMPLE_HEADER, (1, "", 10, "x", 1, 0)])
    with pytest.raises(ValueError, match="empty time_stamp"):
        taobao.build_samples(bad, tmp_path / "out", fs)
    write_csv(bad / taobao.AD_FEATURE, [*ADS, ADS[1]])
    with pytest.raises(ValueError, match="adgroup_id 10 appears more than once"):
        taobao.build_samples(bad, tmp_path / "out", fs)
    odd = feature_set_from_text(
        SEED_TEXT.replace('expression: "user:occupation"', 'expression: "user:job"')
    )
    with pytest.raises(ValueError, match="user:job"):
        taobao.build_samples(raw, tmp_path / "out", odd)


def test_split_days_are_utc_plus_8() -> None:
    days = taobao.sample_days(np.array([EVAL0 - 1, EVAL0, T0]))
    eval_day = taobao.day_index(taobao.EVAL_DAY)
    assert days.tolist() == [eval_day - 1, eval_day, eval_day - 7]
    assert EVAL0 == 1494604800  # 2017-05-12 16:00:00 UTC


def test_the_files_are_the_same_whatever_the_threads(tmp_path: Path, fs: FeatureSet) -> None:
    """Chunks built on several threads are written in chunk order: byte-identical files and
    the same report (missing sequence tokens included) as one thread."""
    synthetic.generate("tiny", tmp_path, seed=1)
    ads = tmp_path / "raw" / taobao.AD_FEATURE
    lines = ads.read_text().splitlines(keepends=True)
    ads.write_text("".join(lines[:-40]))  # ads without a row: missing tokens and nulls
    reports = {}
    for threads in (1, 4):
        out = tmp_path / f"t{threads}"
        reports[threads] = taobao.build_samples(tmp_path / "raw", out, fs, chunk_rows=700,
                                                threads=threads, row_group_rows=256)  # fmt: skip
    assert reports[1].missing_sequence_tokens and reports[1].samples_with_unknown_ad
    assert reports[1].to_json() == reports[4].to_json()
    files = sorted(p.relative_to(tmp_path / "t1") for p in (tmp_path / "t1").rglob("*.parquet"))
    assert len(files) >= 2
    for f in files:
        assert (tmp_path / "t1" / f).read_bytes() == (tmp_path / "t4" / f).read_bytes(), f
