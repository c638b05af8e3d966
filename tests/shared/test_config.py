from pathlib import Path

import pytest

from protos import pipeline_pb2
from shared.config import (
    ConfigError,
    ConfigSource,
    config_digest,
    load_config,
    parse_config,
    source_of,
)
from shared.features import build_feature_set

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
BASELINE = ROOT / "configs" / "multi_tower_din_taobao.config"
SEED_DOC = ROOT.parent / "shared" / "seeds" / "000_56ae480795cb8bb2.txt"


@pytest.mark.parametrize("path", [SEED, BASELINE], ids=["dynamicemb", "num_buckets"])
def test_configs_parse(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.data_config.batch_size == 8192
    assert cfg.train_config.sparse_optimizer.adagrad_optimizer.lr == pytest.approx(0.001)
    assert cfg.train_config.dense_optimizer.adam_optimizer.lr == pytest.approx(0.001)
    assert list(cfg.data_config.label_fields) == ["clk"]
    deep = cfg.model_config.feature_groups[0]
    assert len(deep.feature_names) == 16  # adjacent names on one line are separate entries
    din = cfg.model_config.multi_tower_din
    assert list(din.towers[0].mlp.hidden_units) == [512, 256, 128]
    assert list(din.din_towers[0].attn_mlp.hidden_units) == [256, 64]
    assert list(din.final.hidden_units) == [64]


@pytest.mark.skipif(not SEED_DOC.exists(), reason="seed documents not beside the checkout")
def test_seed_config_differs_only_in_input_paths() -> None:
    doc = SEED_DOC.read_text()
    start = doc.index("# 基于 multi_tower_din_taobao.config")
    seed_text = doc[start : doc.index("8. 迁移风险矩阵")]
    ours = SEED.read_text().splitlines()
    theirs = seed_text.splitlines()
    assert len(ours) == len(theirs)
    diff = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    assert [a.split(":")[0] for a, _ in diff] == ["train_input_path", "eval_input_path"]
    # and the seed text itself parses (paths are just strings)
    parse_config(seed_text, "seed")


def test_tzrec_configs_get_todays_ids_and_the_extension_selects_theirs() -> None:
    assert load_config(SEED).data_config.dynrec_id_mode == pipeline_pb2.DYNREC  # field absent
    cfg = parse_config("data_config {\n  fg_mode: FG_DAG\n  dynrec_id_mode: TZREC\n}\n")
    assert cfg.data_config.dynrec_id_mode == pipeline_pb2.TZREC
    with pytest.raises(ConfigError, match=r"cfg:2: .*dynrec_id_mode: FARM.*no value named FARM"):
        parse_config("data_config {\n dynrec_id_mode: FARM\n}\n", "cfg")


def test_unknown_field_names_line() -> None:
    with pytest.raises(ConfigError, match=r"cfg:3: .*no_such_field"):
        parse_config("data_config {\n batch_size: 1\n no_such_field: 2\n}\n", "cfg")


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent.config")


def test_digest_ignores_layout() -> None:
    a = parse_config("data_config { batch_size: 4 }")
    b = parse_config("# comment\ndata_config {\n  batch_size: 4\n}\n")
    c = parse_config("data_config { batch_size: 5 }")
    assert config_digest(a) == config_digest(b) != config_digest(c)


def test_value_errors_of_a_loaded_file_name_its_line(tmp_path: Path) -> None:
    # build_feature_set(load_config(path)), as the CLIs call it, finds the text by itself
    text = SEED.read_text().replace('score_strategy: "LFU"', 'score_strategy: "LRU"', 1)
    path = tmp_path / "x.config"
    path.write_text(text)
    line = text.splitlines().index('score_strategy: "LRU"') + 1
    with pytest.raises(ConfigError, match=rf"^{path}:{line}: .*score_strategy: 'LRU'"):
        build_feature_set(load_config(path))
    assert source_of(load_config(SEED)) is not None
    assert source_of(pipeline_pb2.EasyRecConfig()) is None  # built in code: field names only


def test_source_indexes_fields_by_path() -> None:
    src = ConfigSource(
        '# a comment with a brace { and a quote "\n'
        "data_config {\n"
        "  batch_size: 4  # trailing\n"
        "  label_fields: ['clk',\n"
        "    'buy']\n"
        "}\n"
        "model_config {\n"
        "  feature_groups { group_name: 'deep' }\n"
        "  feature_groups <\n"
        '    feature_names: "a" "b"\n'
        '    feature_names: "c"\n'
        "  >\n"
        "}\n",
        "cfg",
    )
    assert src.line_at(("data_config", "batch_size")) == 3
    assert src.line_at(("data_config", "label_fields", 1)) == 5
    assert src.line_at(("model_config", "feature_groups", 1)) == 9
    assert src.line_at(("model_config", "feature_groups", 1, "feature_names", 1)) == 10
    assert src.line_at(("model_config", "feature_groups", 1, "feature_names", 2)) == 11
    assert src.line_at(("data_config", "num_workers")) == 2  # absent: its message
    assert ConfigSource("", "cfg").line_at(("data_config",)) is None
    err = src.error("data_config.batch_size", "too small", at=("data_config", "batch_size"))
    assert str(err) == "cfg:3: data_config.batch_size: too small"


def test_adjacent_feature_names_are_entries_but_literals_elsewhere_concatenate() -> None:
    cfg = parse_config(
        'train_input_path: "a" "b"\nmodel_config {\n feature_groups {\n'
        '  feature_names: "x" "y"\n  feature_names: "z"\n }\n}\n'
    )
    assert cfg.train_input_path == "ab"  # protobuf text format, as tzrec reads it
    assert list(cfg.model_config.feature_groups[0].feature_names) == ["x", "y", "z"]  # ours
