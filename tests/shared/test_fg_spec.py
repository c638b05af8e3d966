"""fg.json: exact round trip of the FeatureSet, a golden dict, and strict errors naming the key."""

import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shared.features import (
    CONSTANT_ZERO,
    DynamicTableSpec,
    FeatureKind,
    FeatureSet,
    FeatureSpec,
    GroupSpec,
    GroupType,
    IdMode,
    IdTransform,
    InitializerSpec,
    InitMode,
    LfuDecaySpec,
    ScoreStrategy,
    Side,
    TableSpec,
    feature_set_from_text,
)
from shared.fg_spec import (
    FG_FORMAT_VERSION,
    FgSpecError,
    feature_set_from_dict,
    feature_set_to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["multi_tower_din_taobao_dynamicemb.config", "multi_tower_din_taobao.config"]


def _json_round_trip(fs: FeatureSet) -> FeatureSet:
    text = json.dumps(feature_set_to_dict(fs), allow_nan=False)
    return feature_set_from_dict(json.loads(text))


@pytest.mark.parametrize("config", CONFIGS)
def test_round_trip_of_config_feature_sets(config: str) -> None:
    fs = feature_set_from_text((ROOT / "configs" / config).read_text(), config)
    back = _json_round_trip(fs)
    assert back == fs
    assert list(back.features) == list(fs.features)  # config order kept
    assert list(back.tables) == list(fs.tables)
    price = back.features["price"]
    assert (
        isinstance(price.boundaries, tuple) and price.boundaries == fs.features["price"].boundaries
    )
    assert price.kind is FeatureKind.RAW_BUCKETIZED
    assert isinstance(back.groups["seq"].query, tuple)


def _small() -> FeatureSet:
    """One dynamic table shared by an id and a sequence feature, one bucketized dense table."""
    dyn = DynamicTableSpec(
        max_capacity=100,
        init_capacity=16,
        bucket_capacity=128,
        score_strategy=ScoreStrategy.STEP,
        initializer=InitializerSpec(InitMode.NORMAL, std_dev=0.05),
        eval_initializer=CONSTANT_ZERO,
        admission=None,
        init_table=None,
    )
    tables = {
        "item_emb": TableSpec("item_emb", 4, None, dyn, "sum"),
        "price_emb": TableSpec("price_emb", 4, 3, None, "mean"),
    }
    features = {
        "item": FeatureSpec(
            "item", FeatureKind.ID, Side.ITEM, "item_id", "item_emb", IdTransform.DYNAMIC
        ),
        "price": FeatureSpec(
            "price",
            FeatureKind.RAW_BUCKETIZED,
            Side.ITEM,
            "price",
            "price_emb",
            IdTransform.BUCKETIZE,
            boundaries=(1.5, 10.0),
        ),
        "seq__item": FeatureSpec(
            "seq__item",
            FeatureKind.SEQUENCE_ID,
            Side.ITEM,
            "item_id",
            "item_emb",
            IdTransform.DYNAMIC,
            sequence_name="seq",
            sequence_length=50,
            sequence_delim="|",
        ),
    }
    groups = {
        "deep": GroupSpec("deep", GroupType.DEEP, ("item", "price")),
        "din": GroupSpec(
            "din", GroupType.SEQUENCE, ("item", "seq__item"), ("item",), ("seq__item",)
        ),
    }
    return FeatureSet(features, tables, groups, {"deep": ("item_emb",)}, ("clk",))


def _feature(
    name: str, kind: str, source: str, table: str, transform: str, **over: Any
) -> dict[str, Any]:
    base = {
        "name": name,
        "kind": kind,
        "side": "item",
        "source": source,
        "table": table,
        "transform": transform,
        "num_buckets": None,
        "hash_bucket_size": None,
        "boundaries": [],
        "sequence_name": None,
        "sequence_length": None,
        "sequence_delim": None,
        "id_mode": "dynrec",
    }
    return {**base, **over}


GOLDEN = {
    "format_version": 1,
    "features": {
        "item": _feature("item", "id", "item_id", "item_emb", "dynamic"),
        "price": _feature(
            "price", "raw_bucketized", "price", "price_emb", "boundaries", boundaries=[1.5, 10.0]
        ),
        "seq__item": _feature(
            "seq__item",
            "sequence_id",
            "item_id",
            "item_emb",
            "dynamic",
            sequence_name="seq",
            sequence_length=50,
            sequence_delim="|",
        ),
    },
    "tables": {
        "item_emb": {
            "name": "item_emb",
            "dim": 4,
            "num_rows": None,
            "dynamic": {
                "max_capacity": 100,
                "init_capacity": 16,
                "bucket_capacity": 128,
                "score_strategy": "STEP",
                "initializer": {
                    "mode": "NORMAL",
                    "mean": 0.0,
                    "std_dev": 0.05,
                    "lower": 0.0,
                    "upper": 0.0,
                    "value": 0.0,
                },
                "eval_initializer": {
                    "mode": "CONSTANT",
                    "mean": 0.0,
                    "std_dev": 0.0,
                    "lower": 0.0,
                    "upper": 0.0,
                    "value": 0.0,
                },
                "admission": None,
                "init_table": None,
                "cache_load_factor": None,
                "lfu_decay": None,
            },
            "pooling": "sum",
        },
        "price_emb": {
            "name": "price_emb",
            "dim": 4,
            "num_rows": 3,
            "dynamic": None,
            "pooling": "mean",
        },
    },
    "groups": {
        "deep": {
            "name": "deep",
            "type": "DEEP",
            "features": ["item", "price"],
            "query": [],
            "sequence": [],
        },
        "din": {
            "name": "din",
            "type": "SEQUENCE",
            "features": ["item", "seq__item"],
            "query": ["item"],
            "sequence": ["seq__item"],
        },
    },
    "fusion_groups": {"deep": ["item_emb"]},
    "label_fields": ["clk"],
}


def test_golden_dict() -> None:
    d = feature_set_to_dict(_small())
    assert d == GOLDEN
    assert next(iter(d)) == "format_version" and d["format_version"] == FG_FORMAT_VERSION
    assert feature_set_from_dict(copy.deepcopy(GOLDEN)) == _small()


def _broken(edit: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    d = copy.deepcopy(GOLDEN)
    edit(d)
    return d


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["tables"]["item_emb"]["dynamic"].pop("max_capacity"),
            "fg.json: tables.item_emb.dynamic: missing key 'max_capacity'",
        ),
        (
            lambda d: d["features"]["price"].update(bucket_size=3),
            "fg.json: features.price: unknown key 'bucket_size'",
        ),
        (
            lambda d: d["features"]["item"].update(side="shop"),
            "fg.json: features.item.side: 'shop' is not one of 'user', 'item', 'context'",
        ),
        (
            lambda d: d["tables"]["price_emb"].update(num_rows="3"),
            "fg.json: tables.price_emb.num_rows: expected an int, got str '3'",
        ),
        (
            lambda d: d["tables"]["price_emb"].update(dim=True),
            "fg.json: tables.price_emb.dim: expected an int, got bool True",
        ),
        (
            lambda d: d["features"]["price"].update(boundaries=[1.5, "x"]),
            "fg.json: features.price.boundaries[1]: expected a number",
        ),
        (lambda d: d.pop("label_fields"), "fg.json: missing key 'label_fields'"),
        (lambda d: d.pop("format_version"), "fg.json: missing key 'format_version'"),
        (lambda d: d.update(format_version=2), "format_version 2 is not supported"),
        (
            lambda d: d["features"]["item"].update(table="nope_emb"),
            "fg.json: features.item.table: 'nope_emb' is not in tables",
        ),
        (
            lambda d: d["groups"]["deep"].update(features=["item", "ghost"]),
            "fg.json: groups.deep.features: unknown feature 'ghost'",
        ),
        (
            lambda d: d["fusion_groups"].update(deep=["price_emb"]),
            "fg.json: fusion_groups.deep: 'price_emb' is not a dynamic table",
        ),
        (
            lambda d: d["tables"]["price_emb"].update(name="other"),
            "fg.json: tables.price_emb.name is 'other'; it must equal its key",
        ),
        (
            lambda d: d["features"]["item"].update(id_mode="farm"),
            "fg.json: features.item.id_mode: 'farm' is not one of 'dynrec', 'tzrec'",
        ),
        (
            lambda d: d["features"]["price"].update(id_mode="tzrec"),
            "fg.json: features.price.id_mode: 'tzrec' differs from features.item.id_mode 'dynrec'",
        ),
    ],
)
def test_errors_name_the_key(edit: Callable[[dict[str, Any]], object], message: str) -> None:
    with pytest.raises(FgSpecError) as err:
        feature_set_from_dict(_broken(edit))
    assert message in str(err.value)


