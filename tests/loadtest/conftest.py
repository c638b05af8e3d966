"""A tiny eval-sample directory with the Taobao sample columns, and the model metadata that
describes it (what a served MultiTowerDIN reports through GetModelMetadata)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protos import predict_pb2

USER = ["user_id", "cms_segid", "cms_group_id", "final_gender_code", "age_level", "pvalue_level",
        "shopping_level", "occupation", "new_user_class_level"]  # fmt: skip
ITEM = ["adgroup_id", "cate_id", "campaign_id", "customer", "brand", "price"]
CONTEXT = ["pid"]
SEQUENCE = ["click_50_seq__adgroup_id", "click_50_seq__cate_id", "click_50_seq__brand"]


def model_metadata(
    max_candidates: int = 1000, max_sequence_length: int = 100, delimiter: str = "|"
) -> predict_pb2.ModelMetadata:
    md = predict_pb2.ModelMetadata(
        model_version="test-1",
        max_candidates=max_candidates,
        max_sequence_length=max_sequence_length,
    )
    for name in USER + ITEM + CONTEXT:
        side = "user" if name in USER else "item" if name in ITEM else "context"
        kind, vtype = "id", "int64"
        if name == "price":
            kind, vtype = "raw_bucketized", "double"
        if name == "pid":
            vtype = "string"
        md.features.add(name=name, side=side, kind=kind, value_type=vtype)
    for name in SEQUENCE:  # sequence sub-features are item-side expressions in the config
        md.features.add(
            name=name,
            side="item",
            kind="sequence_id",
            value_type="int64",
            max_length=max_sequence_length,
        )
    md.sequences.add(
        name="click_50_seq", features=SEQUENCE, max_length=max_sequence_length, delimiter=delimiter
    )
    return md


ROWS = {
    "user_id": [11, 12, 13, 16, 14, 15],
    "cms_segid": [0, 1, 2, 0, 3, 4],
    "cms_group_id": [1, 2, 3, 1, 4, 5],
    "final_gender_code": [1, 2, 1, 1, 2, 2],
    "age_level": [3, 4, 5, 3, 2, 1],
    "pvalue_level": [1, None, 2, 1, None, 3],
    "shopping_level": [3, 3, 2, 3, 1, 3],
    "occupation": [0, 1, 0, 0, 0, 1],
    "new_user_class_level": [2, None, 4, 2, 3, None],
    "adgroup_id": [101, 102, 103, 104, 105, 101],
    "cate_id": [7, 8, 7, 9, 8, 7],
    "campaign_id": [31, 32, 33, 34, 35, 31],
    "customer": [41, 42, 43, 44, 45, 41],
    "brand": [51, None, 53, 54, None, 51],
    "price": [9.9, 120.0, None, 35.5, 1.0, 9.9],
    "pid": [
        "430548_1007",
        "430539_1007",
        "430548_1007",
        "430539_1007",
        "430548_1007",
        "430548_1007",
    ],
    "click_50_seq__adgroup_id": ["201|202|203", "", "204", "201||205", "206|207", ""],
    "click_50_seq__cate_id": ["7|8|9", "", "8", "7||9", "8|8", ""],
    "click_50_seq__brand": ["51||53", "", "52", "51|52|53", "|54", ""],
    "clk": [0, 1, 0, 0, 1, 0],
    "time_stamp": [1494633600 + i for i in range(6)],
}


@pytest.fixture
def sample_dir(tmp_path: Path) -> Path:
    """Two part files, as the sample builder writes them."""
    table = pa.table(ROWS)
    out = tmp_path / "eval"
    out.mkdir()
    pq.write_table(table.slice(0, 3), out / "part-00000.parquet")
    pq.write_table(table.slice(3), out / "part-00001.parquet")
    return out
