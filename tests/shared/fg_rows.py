"""The seed config and sample rows that the feature-generation tests share (test_fg, test_fg_request)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch

from shared.features import FeatureSet

ROOT = Path(__file__).resolve().parents[2]
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
TZREC_TEXT = SEED_TEXT.replace("data_config {\n", "data_config {\ndynrec_id_mode: TZREC\n", 1)
MASK64 = (1 << 64) - 1
SEQ = ("click_50_seq__adgroup_id", "click_50_seq__cate_id", "click_50_seq__brand")


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
