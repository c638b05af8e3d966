"""Feature generation: hand-computed tensors, hashing, training batches, every bad-data case."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.features import FeatureSet, IdMode, IdTransform, Side, feature_set_from_text
from shared.fg import (
    FeatureError,
    FgStats,
    bucket_ids,
    hash64,
    scalar_ids,
    sequence_ids,
    table_to_batch,
)
from shared.fg_text import std_hash
from tests.shared.fg_rows import MASK64, SEED_TEXT, SEQ, base_row, jagged, ref_hash, rows_table

ROOT = Path(__file__).resolve().parents[2]
BASE_TEXT = (ROOT / "configs" / "multi_tower_din_taobao.config").read_text()
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


KEY_SPACE = 2**63 - 1  # tzrec's MAX_HASH_BUCKET_SIZE: pyfg's hash_bucket_size of dynamicemb ids


def ref_std_hash(s: str) -> int:
    """Pure-Python libstdc++ ``std::hash<std::string>`` (64-bit ``_Hash_bytes``, seed 0xc70f6907,
    gcc libstdc++-v3/libsupc++/hash_bytes.cc): the reference for :func:`shared.fg_text.std_hash`."""
    mul = 0xC6A4A7935BD1E995
    data = s.encode("utf-8")
    end = len(data) & ~7
    h = 0xC70F6907 ^ ((len(data) * mul) & MASK64)
    for p in range(0, end, 8):
        k = (int.from_bytes(data[p : p + 8], "little") * mul) & MASK64
        k = ((k ^ (k >> 47)) * mul) & MASK64
        h = ((h ^ k) * mul) & MASK64
    if len(data) & 7:
        h = ((h ^ int.from_bytes(data[end:], "little")) * mul) & MASK64
    h = ((h ^ (h >> 47)) * mul) & MASK64
    return h ^ (h >> 47)


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


def _random_strings(rng: np.random.Generator, lengths: list[int]) -> list[str]:
    """Strings of about ``lengths[i]`` UTF-8 bytes: ASCII, 2-, 3- and 4-byte characters."""
    alphabet = ["a", "Z", "0", "|", "_", " ", "é", "ß", "中", "€", "😀", "\x00", "\x7f"]
    width = np.array([len(c.encode()) for c in alphabet])
    out = []
    for n in lengths:
        picks = rng.integers(len(alphabet), size=n).tolist()
        upto = int(np.searchsorted(np.cumsum(width[picks]), n)) + 1  # the first n bytes or more
        out.append("".join(alphabet[i] for i in picks[:upto]))
    return out


@pytest.mark.parametrize(("hasher", "ref"), [(hash64, ref_hash), (std_hash, ref_std_hash)])
def test_string_hashes_of_random_strings_equal_their_reference(
    hasher: Callable[[pa.Array], np.ndarray], ref: Callable[[str], int]
) -> None:
    rng = np.random.default_rng(7)
    lengths = [int(n) for n in rng.integers(0, 301, 300)]
    # every path: lengths 0..16 (std_hash: around its 8-byte blocks), many strings beyond 64 bytes
    # (the loop over byte/block positions goes on), a few of hundreds or thousands of bytes (their
    # rests are hashed one string at a time; hash64: by a byte loop or in numpy passes), beyond
    # 65,536 bytes (hash64: several blocks), duplicates, a null; multi-byte UTF-8 throughout
    batches = [
        lengths,
        list(range(17)),
        [5, 80, 300, 2000],
        [0, 1, 11, 70_000, 3000],
        [200_000],
        [*lengths[:40], 1537, 1600, 9000],
    ]
    for batch in batches:
        words = _random_strings(rng, batch)
        got = hasher(pa.array([*words, None, words[0]]))
        want = [ref(w) for w in words]
        assert [int(h) for h in got] == [*want, ref(""), want[0]], batch[:5]
    # a sliced array (offsets not starting at 0) hashes the same
    words = _random_strings(rng, [3, 100, 2000, 7])
    assert [int(h) for h in hasher(pa.array(words).slice(1, 2))] == [ref(w) for w in words[1:3]]
    assert hasher(pa.array([], pa.string())).tolist() == []


# TorchEasyRec's own expectations of pyfg, hash_bucket_size=100: alibaba/TorchEasyRec@54cac316
# tzrec/features/id_feature_test.py:255-274 (test_id_feature_with_hash_bucket_size; the bucket size
# at l. 293): "abc\x1defg" -> [33, 44], "hij" -> 66, default "xyz" -> 13; ints 1, 2, 3 -> 95, 70,
# 13, default "4" -> 56 (l. 272-274, without USE_FARM_HASH_TO_BUCKETIZE). l. 641: an empty
# sequence with default_value "" gives 26, the bucket of "0" (pyfg's fill: our reading).
TZREC_BUCKETS_OF_100 = {
    "abc": 33,
    "efg": 44,
    "hij": 66,
    "xyz": 13,
    "1": 95,
    "2": 70,
    "3": 13,
    "4": 56,
    "0": 26,
}


def test_std_hash_reproduces_tzrec_test_vectors() -> None:
    words = list(TZREC_BUCKETS_OF_100)
    got = std_hash(pa.array(words))
    assert [int(h) for h in got] == [ref_std_hash(w) for w in words]
    assert {w: int(h) % 100 for w, h in zip(words, got, strict=True)} == TZREC_BUCKETS_OF_100


def test_tzrec_mode_gives_the_bucket_ids_of_tzrec_tests(fs_tzrec: FeatureSet) -> None:
    spec = dataclasses.replace(fs_tzrec.features["pid"], hash_bucket_size=100)
    ids, lengths = scalar_ids(spec, pa.array(["abc", "efg", None, "hij", "xyz"]))
    assert ids.tolist() == [33, 44, 66, 13] and lengths.tolist() == [1, 1, 0, 1, 1]
    ids, lengths = scalar_ids(spec, pa.array([1, 2, None, 3, 4]))  # ints: their decimal string
    assert ids.tolist() == [95, 70, 13, 56] and lengths.tolist() == [1, 1, 0, 1, 1]
    dynrec = dataclasses.replace(spec, id_mode=IdMode.DYNREC)
    assert scalar_ids(dynrec, pa.array(["abc"]))[0].tolist() == [ref_hash("abc") % 100]


def test_tzrec_mode_keys_dynamic_ids_as_pyfg(fs_tzrec: FeatureSet) -> None:
    spec = fs_tzrec.features["adgroup_id"]
    assert spec.transform is IdTransform.DYNAMIC and spec.id_mode is IdMode.TZREC
    ints = [7, 63133, 0, 2**63 - 1, -5]  # every id is hashed, a negative one too
    ids, _ = scalar_ids(spec, pa.array(ints))
    assert ids.tolist() == [ref_std_hash(str(i)) % KEY_SPACE for i in ints]
    ids, _ = scalar_ids(spec, pa.array(["7", "efg"]))
    assert ids[0] == scalar_ids(spec, pa.array([7]))[0][0]  # "7" and 7 agree
    # a modulo, not a mask: std::hash("efg") is above 2**63, its key is h - (2**63 - 1)
    h = ref_std_hash("efg")
    assert h >= 2**63 and int(ids[1]) == h - KEY_SPACE != h & (2**63 - 1)
    ((seq, lengths),) = sequence_ids(
        [fs_tzrec.features["click_50_seq__adgroup_id"]], [pa.array(["11|22", ""])], truncate=True
    )
    assert seq.tolist() == [ref_std_hash("11") % KEY_SPACE, ref_std_hash("22") % KEY_SPACE]
    assert lengths.tolist() == [2, 0]


def test_tzrec_mode_changes_only_hashed_and_dynamic_ids(
    fs: FeatureSet, fs_tzrec: FeatureSet
) -> None:
    rows = [base_row(), base_row(user_id=5, pid="430539_1007", click_50_seq__brand="7|8|9")]
    ours, theirs = (
        table_to_batch(fs, rows_table(rows, fs)),
        table_to_batch(fs_tzrec, rows_table(rows, fs_tzrec)),
    )
    assert jagged(theirs.user, "user_id") == [
        [ref_std_hash("1234") % KEY_SPACE],
        [ref_std_hash("5") % KEY_SPACE],
    ]
    assert jagged(theirs.item, "pid") == [
        [ref_std_hash(p) % 20] for p in ("430548_1007", "430539_1007")
    ]
    assert (
        jagged(theirs.sequence, "click_50_seq__cate_id")
        == [[ref_std_hash(c) % KEY_SPACE for c in "123"]] * 2
    )
    for spec in fs.features.values():  # num_buckets and boundaries: the same in both modes
        if spec.transform in (IdTransform.MOD, IdTransform.BUCKETIZE):
            kjt = {Side.USER: "user", Side.ITEM: "item", Side.CONTEXT: "item"}[spec.side]
            kjt = "sequence" if spec.is_sequence else kjt
            got = jagged(getattr(theirs, kjt), spec.name)
            assert got == jagged(getattr(ours, kjt), spec.name), spec.name


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


_PRICES = st.one_of(
    st.floats(min_value=0, max_value=400, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.1, 2.2, 168.0, 171.8, 5e-324, 1e300]),
)


@settings(max_examples=60, deadline=None)
@given(
    prices=st.lists(_PRICES, min_size=0, max_size=40),
    size=st.sampled_from([1, 500, 2047, 2048, 3000]),
    bad=st.sampled_from([None, math.nan, -math.nan, math.inf, -math.inf, -1.0, -5e-324]),
)
def test_bucket_ids_are_the_search_of_the_written_boundaries(
    fs: FeatureSet, prices: list[float], size: int, bad: float | None
) -> None:
    # small arrays take one searchsorted, large ones the cell table (shared.fg._TABLE_MIN): the
    # same buckets; any NaN, infinite or negative price gives None on either path
    spec = fs.features["price"]
    x = np.resize(np.array(prices or [3.0]), size)
    written = np.array([float(np.format_float_positional(np.float32(b), unique=True))
                        for b in spec.boundaries])  # fmt: skip
    got = bucket_ids(spec, x)
    assert got is not None and np.array_equal(got, np.searchsorted(written, x, side="right"))
    if bad is not None:
        x[size // 2] = bad
        assert bucket_ids(spec, x) is None
