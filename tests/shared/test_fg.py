"""Feature generation: hand-computed tensors, train/serve identity, every bad-data case."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from shared.features import FeatureSet, Side, feature_set_from_text
from shared.fg import FeatureError, FgStats, hash64, request_to_batch, table_to_batch

ROOT = Path(__file__).resolve().parents[2]
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
BASE_TEXT = (ROOT / "configs" / "multi_tower_din_taobao.config").read_text()
MASK64 = (1 << 64) - 1
SEQ = ("click_50_seq__adgroup_id", "click_50_seq__cate_id", "click_50_seq__brand")
USER = (
    "user_id",
    "cms_segid",
    "cms_group_id",
    "final_gender_code",
    "age_level",
    "pvalue_level",
    "shopping_level",
    "occupation",
    "new_user_class_level",
)


@pytest.fixture(scope="module")
def fs() -> FeatureSet:
    return feature_set_from_text(SEED_TEXT, "seed")


def ref_hash(s: str) -> int:
    """Pure-Python FNV-1a 64 + SplitMix64 finalizer: the reference for :func:`shared.fg.hash64`."""
    h = 0xCBF29CE484222325
    for b in s.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
    return h ^ (h >> 31)


def rows_table(rows: list[dict[str, object]], fs: FeatureSet) -> pa.Table:
    """Rows (feature name → value) as a table with the sample schema build_samples writes."""
    types = {name: pa.int64() for name in fs.features}
    types |= {"pid": pa.string(), "price": pa.float64(), **dict.fromkeys(SEQ, pa.string())}
    cols = {name: pa.array([r.get(name) for r in rows], types[name]) for name in fs.features}
    cols["clk"] = pa.array([r.get("clk", 0) for r in rows], pa.int8())
    if any("_oracle_p" in r for r in rows):
        cols["_oracle_p"] = pa.array([r["_oracle_p"] for r in rows], pa.float32())
    return pa.table(cols)


def base_row(**over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "user_id": 1234,
        "cms_segid": 100,  # 100 % 98 = 2
        "cms_group_id": 5,
        "final_gender_code": 2,
        "age_level": 3,
        "pvalue_level": None,
        "shopping_level": 3,
        "occupation": 0,
        "new_user_class_level": 9,  # 9 % 6 = 3
        "adgroup_id": 63133,
        "cate_id": 6406,
        "campaign_id": 83237,
        "customer": 1,
        "brand": 95471,
        "price": 170.0,
        "pid": "430548_1007",
        "click_50_seq__adgroup_id": "11|22|33",
        "click_50_seq__cate_id": "1|2|3",
        "click_50_seq__brand": "7||9",
        "clk": 1,
    }
    return row | over


def jagged(kjt, key: str) -> list[list[int]]:
    jt = kjt[key]
    return [v.tolist() for v in torch.split(jt.values(), jt.lengths().tolist())]


# --------------------------------------------------------------------------- hashing / parsing


def test_hash64_matches_reference_and_golden() -> None:
    words = ["", "a", "430548_1007", "430539_1007", "héllo wörld", "x" * 37, "0", "12345678901"]
    got = hash64(pa.array(words))
    assert [int(h) for h in got] == [ref_hash(w) for w in words]
    # golden: ids cross the train → serve boundary (bundles), the function must never change
    assert int(got[2]) == GOLDEN_PID_HASH
    # the dataset's two pids must not share one of the config's 20 buckets
    assert {int(h) % 20 for h in got[2:4]} == {6, 18}


GOLDEN_PID_HASH = 0x256786E14CF7B4E


def test_sequence_tokens_parse_like_int(fs: FeatureSet) -> None:
    rng = np.random.default_rng(0)
    vals = [int(x) for x in rng.integers(0, 2**63 - 1, 300)]
    vals += [int(x) for x in rng.integers(0, 10 ** rng.integers(1, 9, 300))] + [0, 2**63 - 1]
    toks = [str(v) for v in vals] + ["007", "000000000000000042"]
    vals += [7, 42]
    n = len(toks)
    row = base_row(
        click_50_seq__adgroup_id="|".join(toks),
        click_50_seq__cate_id="|".join(["1"] * n),
        click_50_seq__brand="|".join(["1"] * n),
    )
    big = feature_set_from_text(SEED_TEXT.replace("sequence_length: 100", "sequence_length: 1000"))
    batch = table_to_batch(big, rows_table([row], big))
    assert jagged(batch.sequence, "click_50_seq__adgroup_id") == [vals]


# --------------------------------------------------------------------------- hand-computed batch


def test_batch_equals_hand_computed_expectation(fs: FeatureSet) -> None:
    rows = [
        base_row(),
        base_row(
            user_id=5,
            cms_segid=None,
            brand=None,
            price=1.1,  # equal to the first boundary: bucket 1
            pid="430539_1007",
            click_50_seq__adgroup_id="",
            click_50_seq__cate_id="",
            click_50_seq__brand="",
            clk=0,
        ),
        base_row(
            user_id=77,
            price=0.5,
            click_50_seq__adgroup_id="44",
            click_50_seq__cate_id="4",
            click_50_seq__brand="",  # one clicked ad without brand
            clk=0,
        ),
    ]
    stats = FgStats()
    batch = table_to_batch(fs, rows_table(rows, fs), stats=stats)
    assert batch.batch_size == 3 and batch.num_users == 3
    assert batch.user.keys() == list(USER)
    assert batch.item.keys() == [
        "adgroup_id",
        "brand",
        "campaign_id",
        "customer",
        "cate_id",
        "pid",
        "price",
    ]
    assert batch.sequence.keys() == list(SEQ)
    assert jagged(batch.user, "user_id") == [[1234], [5], [77]]  # dynamic: raw id
    assert jagged(batch.user, "cms_segid") == [[2], [], [2]]  # mod 98; null → empty bag
    assert jagged(batch.user, "pvalue_level") == [[], [], []]
    assert jagged(batch.user, "new_user_class_level") == [[3], [3], [3]]
    assert jagged(batch.item, "brand") == [[95471], [], [95471]]
    pid = [ref_hash(p) % 20 for p in ("430548_1007", "430539_1007", "430548_1007")]
    assert jagged(batch.item, "pid") == [[p] for p in pid]
    # boundaries [1.1, 2.2, ..., 168, 171.8, ...] (98, stored as float32 by the proto)
    assert len(fs.features["price"].boundaries) == 98
    assert jagged(batch.item, "price") == [[55], [1], [0]]  # 168 <= 170 < 171.8 is bucket 55
    assert jagged(batch.sequence, "click_50_seq__adgroup_id") == [[11, 22, 33], [], [44]]
    assert jagged(batch.sequence, "click_50_seq__cate_id") == [[1, 2, 3], [], [4]]
    assert jagged(batch.sequence, "click_50_seq__brand") == [[7, 0, 9], [], [0]]
    assert batch.sequence.lengths().dtype == torch.int32
    assert batch.sequence.values().dtype == torch.int64
    assert torch.equal(batch.user_index, torch.arange(3))
    assert torch.equal(batch.labels, torch.tensor([1.0, 0.0, 0.0]))
    assert batch.oracle is None
    assert stats.rows == 3
    assert stats.missing == {"cms_segid": 1, "pvalue_level": 3, "brand": 1}
    assert stats.missing_tokens == {"click_50_seq__brand": 2}
    assert "click_50_seq__brand: 2" in stats.report()


def test_other_transforms_of_the_baseline_config() -> None:
    base = feature_set_from_text(BASE_TEXT, "base")
    batch = table_to_batch(base, rows_table([base_row(user_id=1141731)], base))
    nb = base.features["user_id"].num_buckets
    assert jagged(batch.user, "user_id") == [[1141731 % nb]]
    seq_nb = base.features["click_50_seq__adgroup_id"].num_buckets
    assert jagged(batch.sequence, "click_50_seq__adgroup_id") == [[11 % seq_nb, 22, 33]]


def test_oracle_column_becomes_batch_oracle(fs: FeatureSet) -> None:
    batch = table_to_batch(fs, rows_table([base_row(_oracle_p=0.25)], fs))
    assert batch.oracle is not None and batch.oracle.tolist() == [0.25]


def test_slices_chunks_and_list_columns_give_the_same_ids(fs: FeatureSet) -> None:
    rows = [base_row(user_id=i, cms_segid=None if i % 3 else i, price=float(i)) for i in range(20)]
    table = rows_table(rows, fs)
    whole = table_to_batch(fs, table)
    part = table_to_batch(fs, table.slice(5, 9))  # offset != 0 in every buffer
    chunked = table_to_batch(fs, pa.concat_tables([table.slice(0, 7), table.slice(7)]))
    for kjt_name in ("user", "item", "sequence"):
        keys = getattr(whole, kjt_name).keys()  # a KJT is not a dict
        for key in keys:
            full = jagged(getattr(whole, kjt_name), key)
            assert jagged(getattr(part, kjt_name), key) == full[5:14]
            assert jagged(getattr(chunked, kjt_name), key) == full
    # list<int64> sequence columns are taken as they are (None element = missing token)
    lists = table
    for name, vals in zip(SEQ, ([11, 22, 33], [1, 2, 3], [7, None, 9]), strict=True):
        col = pa.array([vals] * 20, pa.list_(pa.int64()))
        lists = lists.set_column(lists.schema.get_field_index(name), name, col)
    from_lists = table_to_batch(fs, lists)
    for key in SEQ:
        assert jagged(from_lists.sequence, key) == jagged(whole.sequence, key)


# --------------------------------------------------------------------------- train == serve


def _request_from_row(fs: FeatureSet, row: dict[str, object]) -> dict[str, object]:
    # the documented string encoding: all sub-sequences "" = empty; else "" token = missing
    seqs = {name: [int(t) if t else None for t in str(row[name]).split("|")] for name in SEQ}
    if all(row[name] == "" for name in SEQ):
        seqs = dict.fromkeys(SEQ, [])
    side = {n: s.side for n, s in fs.features.items() if not s.is_sequence}
    return {
        "user": {n: row[n] for n, s in side.items() if s is Side.USER},
        "context": {n: row[n] for n, s in side.items() if s is Side.CONTEXT},
        "candidates": [{n: row[n] for n, s in side.items() if s is Side.ITEM}],
        "sequences": seqs,
    }


def test_request_to_batch_gives_the_same_ids_as_table_to_batch(fs: FeatureSet) -> None:
    rows = [
        base_row(),
        base_row(brand=None, cms_segid=None, price=1.1, pid="430539_1007"),
        base_row(click_50_seq__adgroup_id="5", click_50_seq__cate_id="6", click_50_seq__brand=""),
        base_row(click_50_seq__adgroup_id="", click_50_seq__cate_id="", click_50_seq__brand=""),
    ]
    trained = table_to_batch(fs, rows_table(rows, fs))
    for i, row in enumerate(rows):
        served = request_to_batch(fs, **_request_from_row(fs, row))
        assert served.num_users == 1 and served.batch_size == 1 and served.labels is None
        for name in ("user", "item", "sequence"):
            want, got = getattr(trained, name), getattr(served, name)
            keys = want.keys()  # a KJT is not a dict
            assert got.keys() == keys
            for key in keys:
                assert jagged(got, key) == [jagged(want, key)[i]], (i, key)


def test_request_with_n_candidates_shares_user_and_context(fs: FeatureSet) -> None:
    req = _request_from_row(fs, base_row())
    cands = [
        dict(req["candidates"][0], adgroup_id=a, price=p)
        for a, p in ((1, 2.0), (2, None), (3, 5000))
    ]
    batch = request_to_batch(fs, **(req | {"candidates": cands}))
    assert batch.num_users == 1 and batch.batch_size == 3
    assert torch.equal(batch.user_index, torch.zeros(3, dtype=torch.int64))
    assert jagged(batch.item, "adgroup_id") == [[1], [2], [3]]
    assert jagged(batch.item, "pid") == [[ref_hash("430548_1007") % 20]] * 3
    assert jagged(batch.item, "price") == [[1], [], [96]]  # 1.1 <= 2 < 2.2; 3680 <= 5000 < 5160
    assert batch.sequence.stride() == 1 and batch.user.stride() == 1


# --------------------------------------------------------------------------- bad data


def _error(fs: FeatureSet, **over: object) -> FeatureError:
    with pytest.raises(FeatureError) as info:
        table_to_batch(fs, rows_table([base_row(), base_row(**over)], fs))
    return info.value


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"price": math.nan}, "price", "NaN"),
        ({"price": -1.0}, "price", "negative"),
        ({"price": math.inf}, "price", "infinite"),
        ({"user_id": -5}, "user_id", "negative"),
        ({"cms_segid": -1}, "cms_segid", "negative"),
        ({"click_50_seq__cate_id": "1|x|3"}, "click_50_seq__cate_id", "'x'"),
        ({"click_50_seq__cate_id": "1|-2|3"}, "click_50_seq__cate_id", "'-2'"),
        ({"click_50_seq__cate_id": "1| 2|3"}, "click_50_seq__cate_id", "' 2'"),
        (
            {"click_50_seq__adgroup_id": "1|9223372036854775808|3"},
            "click_50_seq__adgroup_id",
            "int64",
        ),
        (
            {"click_50_seq__adgroup_id": "1|99999999999999999999|3"},
            "click_50_seq__adgroup_id",
            "int64",
        ),
        ({"click_50_seq__brand": "1|2"}, "click_50_seq__brand", "aligned"),
    ],
)
def test_bad_values_raise_naming_the_field(
    fs: FeatureSet, over: dict, field: str, words: str
) -> None:
    err = _error(fs, **over)
    assert err.field == field and words in str(err), str(err)


def test_bad_column_types_raise_naming_the_field(fs: FeatureSet) -> None:
    table = rows_table([base_row()], fs)

    def with_col(name: str, col: pa.Array) -> pa.Table:
        return table.set_column(table.schema.get_field_index(name), name, col)

    cases = [
        ("user_id", pa.array([1.0])),  # float ids are refused
        ("cms_segid", pa.array([True])),  # so are bools
        ("adgroup_id", pa.array([2**63], pa.uint64())),  # outside int64
        ("cms_segid", pa.array(["99999999999999999999"])),  # MOD parses strings: outside int64
        ("cms_segid", pa.array(["abc"])),
        ("price", pa.array(["cheap"])),
        ("click_50_seq__adgroup_id", pa.array([3])),  # neither a string nor a list
    ]
    for name, col in cases:
        with pytest.raises(FeatureError) as info:
            table_to_batch(fs, with_col(name, col))
        assert info.value.field == name, (name, str(info.value))
    with pytest.raises(FeatureError) as info:
        table_to_batch(fs, table.drop_columns(["brand"]))
    assert info.value.field == "brand" and "missing" in str(info.value)
    with pytest.raises(FeatureError) as info:
        table_to_batch(fs, with_col("clk", pa.array([None], pa.int8())))
    assert info.value.field == "clk"
    # numeric strings are fine: MOD parses integer strings, price parses numbers
    ok = table_to_batch(
        fs,
        with_col("cms_segid", pa.array(["100"])).set_column(
            table.schema.get_field_index("price"), "price", pa.array(["1.1"])
        ),
    )
    assert jagged(ok.user, "cms_segid") == [[2]] and jagged(ok.item, "price") == [[1]]
    # a string id under DYNAMIC: stable hash into [0, 2**63)
    hashed = table_to_batch(fs, with_col("customer", pa.array(["abc"])))
    assert jagged(hashed.item, "customer") == [[ref_hash("abc") & (2**63 - 1)]]


def test_long_sequences_are_cut_in_training_and_refused_in_serving(fs: FeatureSet) -> None:
    n = 105
    seq = {name: "|".join(str(i + 1) for i in range(n)) for name in SEQ}
    stats = FgStats()
    batch = table_to_batch(fs, rows_table([base_row(**seq), base_row()], fs), stats=stats)
    assert jagged(batch.sequence, SEQ[0])[0] == list(range(6, 106))  # the last 100
    assert jagged(batch.sequence, SEQ[0])[1] == [11, 22, 33]
    assert stats.truncated == {"click_50_seq": 1}
    req = _request_from_row(fs, base_row(**seq))
    with pytest.raises(FeatureError) as info:
        request_to_batch(fs, **req)
    assert info.value.field == SEQ[0] and "sequence_length 100" in str(info.value)


def test_request_errors_name_the_field(fs: FeatureSet) -> None:
    good = _request_from_row(fs, base_row())
    request_to_batch(fs, **good)

    def fails(field: str, **over: object) -> None:
        with pytest.raises(FeatureError) as info:
            request_to_batch(fs, **(good | over))
        assert info.value.field == field, str(info.value)

    fails("age_level", user={k: v for k, v in good["user"].items() if k != "age_level"})
    fails("pid", context={})
    fails("price", candidates=[good["candidates"][0] | {"price": "abc"}])
    fails("price", candidates=[good["candidates"][0] | {"price": float("nan")}])
    fails("price", candidates=[good["candidates"][0] | {"price": -3.0}])
    fails(
        "adgroup_id",
        candidates=[good["candidates"][0], good["candidates"][0] | {"adgroup_id": "x"}],
    )
    fails("brand", candidates=[{k: v for k, v in good["candidates"][0].items() if k != "brand"}])
    fails("user_id", user=good["user"] | {"user_id": 2**64})
    fails("user_id", user=good["user"] | {"user_id": -1})
    fails("cms_segid", user=good["user"] | {"cms_segid": 1.5})
    fails("click_50_seq__brand", sequences=good["sequences"] | {"click_50_seq__brand": [1, 2]})
    fails(
        "click_50_seq__cate_id",
        sequences={k: v for k, v in good["sequences"].items() if "cate" not in k},
    )
    fails("click_50_seq__cate_id", sequences=good["sequences"] | {"click_50_seq__cate_id": "1|2|3"})
    fails(
        "click_50_seq__cate_id", sequences=good["sequences"] | {"click_50_seq__cate_id": [1, -2, 3]}
    )
    fails("candidates", candidates=[])
    # None is a missing value, not an error
    batch = request_to_batch(fs, **(good | {"user": good["user"] | {"age_level": None}}))
    assert jagged(batch.user, "age_level") == [[]]
