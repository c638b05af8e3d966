"""Requests built from sample rows: sides from the metadata, explicit missing values, sequences,
the byte-concatenation shortcut producing the same message protobuf would, and the two candidate
encodings (rows, columns) carrying the same candidates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loadtest.pool import RequestPool, read_pool, write_pool
from loadtest.requests import (
    build_request_pool,
    columnar_request,
    sequence_formats_from_metadata,
    sides_from_metadata,
    value_types_from_metadata,
)
from protos import predict_pb2

from .conftest import CONTEXT, ITEM, ROWS, SEQUENCE, USER, model_metadata


def _pool(samples: Path, md: predict_pb2.ModelMetadata | None = None, **kw: Any) -> RequestPool:
    """A pool laid out as ``md`` (default: the conftest model) says, as the load test builds it."""
    md = md or model_metadata()
    return build_request_pool(
        samples,
        sides_from_metadata(md),
        value_types=value_types_from_metadata(md),
        sequence_formats=sequence_formats_from_metadata(md),
        **kw,
    )


def _build(
    sample_dir: Path, md: predict_pb2.ModelMetadata | None = None, **kw: Any
) -> list[predict_pb2.PredictRequest]:
    return [predict_pb2.PredictRequest.FromString(p) for p in _pool(sample_dir, md, **kw).payloads]


def _value(v: predict_pb2.Value) -> object:
    kind = v.WhichOneof("kind")
    return None if kind is None else getattr(v, kind)


def _candidates(req: predict_pb2.PredictRequest) -> list[dict[str, object]]:
    """The candidates of either encoding as {feature: value or None}, in order."""
    if not req.HasField("candidate_columns"):
        return [{n: _value(v) for n, v in c.values.items()} for c in req.candidates]
    cc = req.candidate_columns
    out: list[dict[str, object]] = [{} for _ in range(cc.num_candidates)]
    for name, col in cc.columns.items():
        values = list(getattr(col, col.WhichOneof("kind")).values)
        assert len(values) == cc.num_candidates
        missing = list(col.missing) or [False] * cc.num_candidates
        for row, v, m in zip(out, values, missing, strict=True):
            row[name] = None if m else v
    return out


FORMATS = pytest.mark.parametrize("columnar", [True, False], ids=["columnar", "rows"])


def test_sides_come_from_metadata() -> None:
    sides = sides_from_metadata(model_metadata())
    assert {n for n, s in sides.items() if s == "sequence"} == set(SEQUENCE)
    assert {n for n, s in sides.items() if s == "user"} == set(USER)
    assert sides["pid"] == "context" and sides["price"] == "item"
    bad = predict_pb2.ModelMetadata()
    bad.features.add(name="x", side="shop", kind="id")
    with pytest.raises(ValueError, match="'x' has side 'shop'"):
        sides_from_metadata(bad)


@FORMATS
def test_request_matches_its_row(sample_dir: Path, columnar: bool) -> None:
    reqs = _build(sample_dir, num_requests=50, num_candidates=4, seed=3, columnar=columnar)
    user_row = {uid: i for i, uid in enumerate(ROWS["user_id"])}
    for req in reqs:
        assert set(req.user.values) == set(USER)
        assert set(req.context.values) == set(CONTEXT)
        assert set(req.sequences) == set(SEQUENCE)
        assert req.HasField("candidate_columns") == columnar
        assert len(req.candidates) == (0 if columnar else 4)
        cands = _candidates(req)
        assert len(cands) == 4
        assert all(set(c) == set(ITEM) for c in cands)
        r = user_row[req.user.values["user_id"].int64_value]
        for name in USER + CONTEXT:
            got = _value((req.user if name in USER else req.context).values[name])
            assert got == ROWS[name][r], name
        # the row's own ad comes first
        assert cands[0]["adgroup_id"] == ROWS["adgroup_id"][r]
        assert cands[0]["price"] == ROWS["price"][r]
    seqs = {
        _value(q.user.values["user_id"]): [list(q.sequences[n].ids) for n in SEQUENCE] for q in reqs
    }
    assert seqs[13] == [[204], [8], [52]]
    assert seqs[12] == [[], [], []]  # empty string: empty sequence
    assert seqs[14] == [[206, 207], [8, 8], [0, 54]]  # empty token: missing id 0
    assert seqs[15] == [[], [], []]
    assert seqs[16] == [[201, 0, 205], [7, 0, 9], [51, 52, 53]]


@FORMATS
def test_nulls_are_explicit_missing_values(sample_dir: Path, columnar: bool) -> None:
    reqs = _build(sample_dir, num_requests=40, num_candidates=6, columnar=columnar)
    missing_user = [q for q in reqs if q.user.values["user_id"].int64_value == 12]
    assert missing_user, "row of user 12 not drawn"
    v = missing_user[0].user.values
    assert "pvalue_level" in v and v["pvalue_level"].WhichOneof("kind") is None
    brands = {c["brand"] for q in reqs for c in _candidates(q)}
    prices = {c["price"] for q in reqs for c in _candidates(q)}
    assert None in brands and 51 in brands
    assert None in prices and 9.9 in prices
    assert all(isinstance(_value(q.context.values["pid"]), str) for q in reqs)


@FORMATS
def test_candidates_are_distinct_items_and_seeded(sample_dir: Path, columnar: bool) -> None:
    a = _build(sample_dir, num_requests=20, num_candidates=5, seed=1, columnar=columnar)
    b = _build(sample_dir, num_requests=20, num_candidates=5, seed=1, columnar=columnar)
    c = _build(sample_dir, num_requests=20, num_candidates=5, seed=2, columnar=columnar)
    assert a == b and a != c
    # 5 distinct item tuples in the sample (row 5 repeats row 0's ad): 4 draws are distinct
    for q in a:
        drawn = [tuple(sorted(c.items())) for c in _candidates(q)[1:]]
        assert len(set(drawn)) == 4


def test_both_formats_carry_the_same_requests(sample_dir: Path) -> None:
    md = model_metadata()
    types = value_types_from_metadata(md)
    rows = _build(sample_dir, num_requests=30, num_candidates=6, seed=4, columnar=False)
    cols = _build(sample_dir, num_requests=30, num_candidates=6, seed=4, columnar=True)
    assert len(rows) == len(cols) == 30
    for r, c in zip(rows, cols, strict=True):
        assert _candidates(r) == _candidates(c)
        assert columnar_request(r, types) == c  # the converter gives the very same message
        head_r, head_c = predict_pb2.PredictRequest(), predict_pb2.PredictRequest()
        head_r.CopyFrom(r)
        head_r.ClearField("candidates")
        head_c.CopyFrom(c)
        head_c.ClearField("candidate_columns")
        assert head_r == head_c  # user, sequences, context, request id
    # nulls are missing rows with a placeholder; a column with none has no mask
    cc = next(q.candidate_columns for q in cols if any(c["brand"] is None for c in _candidates(q)))
    brand = cc.columns["brand"]
    assert brand.WhichOneof("kind") == "int64s" and len(brand.missing) == 6
    assert all(v == 0 for v, m in zip(brand.int64s.values, brand.missing, strict=True) if m)
    assert cc.columns["price"].WhichOneof("kind") == "doubles"
    assert len(cc.columns["adgroup_id"].missing) == 0


def test_columnar_request_errors_and_all_missing_columns() -> None:
    req = predict_pb2.PredictRequest()
    for v in (predict_pb2.Value(), predict_pb2.Value()):
        c = req.candidates.add()
        c.values["price"].CopyFrom(v)
        c.values["pid"].CopyFrom(predict_pb2.Value(string_value="a"))
    cc = columnar_request(req, {"price": "double"}).candidate_columns
    assert cc.num_candidates == 2
    assert list(cc.columns["price"].doubles.values) == [0.0, 0.0]
    assert list(cc.columns["price"].missing) == [True, True]
    assert list(cc.columns["pid"].strings.values) == ["a", "a"]
    req.candidates[1].values["pid"].CopyFrom(predict_pb2.Value(int64_value=3))
    with pytest.raises(ValueError, match="'pid' mixes"):
        columnar_request(req)
    req.candidates[1].values.pop("pid")
    with pytest.raises(ValueError, match=r"candidates\[1\] has no 'pid'"):
        columnar_request(req)


def test_concatenated_bytes_equal_protobuf_serialization(sample_dir: Path) -> None:
    pool = _pool(sample_dir, num_requests=5, num_candidates=3, columnar=False)
    for payload in pool.payloads:
        msg = predict_pb2.PredictRequest.FromString(payload)
        again = predict_pb2.PredictRequest()
        again.CopyFrom(msg)
        assert predict_pb2.PredictRequest.FromString(again.SerializeToString()) == msg
        assert len(msg.candidates) == 3


def test_pool_header_says_the_format(sample_dir: Path, tmp_path: Path) -> None:
    for columnar, fmt in ((True, "columnar"), (False, "rows")):
        pool = _pool(sample_dir, num_requests=3, columnar=columnar)
        info = read_pool(write_pool(tmp_path / f"{fmt}.pool", pool)).info
        assert info["format"] == fmt
        assert info["sequences"] == {"click_50_seq": {"delimiter": "|", "max_length": 100}}


def test_sequence_cap_keeps_most_recent(sample_dir: Path) -> None:
    md = model_metadata(max_sequence_length=2)  # the server's limit of each sequence
    reqs = _build(sample_dir, md, num_requests=40, num_candidates=2)
    assert {11, 16} <= {q.user.values["user_id"].int64_value for q in reqs}
    for q in reqs:
        user = q.user.values["user_id"].int64_value
        ids = [list(q.sequences[n].ids) for n in SEQUENCE]
        if user == 11:
            assert ids == [[202, 203], [8, 9], [0, 53]]
        if user == 16:
            assert ids == [[0, 205], [0, 9], [52, 53]]


def test_errors_name_the_problem(sample_dir: Path, tmp_path: Path) -> None:
    md = model_metadata()
    md.features.add(name="shop_id", side="item", kind="id", value_type="int64")
    with pytest.raises(ValueError, match="shop_id"):
        _pool(sample_dir, md)
    with pytest.raises(ValueError, match=r"sequence features \['click_50_seq__adgroup_id'.*"
                       "sequence_formats_from_metadata"):  # fmt: skip
        build_request_pool(sample_dir, sides_from_metadata(model_metadata()))
    with pytest.raises(ValueError, match="'pid'"):
        build_request_pool(
            sample_dir, {"pid": "context", "adgroup_id": "item"}, value_types={"pid": "int64"}
        )
    with pytest.raises(FileNotFoundError):
        build_request_pool(tmp_path / "nope", {"adgroup_id": "item"})


def test_pool_file_roundtrip(sample_dir: Path, tmp_path: Path) -> None:
    pool = _pool(sample_dir, num_requests=7)
    back = read_pool(write_pool(tmp_path / "p.pool", pool))
    assert back.payloads == pool.payloads and back.num_candidates == 100
    assert back.info["rows_read"] == len(ROWS["user_id"])


def test_builds_thousands_of_requests(tmp_path: Path) -> None:
    """2000 requests x 100 candidates from 50K rows (its speed is measured in bench/, not here)."""
    n, rng = 50_000, np.random.default_rng(0)
    cols = {name: rng.integers(0, 1000, n) for name in USER + ITEM if name != "price"}
    cols["price"] = rng.random(n) * 100
    cols["pid"] = np.where(rng.random(n) < 0.5, "430548_1007", "430539_1007")
    seq = ["|".join(map(str, rng.integers(0, 1000, k))) for k in rng.geometric(0.25, n) - 1]
    for name in SEQUENCE:
        cols[name] = seq
    pq.write_table(pa.table(cols), tmp_path / "part-0.parquet")
    for columnar in (True, False):
        pool = _pool(tmp_path, num_requests=2000, columnar=columnar)
        assert len(pool) == 2000 and pool.num_candidates == 100
        last = predict_pb2.PredictRequest.FromString(pool.payloads[-1])
        assert len(_candidates(last)) == 100 and set(last.sequences) == set(SEQUENCE)


def test_one_click_with_missing_brand_keeps_sub_sequences_aligned() -> None:
    from loadtest.requests import _align

    ads = (np.array([5, 7, 8], np.int64), np.array([0, 1, 3, 3]))  # rows: [5], [7, 8], []
    brands = (np.array([9, 9], np.int64), np.array([0, 0, 2, 2]))  # rows: "" (NULL), [9, 9], []
    out = _align({"ad": ads, "brand": brands})
    assert out["ad"][1].tolist() == [0, 1, 3, 3]
    assert out["brand"][0].tolist() == [0, 9, 9] and out["brand"][1].tolist() == [0, 1, 3, 3]


def _rejoin(sample_dir: Path, out: Path, delim: str) -> Path:
    """The sample rows with their sequences joined by ``delim`` instead of ``|``."""
    table = pq.read_table(sample_dir)
    for name in SEQUENCE:
        joined = [s.replace("|", delim) for s in table.column(name).to_pylist()]
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(joined))
    out.mkdir()
    pq.write_table(table, out / "part-00000.parquet")
    return out


@FORMATS
def test_sequences_split_on_the_delimiter_the_server_reports(
    sample_dir: Path, tmp_path: Path, columnar: bool
) -> None:
    want = _build(sample_dir, num_requests=30, num_candidates=3, seed=5, columnar=columnar)
    semi = _rejoin(sample_dir, tmp_path / "semi", ";")
    md = model_metadata(delimiter=";")
    assert _build(semi, md, num_requests=30, num_candidates=3, seed=5, columnar=columnar) == want
    # the ";" rows read with the "|" of another model: the error names the delimiter used
    with pytest.raises(ValueError, match=r"non-integer id after splitting on '\|'"):
        _build(semi, num_requests=3)
    md.sequences[0].delimiter = ""  # a server that does not report it
    with pytest.raises(ValueError, match="no delimiter for sequence 'click_50_seq'"):
        _build(semi, md, num_requests=3)
