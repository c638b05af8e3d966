"""Feature generation: hand-computed tensors, train/serve identity, every bad-data case."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from shared.features import FeatureSet, IdMode, IdTransform, Side, feature_set_from_text
from shared.fg import (
    FeatureError,
    FgStats,
    hash64,
    per_feature_set,
    request_columns_to_batch,
    request_to_batch,
    scalar_ids,
    sequence_ids,
    table_to_batch,
)
from shared.fg_text import std_hash

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


TZREC_TEXT = SEED_TEXT.replace("data_config {\n", "data_config {\ndynrec_id_mode: TZREC\n", 1)
KEY_SPACE = 2**63 - 1  # tzrec's MAX_HASH_BUCKET_SIZE: pyfg's hash_bucket_size of dynamicemb ids


@pytest.fixture(scope="module")
def fs() -> FeatureSet:
    return feature_set_from_text(SEED_TEXT, "seed")


@pytest.fixture(scope="module")
def fs_tzrec() -> FeatureSet:
    fs = feature_set_from_text(TZREC_TEXT, "seed, TorchEasyRec ids")
    assert fs.id_mode is IdMode.TZREC
    return fs


def ref_hash(s: str) -> int:
    """Pure-Python FNV-1a 64 + SplitMix64 finalizer: the reference for :func:`shared.fg.hash64`."""
    h = 0xCBF29CE484222325
    for b in s.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
    return h ^ (h >> 31)


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


@pytest.mark.parametrize("mode", list(IdMode))
def test_request_to_batch_gives_the_same_ids_as_table_to_batch(
    fs: FeatureSet, fs_tzrec: FeatureSet, mode: IdMode
) -> None:
    fs = {IdMode.DYNREC: fs, IdMode.TZREC: fs_tzrec}[mode]
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


# --------------------------------------------------------------------------- mixed kinds


@pytest.fixture(scope="module")
def item_pid() -> FeatureSet:
    """The seed config with ``pid`` (HASH) on the item side, so candidates can mix its kinds."""
    fs = feature_set_from_text(
        SEED_TEXT.replace('expression: "context:pid"', 'expression: "item:pid"'), "item pid"
    )
    assert fs.features["pid"].side is Side.ITEM
    return fs


def _item_ids(
    fs: FeatureSet, name: str, column: object, stats: FgStats | None = None, n: int | None = None
) -> list[list[int]]:
    """Ids of ITEM-side feature ``name`` for the candidate column ``column`` (others: base_row)."""
    req = _request_from_row(fs, base_row())
    n = len(column) if n is None else n  # type: ignore[arg-type]
    items = {key: [value] * n for key, value in req["candidates"][0].items()} | {name: column}
    batch = request_columns_to_batch(
        fs,
        user=req["user"],
        sequences=req["sequences"],
        context=req["context"],
        items=items,
        num_candidates=n,
        stats=stats,
    )
    return jagged(batch.item, name)


MIXED = [
    ("adgroup_id", [7, "ad-3", None, 2**63 - 1, "7", 0, np.int64(9), None, "ad-3"]),  # DYNAMIC
    ("pid", ["430548_1007", 7, None, "7", -5, "", np.int64(430548), "-5"]),  # HASH
    ("price", [2.5, 3, None, 170.0, 2**62, 0, 1.1, np.float32(2.5), 2**63 + 1]),  # BUCKETIZE
]


@pytest.mark.parametrize(("name", "column"), MIXED)
def test_a_mixed_column_gives_each_value_the_ids_of_its_kind_alone(
    item_pid: FeatureSet, name: str, column: list[object]
) -> None:
    stats = FgStats()
    got = _item_ids(item_pid, name, column, stats)
    assert stats.missing[name] == column.count(None)
    # each value alone
    assert got == [_item_ids(item_pid, name, [v])[0] for v in column]
    # each kind as a column of its own (Python and numpy scalars of one kind together)
    kinds = [type(v.item() if isinstance(v, np.generic) else v) for v in column]
    want: list[list[int] | None] = [None] * len(column)
    for kind in set(kinds):
        rows = [i for i, k in enumerate(kinds) if k is kind]
        ids = _item_ids(item_pid, name, [column[i] for i in rows])
        for i, row_ids in zip(rows, ids, strict=True):
            want[i] = row_ids
    assert got == want


def test_mixed_columns_follow_the_documented_semantics(item_pid: FeatureSet) -> None:
    size = item_pid.features["pid"].hash_bucket_size
    assert _item_ids(item_pid, "pid", [7, "7", "x", None]) == [
        [ref_hash("7") % size],  # an int hashes as its decimal string
        [ref_hash("7") % size],
        [ref_hash("x") % size],
        [],
    ]
    assert _item_ids(item_pid, "adgroup_id", [7, "7", None]) == [
        [7],  # an int id is taken as it is, a string is hashed
        [ref_hash("7") & (2**63 - 1)],
        [],
    ]
    assert _item_ids(item_pid, "price", [3, 2.5, None, 2**63 - 1]) == [[2], [2], [], [98]]


def test_union_columns_of_any_layout_give_the_same_ids(item_pid: FeatureSet) -> None:
    codes = pa.array([0, 1, 1, 0, 2], pa.int8())
    ints, strs = pa.array([7, None, 8, 9, 10]), pa.array(["a", "b", "c", None, "e"])
    nulls = pa.nulls(5)
    sparse = pa.UnionArray.from_sparse(codes, [ints, strs, nulls])  # rows: 7, b, c, 9, null
    dense = pa.UnionArray.from_dense(
        pa.array([1, 0, 1, 1, 0, 2, 0], pa.int8()),
        pa.array([4, 0, 1, 2, 3, 0, 0], pa.int32()),
        [pa.array([7, 9, 11, 12]), pa.array(["x", "b", "c", "y", "z"]), pa.nulls(1)],
    ).slice(1, 5)  # rows: 7, b, c, 12, null
    want = _item_ids(item_pid, "adgroup_id", [7, "b", "c", 9, None])
    assert _item_ids(item_pid, "adgroup_id", sparse) == want
    assert _item_ids(item_pid, "adgroup_id", dense) == [*want[:3], [12], []]


# --------------------------------------------------------------------------- hostile values


def test_int_prices_of_any_width_get_the_bucket_of_their_nearest_double(fs: FeatureSet) -> None:
    top = len(fs.features["price"].boundaries)
    big = [2**53 + 1, 2**62, 2**63 - 1]
    assert _item_ids(fs, "price", big) == [[top]] * 3
    assert _item_ids(fs, "price", pa.array([2**64 - 1, 2**63], pa.uint64())) == [[top]] * 2
    assert _item_ids(fs, "price", np.array([2**64 - 1, 5], np.uint64)) == [[top], [3]]
    assert _item_ids(fs, "price", [2**63, 2**64 - 1]) == [[top]] * 2  # Python ints beyond int64
    for bad in (-(2**63), -1, np.int64(-(2**63))):
        with pytest.raises(FeatureError, match="negative") as info:
            _item_ids(fs, "price", [5, bad])
        assert info.value.field == "price" and str(int(bad)) in str(info.value)
    # a boundary beyond 2**53: an int compares as its nearest double (doubles near 1e17 are 16
    # apart: 1e17 - 1 rounds up to the boundary, 1e17 - 8 too (a tie, to even), 1e17 - 9 down)
    spec = dataclasses.replace(fs.features["price"], boundaries=(1e17,))
    values = [10**17 - 1, 10**17 - 16, 10**17 - 8, 10**17 - 9, 10**17]
    ids, _ = scalar_ids(spec, pa.array(values))
    assert ids.tolist() == [int(float(v) >= 1e17) for v in values] == [1, 0, 1, 0, 1]


HOSTILE_COLUMNS = [
    ("adgroup_id", [2**63]),  # DYNAMIC: outside int64
    ("adgroup_id", [7, 2**64]),  # outside uint64
    ("adgroup_id", [-(2**63) - 1]),
    ("adgroup_id", [-1]),
    ("adgroup_id", [1.5]),
    ("adgroup_id", [math.nan, None]),
    ("adgroup_id", [True]),
    ("adgroup_id", [7, True]),  # a bool among ints
    ("adgroup_id", [7, 2.0]),  # a float among ints
    ("adgroup_id", ["a", b"a"]),  # bytes among strings
    ("adgroup_id", [b"7"]),
    ("adgroup_id", [1j]),
    ("adgroup_id", [[1, 2]]),
    ("adgroup_id", [{"a": 1}]),
    ("adgroup_id", [object()]),
    ("adgroup_id", [7, object()]),
    ("adgroup_id", np.array([1 + 2j])),
    ("adgroup_id", np.array([1.5])),
    ("adgroup_id", np.array(["2024-01-01"], "datetime64[D]")),
    ("adgroup_id", pa.array([True, None])),
    ("adgroup_id", pa.array([b"x"])),
    ("adgroup_id", pa.array([[1]])),
    ("pid", [1.5]),  # HASH: ints and strings only
    ("pid", [2**63]),
    ("pid", ["a", True]),
    ("price", ["a", 1.5]),  # BUCKETIZE: numbers only
    ("price", [math.nan]),
    ("price", [math.inf, 2]),
    ("price", [True]),
    ("price", [2**64]),
    ("price", np.array([1 + 2j])),
    ("price", pa.array([b"1"])),
]


@pytest.mark.parametrize(("name", "column"), HOSTILE_COLUMNS)
def test_hostile_candidate_values_raise_feature_error_naming_the_feature(
    item_pid: FeatureSet, name: str, column: object
) -> None:
    with pytest.raises(FeatureError) as info:
        _item_ids(item_pid, name, column)
    assert info.value.field == name, str(info.value)


@pytest.mark.parametrize(
    ("where", "name", "value"),
    [
        ("user", "user_id", 2**63),
        ("user", "user_id", 2**64),
        ("user", "user_id", math.nan),
        ("user", "user_id", [1, 2]),
        ("user", "cms_segid", "x"),  # MOD parses strings
        ("user", "cms_segid", "9" * 30),
        ("user", "cms_segid", b"1"),
        ("context", "pid", 1.5),
        ("sequences", SEQ[0], [2**63, 1, 2]),
        ("sequences", SEQ[0], [2**64, 1, 2]),
        ("sequences", SEQ[0], [1.5, 1, 2]),
        ("sequences", SEQ[0], [math.nan, 1, 2]),
        ("sequences", SEQ[0], [True, 1, 2]),
        ("sequences", SEQ[0], [b"1", 1, 2]),
        ("sequences", SEQ[0], ["x", 1, 2]),  # mixed kinds: a sequence holds integer ids
        ("sequences", SEQ[0], [[1], 1, 2]),
    ],
)
def test_hostile_request_values_raise_feature_error_naming_the_feature(
    fs: FeatureSet, where: str, name: str, value: object
) -> None:
    req = _request_from_row(fs, base_row())
    req[where] = req[where] | {name: value}
    with pytest.raises(FeatureError) as info:
        request_to_batch(fs, **req)
    assert info.value.field == name, str(info.value)


@pytest.mark.parametrize("column", [5, "ab", b"ab", np.array(7), {"a": 1}, None, [1, 2, 3]])
def test_a_candidate_column_is_a_list_or_array_of_one_value_per_candidate(
    fs: FeatureSet, column: object
) -> None:
    with pytest.raises(FeatureError) as info:
        _item_ids(fs, "brand", column, n=2)
    assert info.value.field == "brand", str(info.value)


def test_a_long_value_is_quoted_short_and_hashed(fs: FeatureSet) -> None:
    # a client's megabyte string is quoted, cut short, in the error (and hashed fast if valid)
    req = _request_from_row(fs, base_row())
    with pytest.raises(FeatureError) as info:
        request_to_batch(fs, **(req | {"user": req["user"] | {"cms_segid": "7" + "x" * 10**6}}))
    assert info.value.field == "cms_segid" and len(str(info.value)) < 1200
    long_id = "ad-" + "x" * 10**6
    assert _item_ids(fs, "adgroup_id", [long_id, 3]) == [[ref_hash(long_id) & (2**63 - 1)], [3]]


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
        candidates=[good["candidates"][0], good["candidates"][0] | {"adgroup_id": 1.5}],
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


# --------------------------------------------------------------------------- request fast path


def _as_form(values: np.ndarray, form: str) -> object:
    return {"numpy": values, "arrow": pa.array(values), "list": values.tolist()}[form]


def _random_request(fs: FeatureSet, n: int, **user: object) -> dict[str, object]:
    """A request of ``n`` candidates with random ids (up to 2**63 - 1) and prices (some on a
    boundary, some beyond the last)."""
    rng = np.random.default_rng(7)
    req = _request_from_row(fs, base_row())
    items = {name: rng.integers(0, 2**63 - 1, n) for name in req["candidates"][0]}
    items["adgroup_id"][:3] = [0, 2**63 - 1, 12]  # the ends of the id range
    bounds = np.array(fs.features["price"].boundaries)
    items["price"] = np.concatenate([bounds[:5].round(1), rng.uniform(0, 2e4, n - 5)])
    seqs = {name: rng.integers(0, 10**12, 7).tolist() for name in SEQ}
    return {
        "user": req["user"] | user,
        "context": req["context"],
        "items": items,
        "sequences": seqs,
        "num_candidates": n,
    }


def _training_table(fs: FeatureSet, req: dict[str, object]) -> pa.Table:
    """The rows of ``req`` as training samples: user, context and sequences repeated per row."""
    n = req["num_candidates"]
    cols = {name: pa.array(list(v)) for name, v in req["items"].items()}
    for where in ("user", "context"):
        cols |= {name: pa.array([v] * n) for name, v in req[where].items()}
    cols |= {name: pa.array(["|".join(map(str, v))] * n) for name, v in req["sequences"].items()}
    cols["clk"] = pa.array([0] * n, pa.int8())
    return pa.table(cols)


def _assert_same_ids(got, want, rows: int | None = None) -> None:
    assert got.keys() == want.keys()
    for key in want.keys():  # noqa: SIM118 (a KJT is not a dict)
        expected = jagged(want, key) if rows is None else jagged(want, key)[:rows]
        assert jagged(got, key) == expected, key


@pytest.mark.parametrize("form", ["numpy", "arrow", "list"])
@pytest.mark.parametrize("mode", list(IdMode))
@pytest.mark.parametrize(
    "user", [{}, {"user_id": "u-17", "cms_segid": "130", "age_level": None}], ids=["ints", "other"]
)
def test_request_columns_of_any_form_give_the_ids_of_training(
    fs: FeatureSet, fs_tzrec: FeatureSet, form: str, mode: IdMode, user: dict[str, object]
) -> None:
    # numpy and null-free Arrow columns and integer user values skip Arrow (lists do not):
    # every form gives the ids table_to_batch gives the same rows, twice (cached strings)
    fs = {IdMode.DYNREC: fs, IdMode.TZREC: fs_tzrec}[mode]
    req = _random_request(fs, 40, **user)
    trained = table_to_batch(fs, _training_table(fs, req))
    items = {name: _as_form(v, form) for name, v in req["items"].items()}
    for _ in range(2):
        served = request_columns_to_batch(fs, **(req | {"items": items}))
        _assert_same_ids(served.item, trained.item)
        _assert_same_ids(served.user, trained.user, rows=1)
        _assert_same_ids(served.sequence, trained.sequence, rows=1)


def test_request_columns_with_missing_values_give_the_ids_of_training(fs: FeatureSet) -> None:
    req = _random_request(fs, 12)
    items: dict[str, object] = {name: v.tolist() for name, v in req["items"].items()}
    items["brand"][3] = items["price"][0] = None  # type: ignore[index]
    req["context"] = {"pid": None}
    trained = table_to_batch(fs, _training_table(fs, req | {"items": items}))
    served = request_columns_to_batch(
        fs, **(req | {"items": {name: pa.array(v) for name, v in items.items()}})
    )
    _assert_same_ids(served.item, trained.item)


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("adgroup_id", np.array([3, -4, 5])),  # negative id
        ("adgroup_id", np.array([3.0, 4.0, 5.0])),  # float ids
        ("price", np.array([1.0, math.nan, 2.0])),
        ("price", np.array([1.0, -2.0, math.inf])),
        ("price", np.array([1, -2, 3])),  # an int price: quoted as an int
    ],
)
def test_numpy_columns_raise_the_errors_of_lists(
    fs: FeatureSet, name: str, values: np.ndarray
) -> None:
    errors = []
    for column in (values, pa.array(values), values.tolist()):
        with pytest.raises(FeatureError) as info:
            _item_ids(fs, name, column)
        errors.append(str(info.value))
    assert info.value.field == name
    assert errors[0] == errors[1] == errors[2]


@pytest.mark.parametrize(
    ("where", "name", "value"),
    [
        ("user", "cms_segid", -1),
        ("user", "user_id", -(2**63)),
        ("user", "cms_segid", "x"),  # a cached-string feature whose string fails
        ("context", "pid", -5.0),
        ("sequences", SEQ[1], [1, -2, 3]),
        ("sequences", SEQ[1], [1, 2]),  # unaligned
        ("sequences", SEQ[1], np.arange(3) - 1),
    ],
)
def test_fast_user_and_sequence_values_raise_the_errors_of_arrow(
    fs: FeatureSet, where: str, name: str, value: object
) -> None:
    # the same error whether the value takes the fast path (Python ints and floats) or, as numpy
    # scalars, the general one through Arrow
    req = _request_from_row(fs, base_row())
    errors = []
    general = np.asarray(value).tolist()
    general = [np.int64(v) for v in general] if isinstance(general, list) else np.array(general)[()]
    for v in (value, general):
        for _ in range(2):  # a failing string is not cached
            with pytest.raises(FeatureError) as info:
                request_to_batch(fs, **(req | {where: req[where] | {name: v}}))
            errors.append(str(info.value))
    assert info.value.field == name
    assert len(set(errors)) == 1, errors


def test_conversion_errors_come_before_value_errors(fs: FeatureSet) -> None:
    # values are converted first (a brand of the wrong type), then turned into ids (a negative
    # user id): the conversion error is raised, whichever feature comes first
    req = _request_from_row(fs, base_row())
    cands = [req["candidates"][0] | {"brand": object()}]
    with pytest.raises(FeatureError) as info:
        request_to_batch(
            fs, **(req | {"user": req["user"] | {"cms_segid": -1}, "candidates": cands})
        )
    assert info.value.field == "brand"


def test_per_feature_set_builds_once_per_feature_set_object() -> None:
    built: list[FeatureSet] = []

    def build(fs: FeatureSet) -> int:
        built.append(fs)
        return len(built)

    cached = per_feature_set(build)
    a, b = feature_set_from_text(SEED_TEXT, "a"), feature_set_from_text(SEED_TEXT, "b")
    assert a == b and a is not b
    assert [cached(a), cached(a), cached(b), cached(a)] == [1, 1, 2, 1]
