"""serve.validation: the column-wise candidate check agrees with the per-candidate one, and
columnar candidates give the very batch their row form gives."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from protos import predict_pb2
from serve.limits import Limits
from serve.validation import (
    PREDICT_COLUMNS,
    PREDICT_ROWS,
    RequestError,
    _features,
    feature_error,
    request_inputs,
)
from shared.features import FeatureSet, Side
from shared.fg import FeatureError
from shared.fg_request import request_columns_to_batch

from .conftest import candidate_variants, to_columnar


def _per_candidate(req: predict_pb2.PredictRequest, fs: FeatureSet) -> dict[str, list[object]]:
    specs = {f.name: f for f in fs.features.values() if f.side is Side.ITEM and not f.is_sequence}
    rows = [
        _features(c, specs, f"candidates[{i}]", "", Limits()) for i, c in enumerate(req.candidates)
    ]
    return {name: [row[name] for row in rows] for name in specs}


def _copy(req: predict_pb2.PredictRequest) -> predict_pb2.PredictRequest:
    out = predict_pb2.PredictRequest()
    out.CopyFrom(req)
    return out


def test_item_columns_equal_the_per_candidate_values(fs: FeatureSet, requests) -> None:
    for req in requests:
        inputs = request_inputs(req, fs, Limits())
        assert inputs.num_candidates == len(req.candidates)
        assert inputs.items == _per_candidate(req, fs)


def test_missing_and_mixed_kinds_keep_their_values(fs: FeatureSet, requests) -> None:
    req = _copy(requests[0])
    req.candidates[0].values["brand"].CopyFrom(predict_pb2.Value())  # explicit missing
    req.candidates[-1].values["price"].CopyFrom(predict_pb2.Value(int64_value=3))  # an int price
    items = request_inputs(req, fs, Limits()).items
    assert items == _per_candidate(req, fs)
    assert items["brand"][0] is None and items["price"][-1] == 3


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (predict_pb2.Value(double_value=float("inf")), "finite"),
        (predict_pb2.Value(string_value="cheap"), "expected a number"),
    ],
)
def test_a_bad_value_is_named_by_its_candidate(fs: FeatureSet, requests, value, problem) -> None:
    req = _copy(requests[0])
    req.candidates[-1].values["price"].CopyFrom(value)
    with pytest.raises(RequestError, match=problem) as err:
        request_inputs(req, fs, Limits())
    assert err.value.field == f"candidates[{len(req.candidates) - 1}].price"


def test_an_unknown_or_missing_feature_is_named(fs: FeatureSet, requests) -> None:
    req = _copy(requests[0])
    req.candidates[1].values.pop("brand")
    req.candidates[1].values["colour"].CopyFrom(predict_pb2.Value(int64_value=1))  # same count
    with pytest.raises(RequestError) as err:
        request_inputs(req, fs, Limits())
    assert err.value.field == "candidates[1].colour"


def _batch(req: predict_pb2.PredictRequest, fs: FeatureSet):
    return request_columns_to_batch(fs, **vars(request_inputs(req, fs, Limits())))


def test_columnar_candidates_give_the_batch_of_their_rows(fs: FeatureSet, requests) -> None:
    cases = {f"sample {i}": r for i, r in enumerate(requests)} | candidate_variants(requests)
    for name, rows in cases.items():
        columns = to_columnar(fs, rows)
        items = request_inputs(columns, fs, Limits()).items
        assert all(isinstance(v, pa.Array | np.ndarray) for v in items.values())
        for side in ("user", "item", "sequence"):
            want, got = getattr(_batch(rows, fs), side), getattr(_batch(columns, fs), side)
            assert got.keys() == want.keys(), name
            assert torch.equal(got.values(), want.values()), (name, side)
            assert torch.equal(got.lengths(), want.lengths()), (name, side)
        by_row = request_inputs(rows, fs, Limits()).items
        for feature, arr in items.items():
            assert arr.tolist() == by_row[feature], (name, feature)


def test_columnar_missing_rows_are_nulls(fs: FeatureSet, requests) -> None:
    rows = candidate_variants(requests)["some values missing"]
    items = request_inputs(to_columnar(fs, rows), fs, Limits()).items
    assert items["brand"].null_count == 1 and not items["brand"].is_valid()[0].as_py()
    assert items["price"].null_count == 1 and items["price"].type == pa.float64()
    assert isinstance(items["adgroup_id"], np.ndarray)  # no missing values: numpy, no Arrow
    assert items["adgroup_id"].dtype == np.int64


@pytest.mark.parametrize("columnar", [True, False])
def test_a_bad_id_is_named_by_its_candidate_in_either_encoding(
    fs: FeatureSet, requests, columnar: bool
) -> None:
    # a numpy column (columnar, nothing missing) and a list (rows) name the same candidate
    req = _copy(requests[0])
    last = len(req.candidates) - 1
    req.candidates[last].values["adgroup_id"].CopyFrom(predict_pb2.Value(int64_value=-7))
    if columnar:
        req = to_columnar(fs, req)
    inputs = request_inputs(req, fs, Limits())
    assert isinstance(inputs.items["adgroup_id"], np.ndarray if columnar else list)
    with pytest.raises(FeatureError) as info:
        request_columns_to_batch(fs, **vars(inputs))
    err = feature_error(fs, inputs, info.value, PREDICT_COLUMNS if columnar else PREDICT_ROWS)
    if columnar:
        assert err.field == 'candidate_columns.columns["adgroup_id"]'
        assert str(err).endswith(f"negative id -7; ids must be >= 0 (candidate {last})")
    else:
        assert err.field == f"candidates[{last}].adgroup_id"
