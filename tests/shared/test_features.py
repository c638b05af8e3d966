from pathlib import Path

import pytest

from shared.config import ConfigError
from shared.features import (
    FeatureKind,
    GroupType,
    IdMode,
    IdTransform,
    InitMode,
    LfuDecaySpec,
    ScoreStrategy,
    Side,
    feature_set_from_text,
)

ROOT = Path(__file__).resolve().parents[2]
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
BASE_TEXT = (ROOT / "configs" / "multi_tower_din_taobao.config").read_text()
DYNAMIC = [
    "user_id_emb",
    "adgroup_id_emb",
    "brand_emb",
    "campaign_id_emb",
    "customer_emb",
    "cate_id_emb",
]


def test_seed_dynamic_tables() -> None:
    fs = feature_set_from_text(SEED_TEXT, "seed")
    assert sorted(t.name for t in fs.dynamic_tables) == sorted(DYNAMIC)
    caps = {t.name: t.dynamic.max_capacity for t in fs.dynamic_tables}
    assert caps == {
        "user_id_emb": 300000,
        "adgroup_id_emb": 250000,
        "brand_emb": 150000,
        "campaign_id_emb": 150000,
        "customer_emb": 100000,
        "cate_id_emb": 5000,
    }
    for t in fs.dynamic_tables:
        d = t.dynamic
        assert t.dim == 16
        assert d.init_capacity == 1024 and d.bucket_capacity == 128
        assert d.score_strategy is ScoreStrategy.LFU
        assert d.initializer.mode is InitMode.NORMAL
        assert d.initializer.std_dev == pytest.approx(0.05)
        assert d.eval_initializer.mode is InitMode.CONSTANT and d.eval_initializer.value == 0
        assert d.admission is not None and d.admission.threshold == 3
        assert d.admission.initializer.mode is InitMode.CONSTANT
        assert d.admission.counter_capacity == d.max_capacity
        assert d.admission.counter_bucket_capacity == 1024


def test_seed_dense_tables() -> None:
    fs = feature_set_from_text(SEED_TEXT, "seed")
    rows = {t.name: t.num_rows for t in fs.dense_tables}
    id_tables = {k: v for k, v in rows.items() if k != "price_emb"}
    assert id_tables == {
        "cms_segid_emb": 98,
        "cms_group_id_emb": 14,
        "final_gender_code_emb": 3,
        "age_level_emb": 8,
        "pvalue_level_emb": 5,
        "shopping_level_emb": 5,
        "occupation_emb": 3,
        "new_user_class_level_emb": 6,
        "pid_emb": 20,
    }
    assert fs.features["pid"].transform is IdTransform.HASH
    assert sum(f.transform is IdTransform.MOD for f in fs.features.values()) == 8
    price = fs.features["price"]
    assert price.kind is FeatureKind.RAW_BUCKETIZED
    assert rows["price_emb"] == len(price.boundaries) + 1 == 99


def test_sequence_features_share_top_level_tables() -> None:
    fs = feature_set_from_text(SEED_TEXT, "seed")
    for sub in ("adgroup_id", "cate_id", "brand"):
        f = fs.features[f"click_50_seq__{sub}"]
        assert f.kind is FeatureKind.SEQUENCE_ID
        assert f.table == fs.features[sub].table == f"{sub}_emb"
        assert f.transform is IdTransform.DYNAMIC
        assert (f.sequence_length, f.sequence_delim) == (100, "|")


def test_groups_and_fusion() -> None:
    fs = feature_set_from_text(SEED_TEXT, "seed")
    deep = fs.group(GroupType.DEEP)
    assert len(deep.features) == 16
    seq = fs.group(GroupType.SEQUENCE)
    assert seq.query == ("adgroup_id", "cate_id", "brand")
    assert seq.sequence == tuple(f"click_50_seq__{n}" for n in seq.query)
    assert sorted(fs.fusion_groups["deep"]) == sorted(DYNAMIC)
    assert "seq" not in fs.fusion_groups  # its dynamic tables already live in deep's storage
    assert fs.features["user_id"].side is Side.USER
    assert fs.features["pid"].side is Side.CONTEXT
    assert fs.columns()[-1] == "clk"