def test_non_finite_float_is_refused_on_write() -> None:
    fs = _small()
    fs.features["price"] = replace(fs.features["price"], boundaries=(1.0, float("inf")))
    with pytest.raises(FgSpecError, match=r"features\.price\.boundaries\[1\]: inf is not finite"):
        feature_set_to_dict(fs)


def test_an_fg_json_without_id_mode_means_todays_ids() -> None:
    """Bundles written before the id mode existed keep generating the ids they were trained on."""
    old = copy.deepcopy(GOLDEN)
    for f in old["features"].values():
        del f["id_mode"]
    fs = feature_set_from_dict(old)
    assert fs == _small() and fs.id_mode is IdMode.DYNREC


def test_an_fg_json_without_cache_load_factor_means_every_row_in_device_memory() -> None:
    """Bundles written before the factor was read lack it: unset, as it was then."""
    old = copy.deepcopy(GOLDEN)
    for t in old["tables"].values():
        if t["dynamic"] is not None:
            del t["dynamic"]["cache_load_factor"]
    fs = feature_set_from_dict(old)
    assert fs == _small()
    assert all(t.dynamic.cache_load_factor is None for t in fs.dynamic_tables if t.dynamic)


def test_an_fg_json_without_lfu_decay_means_counts_that_never_decay() -> None:
    """Bundles written before the LFU decay existed lack it: no decay, as it was then; a table
    with one writes it and reads it back."""
    old = copy.deepcopy(GOLDEN)
    for t in old["tables"].values():
        if t["dynamic"] is not None:
            del t["dynamic"]["lfu_decay"]
    assert feature_set_from_dict(old) == _small()
    fs = _small()
    dyn = replace(
        fs.tables["item_emb"].dynamic,
        score_strategy=ScoreStrategy.LFU,
        lfu_decay=LfuDecaySpec(interval_steps=500, shift=2),
    )
    fs.tables["item_emb"] = replace(fs.tables["item_emb"], dynamic=dyn)
    d = feature_set_to_dict(fs)
    assert d["tables"]["item_emb"]["dynamic"]["lfu_decay"] == {"interval_steps": 500, "shift": 2}
    assert feature_set_from_dict(d) == fs


def test_the_tzrec_id_mode_round_trips() -> None:
    text = (ROOT / "configs" / CONFIGS[0]).read_text()
    text = text.replace("data_config {\n", "data_config {\ndynrec_id_mode: TZREC\n", 1)
    fs = feature_set_from_text(text, "tzrec ids")
    d = feature_set_to_dict(fs)
    assert {f["id_mode"] for f in d["features"].values()} == {"tzrec"}
    back = _json_round_trip(fs)
    assert back == fs and back.id_mode is IdMode.TZREC
