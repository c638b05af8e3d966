"""Feature generation of serving requests: the ids of training, mixed kinds, hostile values."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from shared.features import FeatureSet, IdMode, Side, feature_set_from_text
from shared.fg import FeatureError, FgStats, scalar_ids, table_to_batch
from shared.fg_request import request_columns_to_batch, request_to_batch
from tests.shared.fg_rows import SEED_TEXT, SEQ, base_row, jagged, ref_hash, rows_table

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