def test_baseline_has_no_dynamic_tables() -> None:
    fs = feature_set_from_text(BASE_TEXT, "base")
    assert fs.dynamic_tables == []
    assert fs.tables["user_id_emb"].num_rows == 1141730
    assert fs.features["click_50_seq__adgroup_id"].transform is IdTransform.MOD
    assert fs.features["click_50_seq__adgroup_id"].num_buckets == 846812


def _mutate(old: str, new: str, text: str = SEED_TEXT) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


USER_DE = 'max_capacity: 300000\ninitializer_args { mode: "NORMAL"; std_dev: 0.05 }\nscore_strategy: "LFU"'


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        (
            'feature_names: "occupation" "new_user_class_level"',
            'feature_names: "occupation" "nope"',
            r"feature_groups\(deep\)\.feature_names: unknown feature 'nope'",
        ),
        (
            'feature_name: "user_id"\nexpression: "user:user_id"\nembedding_dim: 16',
            'feature_name: "user_id"\nexpression: "user:user_id"\nnum_buckets: 10\nembedding_dim: 16',
            r"id_feature\(user_id\)\.dynamicemb: dynamicemb and num_buckets are exclusive",
        ),
        (
            "max_capacity: 300000\n",
            "max_capacity: 512\n",
            r"id_feature\(user_id\)\.dynamicemb\.max_capacity: max_capacity 512 < init_capacity_per_rank 1024",
        ),
        (
            'score_strategy: "LFU"',
            'score_strategy: "LRU"',
            r"id_feature\(user_id\)\.dynamicemb\.score_strategy: 'LRU' is not one of",
        ),
        (
            "frequency_admission_strategy { threshold: 3 }",
            "frequency_admission_strategy { threshold: 0 }",
            r"id_feature\(user_id\)\.dynamicemb\.frequency_admission_strategy\.threshold: must be >= 1",
        ),
        (
            "boundaries: [1.1, 2.2, 3.6,",
            "boundaries: [1.1, 3.6, 2.2,",
            r"raw_feature\(price\)\.boundaries: must be strictly increasing",
        ),
        (
            'feature_name: "brand"\nexpression: "item:brand"\nembedding_dim: 16\n}\n}\n}',
            'feature_name: "brand"\nexpression: "item:brand"\nembedding_dim: 8\n}\n}\n}',
            r"id_feature\(brand\)\.embedding_dim: table 'brand_emb' is shared and has embedding_dim 16, got 8",
        ),
        (
            'mode: "NORMAL"',
            'mode: "GAUSS"',
            r"dynamicemb\.initializer_args\.mode: 'GAUSS' is not one of",
        ),
        (
            'score_strategy: "LFU"',
            'score_strategy: "LFU"\nlfu_decay { interval_steps: 0 }',
            r"id_feature\(user_id\)\.dynamicemb\.lfu_decay\.interval_steps: must be >= 1, got 0",
        ),
        (
            'score_strategy: "LFU"',
            'score_strategy: "LFU"\nlfu_decay { interval_steps: 100 shift: 0 }',
            r"id_feature\(user_id\)\.dynamicemb\.lfu_decay\.shift: must be in \[1, 62\], got 0",
        ),
        (
            'score_strategy: "LFU"',
            'score_strategy: "LFU"\nlfu_decay { interval_steps: 100 shift: 63 }',
            r"id_feature\(user_id\)\.dynamicemb\.lfu_decay\.shift: must be in \[1, 62\], got 63",
        ),
        (
            'score_strategy: "LFU"',
            'score_strategy: "STEP"\nlfu_decay { interval_steps: 100 }',
            r"id_feature\(user_id\)\.dynamicemb\.lfu_decay: decays LFU use counts, but "
            r"score_strategy is STEP",
        ),
    ],
    ids=[
        "unknown-feature",
        "dynamic+num_buckets",
        "capacity",
        "score",
        "threshold",
        "boundaries",
        "shared-dim",
        "init-mode",
        "lfu-decay-interval",
        "lfu-decay-shift-0",
        "lfu-decay-shift-63",
        "lfu-decay-not-lfu",
    ],
)
def test_validation_errors_name_the_field(old: str, new: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        feature_set_from_text(_mutate(old, new), "cfg")
    assert info.value.line is not None, "error should point at a line"


def test_lfu_decay_is_read_and_absent_by_default() -> None:
    assert all(t.dynamic.lfu_decay is None for t in feature_set_from_text(SEED_TEXT).dynamic_tables)
    text = _mutate(USER_DE, USER_DE + "\nlfu_decay { interval_steps: 500 }")
    tables = {t.name: t.dynamic for t in feature_set_from_text(text, "cfg").dynamic_tables}
    assert tables["user_id_emb"].lfu_decay == LfuDecaySpec(interval_steps=500, shift=1)
    assert tables["brand_emb"].lfu_decay is None  # another table's block: not this one's
    text = _mutate(USER_DE, USER_DE + "\nlfu_decay { interval_steps: 7 shift: 3 }")
    user = next(
        t for t in feature_set_from_text(text, "cfg").dynamic_tables if t.name == "user_id_emb"
    )
    assert user.dynamic.lfu_decay == LfuDecaySpec(interval_steps=7, shift=3)


def test_missing_max_capacity_is_a_parse_error_naming_it() -> None:
    text = _mutate("max_capacity: 300000\n", "")
    with pytest.raises(ConfigError, match="max_capacity"):
        feature_set_from_text(text, "cfg")


def test_error_line_points_at_the_field() -> None:
    text = _mutate('score_strategy: "LFU"', 'score_strategy: "LRU"')
    with pytest.raises(ConfigError) as info:
        feature_set_from_text(text, "cfg")
    assert 'score_strategy: "LRU"' in text.splitlines()[info.value.line - 1]


def test_id_mode_defaults_to_dynrec_and_reaches_every_feature() -> None:
    assert feature_set_from_text(SEED_TEXT, "seed").id_mode is IdMode.DYNREC
    text = SEED_TEXT.replace("data_config {\n", "data_config {\ndynrec_id_mode: TZREC\n", 1)
    fs = feature_set_from_text(text, "tzrec ids")
    assert fs.id_mode is IdMode.TZREC
    assert {f.id_mode for f in fs.features.values()} == {IdMode.TZREC}  # sequences too
    assert fs.features["click_50_seq__brand"].id_mode is IdMode.TZREC


@pytest.mark.parametrize(
    ("old", "new", "line_has"),
    [
        ('score_strategy: "LFU"', 'score_strategy: "LRU"', 'score_strategy: "LRU"'),
        ('mode: "NORMAL"', 'mode: "GAUSS"', 'mode: "GAUSS"'),  # bad enum-like value
        ("std_dev: 0.05", "std_dev: -1", "std_dev: -1"),  # out of range
        ("threshold: 3 }", "threshold: 0 }", "threshold: 0"),
        ("max_capacity: 300000\n", "max_capacity: 512\n", "max_capacity: 512"),
        ("max_capacity: 300000\n", "", "dynamicemb {"),  # absent: its message's line
        (  # contradictory options
            'expression: "user:user_id"\nembedding_dim: 16\ndynamicemb {',
            'expression: "user:user_id"\nnum_buckets: 9\nembedding_dim: 16\ndynamicemb {',
            "dynamicemb {",
        ),
        ('expression: "user:user_id"', 'expression: "usr:user_id"', '"usr:user_id"'),
        ("boundaries: [1.1, 2.2, 3.6,", "boundaries: [1.1, 3.6, 2.2,", "boundaries: [1.1, 3.6"),
        (  # unknown name in a group: the line of that name, not of the first "nope" elsewhere
            'feature_names: "price" "pid"',
            'feature_names: "price" "nope"',
            'feature_names: "price" "nope"',
        ),
        (  # a sequence sub-feature's shared table
            'feature_name: "brand"\nexpression: "item:brand"\nembedding_dim: 16\n}\n}\n}',
            'feature_name: "brand"\nexpression: "item:brand"\nembedding_dim: 8\n}\n}\n}',
            "embedding_dim: 8",
        ),
    ],
    ids=[
        "score",
        "init-mode",
        "std-dev",
        "threshold",
        "capacity",
        "absent",
        "exclusive",
        "side",
        "boundaries",
        "unknown-feature",
        "shared-dim",
    ],
)
def test_value_errors_name_file_and_line_of_the_field(old: str, new: str, line_has: str) -> None:
    text = _mutate(old, new)
    with pytest.raises(ConfigError) as info:
        feature_set_from_text(text, "cfg")
    line = info.value.line
    assert line is not None and str(info.value).startswith(f"cfg:{line}: ")
    assert line_has in text.splitlines()[line - 1]
