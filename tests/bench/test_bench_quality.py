"""bench/bench_quality.py on tiny data, a few steps: both variants trained and evaluated, the JSON
with every figure, over several seeds and in child processes (``--jobs``); the on - off
differences, the medians and issue #22's goal from made-up figures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from bench.bench_quality import (
    aggregate,
    child_argv,
    crosses_config,
    differences,
    generate,
    goal,
    main,
    paired_differences,
    variant_config,
)
from shared.config import ConfigError, load_config
from shared.features import build_feature_set
from train.model.sparse_arch import table_lr_scales

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
FAST = ["--batch", "256", "--max-steps", "3", "--num-workers", "0", "--device", "cpu"]
FIGURES = ("auc", "head_auc", "tail_auc", "logloss", "oracle_auc", "rows", "train_seconds",
           "samples_per_s")  # fmt: skip
COUNTERS = ("lookups", "misses", "eval_lookups", "eval_misses")


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _check_variant(v: dict[str, Any], *, counted: bool) -> None:
    """Every figure of one variant; ``counted``: the tables' lookup counters must be there."""
    for k in FIGURES:
        assert _finite(v[k]), (k, v[k])
    assert 0.0 <= v["auc"] <= 1.0 and v["rows"] > 0 and v["steps"] == 3
    shares = v["backoff_share"]
    assert "user_id_emb" in shares and "all" in shares
    for table, row in shares.items():
        assert set(COUNTERS) | {"train_share", "eval_share"} <= set(row), table
        if counted or row["lookups"] is not None:
            assert row["lookups"] > 0 and 0.0 <= row["train_share"] <= 1.0, (table, row)
            assert row["eval_lookups"] > 0 and 0.0 <= row["eval_share"] <= 1.0, (table, row)


def test_off_variant(tiny_samples: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    result = main(["--samples", str(tiny_samples), "--variants", "off", *FAST, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["variants"]) == ["off"]
    _check_variant(result["variants"]["off"], counted=False)
    assert result["on_minus_off"] == {}
    assert result["goal"]["met"] is None  # no on variant


def test_id_dropout_option(tiny_samples: Path, tmp_path: Path) -> None:
    """--id-dropout P: the on variant trains with cold_backoff { id_dropout: P }, recorded."""
    out = tmp_path / "q.json"
    args = ["--samples", str(tiny_samples), *FAST, "--out", str(out)]
    result = main(["--variants", "on", "--id-dropout", "0.3", *args])
    on = result["variants"]["on"]
    assert result["id_dropout"] == 0.3 and on["id_dropout"] == 0.3
    assert on["config"].endswith("_on_drop0.3_x1.config")
    _check_variant(on, counted=True)
    with pytest.raises(ValueError, match="applies to the on variant"):
        main(["--variants", "off", "--id-dropout", "0.3", *args])
    with pytest.raises(ValueError, match=r"--id-dropout 1.0: give a probability in \[0, 1\)"):
        main(["--variants", "on", "--id-dropout", "1", *args])


def test_both_variants(tmp_path: Path) -> None:
    """The finished behaviour (issue #22): the on variant trains with the backoff."""
    out = tmp_path / "q.json"
    result = main(["--size", "tiny", *FAST, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert list(saved["variants"]) == ["off", "on"]
    for v in saved["variants"].values():
        _check_variant(v, counted=True)
    off, on = saved["variants"]["off"], saved["variants"]["on"]
    assert on["config"].endswith("_on_x1.config") and off["rows"] == on["rows"]
    # the tables see the same keys in the same order: the same lookups and misses
    assert off["backoff_share"] == on["backoff_share"]
    diff = saved["on_minus_off"]
    assert diff["auc"] == pytest.approx(on["auc"] - off["auc"])
    assert set(diff) >= {"auc", "head_auc", "tail_auc", "logloss", "samples_per_s"}
    g = saved["goal"]
    assert g["data_size"] == "tiny" and g["applies"] is False and g["note"]
    assert isinstance(g["met"], bool) and set(g["checks"]) == {"tail_auc", "auc", "head_auc"}
    assert saved["data"]["size"] == "tiny" and saved["data"]["generated"] is True
    assert result["goal"] == g


def test_variant_config(tmp_path: Path) -> None:
    assert variant_config(SEED_CONFIG, "off", tmp_path) == SEED_CONFIG
    assert not load_config(SEED_CONFIG).model_config.multi_tower_din.HasField("cold_backoff")
    on = load_config(variant_config(SEED_CONFIG, "on", tmp_path))
    assert on.model_config.multi_tower_din.HasField("cold_backoff")
    on.model_config.multi_tower_din.ClearField("cold_backoff")
    assert on == load_config(SEED_CONFIG)  # nothing else changed
    path = variant_config(SEED_CONFIG, "on", tmp_path, id_dropout=0.25)
    assert path.name.endswith("_on_drop0.25_x1.config")
    assert load_config(path).model_config.multi_tower_din.cold_backoff.id_dropout == 0.25
    assert variant_config(SEED_CONFIG, "off", tmp_path, id_dropout=0.25) == SEED_CONFIG


def _v(auc: float, head: float | None, tail: float | None) -> dict[str, Any]:
    return {"auc": auc, "head_auc": head, "tail_auc": tail, "logloss": 0.2,
            "train_seconds": 1.0, "samples_per_s": 10.0}  # fmt: skip


def test_goal_and_differences() -> None:
    off = _v(0.70, 0.72, 0.60)
    met = {"off": off, "on": _v(0.70, 0.72, 0.64)}
    assert goal(met, "full")["met"] is True and goal(met, "full")["applies"] is True
    assert differences(met)["tail_auc"] == pytest.approx(0.04)
    lower_head = {"off": off, "on": _v(0.71, 0.719, 0.65)}
    g = goal(lower_head, "full")
    assert g["met"] is False and g["checks"]["head_auc"]["met"] is False
    assert goal({"off": off, "on": _v(0.71, 0.73, 0.631)}, "full")["met"] is False
    missing = {"off": off, "on": _v(0.71, 0.73, None)}
    assert goal(missing, "full")["met"] is None and differences(missing)["tail_auc"] is None
    assert goal(met, "small")["applies"] is False and goal(met, "small")["note"]


def test_capacity_scale_shrinks_every_dynamic_table(tmp_path: Path) -> None:
    base = load_config(SEED_CONFIG)
    scaled = load_config(variant_config(SEED_CONFIG, "off", tmp_path, capacity_scale=0.01))
    pairs = [
        (a.id_feature.dynamicemb, b.id_feature.dynamicemb)
        for a, b in zip(base.feature_configs, scaled.feature_configs, strict=True)
        if a.WhichOneof("feature") == "id_feature" and a.id_feature.HasField("dynamicemb")
    ]
    assert pairs and all(b.max_capacity == round(a.max_capacity * 0.01) for a, b in pairs)
    assert all(b.init_capacity_per_rank <= b.max_capacity for _, b in pairs)
    assert not scaled.model_config.multi_tower_din.HasField("cold_backoff")


def test_sparse_lr_and_crosses_change_both_variants_alike(tmp_path: Path) -> None:
    for name in ("off", "on"):
        path = variant_config(SEED_CONFIG, name, tmp_path, sparse_lr=0.05, crosses="all")
        assert path.name.endswith(f"_{name}_slr0.05_crosses_x1.config")
        config = load_config(path)
        assert config.train_config.sparse_optimizer.adagrad_optimizer.lr == pytest.approx(0.05)
        assert config.model_config.multi_tower_din.HasField("crosses")
        assert not config.model_config.multi_tower_din.crosses.pairs  # all: none named
    named = crosses_config("cms_group_id:cate_id, cms_group_id:adgroup_id")
    assert [(p.user_feature, p.item_feature) for p in named.pairs] == [
        ("cms_group_id", "cate_id"), ("cms_group_id", "adgroup_id")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="USER:ITEM pairs"):
        crosses_config("cms_group_id")


def test_ema_decay_sets_or_turns_on_the_dense_ema_in_both_variants(tmp_path: Path) -> None:
    cold_ids = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb_cold_ids.config"
    for base in (SEED_CONFIG, cold_ids):  # without an EMA, and with one at 0.999
        for name in ("off", "on"):
            path = variant_config(base, name, tmp_path, ema_decay=0.9995)
            assert path.name.endswith(f"_{name}_ema0.9995_x1.config")
            config = load_config(path)
            assert config.train_config.dense_optimizer.ema.decay == pytest.approx(0.9995)
            rest = load_config(base)
            rest.train_config.dense_optimizer.ema.decay = 0.9995
            if name == "on":
                rest.model_config.multi_tower_din.cold_backoff.SetInParent()
            assert config == rest  # nothing else changed


def test_admission_sets_the_named_dynamic_features_thresholds_only(tmp_path: Path) -> None:
    path = variant_config(SEED_CONFIG, "off", tmp_path, admission="user_id:5, brand:1")
    assert path.name.endswith("_off_admuser_id5_brand1_x1.config")
    config, base = load_config(path), load_config(SEED_CONFIG)
    for fc in base.feature_configs:
        if fc.id_feature.feature_name in ("user_id", "brand"):
            assert fc.id_feature.dynamicemb.frequency_admission_strategy.threshold == 3
            fc.id_feature.dynamicemb.frequency_admission_strategy.threshold = (
                5 if fc.id_feature.feature_name == "user_id" else 1
            )
    assert config == base  # nothing else changed


def test_item_tower_adds_the_item_only_tower_to_both_variants_only(tmp_path: Path) -> None:
    for name in ("off", "on"):
        path = variant_config(SEED_CONFIG, name, tmp_path, item_tower="64, 32")
        assert path.name.endswith(f"_{name}_it64-32_x1.config")
        config, base = load_config(path), load_config(SEED_CONFIG)
        assert list(config.model_config.multi_tower_din.item_tower.hidden_units) == [64, 32]
        base.model_config.multi_tower_din.item_tower.hidden_units.extend([64, 32])
        if name == "on":
            base.model_config.multi_tower_din.cold_backoff.SetInParent()
        assert config == base  # nothing else changed


def test_table_lr_and_max_capacity_set_the_named_tables_only(tmp_path: Path) -> None:
    path = variant_config(SEED_CONFIG, "on", tmp_path, table_lr="cate_id:4",
                          max_capacity="cate_id:10000")  # fmt: skip
    assert path.name.endswith("_on_tlrcate_id4_capcate_id10000_x1.config")
    config, base = load_config(path), load_config(SEED_CONFIG)
    base.train_config.sparse_optimizer.table_learning_rates.add(feature_name="cate_id", lr_scale=4)
    for fc in base.feature_configs:
        if fc.id_feature.feature_name == "cate_id":
            fc.id_feature.dynamicemb.max_capacity = 10000
    base.model_config.multi_tower_din.cold_backoff.SetInParent()
    assert config == base  # nothing else changed
    fs = build_feature_set(config)
    assert table_lr_scales(fs, config.train_config.sparse_optimizer) == {"cate_id_emb": 4.0}


def test_bad_sparse_lr_and_crosses_fail_before_any_training(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    with pytest.raises(ValueError, match="--sparse-lr 0.0: give a learning rate > 0"):
        main(["--size", "tiny", "--sparse-lr", "0", "--out", str(out)])
    with pytest.raises(ConfigError, match=r"pairs\[0\]\.item_feature.*'nope'"):
        main(["--size", "tiny", "--crosses", "user_id:nope", "--out", str(out)])
    for spec, error in (("user_id", "give FEATURE:N pairs"), ("user_id:0", "give FEATURE:N"),
                        ("cms_segid:5", "'cms_segid' is not a dynamic id feature of the config "
                         r"\(those are user_id, adgroup_id")):  # fmt: skip
        with pytest.raises(ValueError, match=f"--admission {spec}: {error}"):
            main(["--size", "tiny", "--admission", spec, "--out", str(out)])
    for decay in ("0", "1", "1.5"):
        with pytest.raises(ValueError, match=f"--ema-decay {float(decay)}: give a decay in"):
            main(["--size", "tiny", "--ema-decay", decay, "--out", str(out)])
    for flag, spec, error in (
        ("--table-lr", "cate_id", r"give FEATURE:SCALE pairs \(SCALE > 0\)"),
        ("--table-lr", "cate_id:0", "give FEATURE:SCALE pairs"),
        ("--table-lr", "pid:2", "'pid' is not a dynamic id feature"),
        ("--max-capacity", "cate_id:1.5", r"give FEATURE:N pairs \(N >= 1\)"),
        ("--max-capacity", "nope:10", "'nope' is not a dynamic id feature"),
    ):
        with pytest.raises(ValueError, match=f"{flag} {spec}: {error}"):
            main(["--size", "tiny", flag, spec, "--out", str(out)])
    for units in ("0", "64,x", ""):
        with pytest.raises(ValueError, match=f"--item-tower {units}: give hidden units > 0"):
            main(["--size", "tiny", "--item-tower", units, "--out", str(out)])
    assert not out.exists()


def test_seeds_in_child_processes_equal_the_runs_in_process(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """--seeds 0,1 --jobs 2: every (variant, seed) trains in a process of its own with the same
    arguments, and gives what the same run in this process gives; the variants' figures are
    the medians of their seeds' runs."""
    args = ["--samples", str(tiny_samples), "--seeds", "0,1", *FAST, "--sparse-lr", "0.05",
            "--crosses", "cms_group_id:cate_id", "--id-dropout", "0.2"]  # fmt: skip
    here = main([*args, "--out", str(tmp_path / "here.json")])
    there = main([*args, "--jobs", "2", "--out", str(tmp_path / "there.json")])
    assert here["seeds"] == there["seeds"] == [0, 1] and there["jobs"] == 2
    for name in ("off", "on"):
        a, b = here["variants"][name], there["variants"][name]
        assert list(a["runs"]) == list(b["runs"]) == ["0", "1"]
        for seed in ("0", "1"):
            ra, rb = a["runs"][seed], b["runs"][seed]
            _check_variant(rb, counted=True)
            for k in ("auc", "head_auc", "tail_auc", "logloss", "config", "id_dropout"):
                assert ra[k] == rb[k], (name, seed, k)
            assert ra["backoff_share"] == rb["backoff_share"]
        for k in ("auc", "tail_auc", "logloss"):
            assert a[k] == pytest.approx((a["runs"]["0"][k] + a["runs"]["1"][k]) / 2)
    assert here["variants"]["on"]["runs"]["0"]["config"].endswith(
        "_on_slr0.05_crosses_drop0.2_x1.config"
    )
    # different seeds, different runs
    assert (
        here["variants"]["off"]["runs"]["0"]["logloss"]
        != here["variants"]["off"]["runs"]["1"]["logloss"]
    )
    assert set(there["on_minus_off_by_seed"]) == {"0", "1"}


def test_child_argv_passes_every_option_on(tmp_path: Path) -> None:
    from bench.bench_quality import _parser

    args = _parser().parse_args(
        ["--size", "tiny", "--batch", "64", "--max-steps", "2", "--eval-max-batches", "1",
         "--capacity-scale", "0.5", "--sparse-lr", "0.02", "--crosses", "all", "--ema-decay", "0.99",
         "--admission", "user_id:5", "--item-tower", "64", "--table-lr", "cate_id:2",
         "--max-capacity", "cate_id:9000", "--id-dropout", "0.1", "--num-workers", "3", "--device", "cpu", "--out", "x.json"]
    )  # fmt: skip
    on = _parser().parse_args(child_argv("on", 4, tmp_path, args, tmp_path / "on.json"))
    off = _parser().parse_args(child_argv("off", 4, tmp_path, args, tmp_path / "off.json"))
    for child in (on, off):
        for k in ("batch", "max_steps", "eval_max_batches", "capacity_scale", "sparse_lr",
                  "crosses", "ema_decay", "admission", "item_tower", "table_lr",
                  "max_capacity", "num_workers", "device", "config"):  # fmt: skip
            assert getattr(child, k) == getattr(args, k), k
        assert child.samples == tmp_path and child.seeds == "4" and child.jobs == 1
    assert (on.variants, on.id_dropout, off.variants, off.id_dropout) == ("on", 0.1, "off", 0.0)


def test_aggregate_takes_medians_and_keeps_the_runs() -> None:
    def run(auc: float, misses: float | None) -> dict[str, Any]:
        share = {"t": {"lookups": 10.0, "misses": misses, "train_share": None}}
        return {**_v(auc, auc, auc - 0.1), "config": "c", "backoff_share": share}

    agg = aggregate({2: run(0.7, 1.0), 0: run(0.6, 3.0), 1: run(0.9, 2.0)})
    assert agg["seeds"] == [0, 1, 2] and list(agg["runs"]) == ["0", "1", "2"]
    assert agg["auc"] == pytest.approx(0.7) and agg["tail_auc"] == pytest.approx(0.6)
    assert agg["config"] == "c" and agg["backoff_share"]["t"] == {
        "lookups": 10.0, "misses": 2.0, "train_share": None
    }  # fmt: skip
    assert aggregate({0: run(0.6, None)})["backoff_share"]["t"]["misses"] is None
    pair = {"off": aggregate({0: run(0.6, 1.0), 1: run(0.7, 1.0)}),
            "on": aggregate({1: run(0.75, 1.0), 2: run(0.8, 1.0)})}  # fmt: skip
    by_seed = paired_differences(pair)
    assert list(by_seed) == ["1"] and by_seed["1"]["auc"] == pytest.approx(0.05)


def test_bad_seeds_and_jobs_fail_before_any_training(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    for seeds in ("", "0,0", "-1", "a"):
        with pytest.raises(ValueError, match="--seeds .*distinct seeds >= 0"):
            main(["--size", "tiny", "--seeds", seeds, "--out", str(out)])
    with pytest.raises(ValueError, match="--jobs 0: give 1 or more"):
        main(["--size", "tiny", "--jobs", "0", "--out", str(out)])
    assert not out.exists()


def test_the_cold_ids_config_is_the_measured_recipe(tmp_path: Path) -> None:
    """configs/..._cold_ids.config is what bench_quality trained as recipe b4e05
    (bench/results/bench_quality_full_s18_h200.json: the EMA config, the on variant, sparse lr
    0.05, the two crosses, --batch 4096) with the item tower of recipe it64
    (bench/results/bench_quality_full_bilinear_s26_h100.json: --item-tower 64)."""
    base = ROOT / "bench" / "sweeps" / "bench_quality_full_s18_ema0.999.config"
    crosses = "cms_group_id:cate_id,cms_group_id:adgroup_id"
    measured = load_config(
        variant_config(base, "on", tmp_path, sparse_lr=0.05, crosses=crosses, item_tower="64")
    )
    measured.data_config.batch_size = 4096
    shipped = load_config(ROOT / "configs" / "multi_tower_din_taobao_dynamicemb_cold_ids.config")
    assert shipped.model_dir != measured.model_dir
    shipped.model_dir = measured.model_dir
    assert shipped == measured


def test_generated_data_has_the_columns_of_the_configs_own_features(tmp_path: Path) -> None:
    """A config with a second embedding of one input (the field-aware sweep's) trains on
    generated data: the samples are built for its features, the seed config's columns alike."""
    config = ROOT / "bench" / "sweeps" / "issue22_field_cross.config"
    own = generate("tiny", tmp_path / "own", config)
    seed = generate("tiny", tmp_path / "seed", SEED_CONFIG)
    for part in sorted((seed / "train").glob("*.parquet")):
        a, b = pq.read_table(part), pq.read_table(own / "train" / part.name)
        assert set(b.column_names) - set(a.column_names) == {"adgroup_id_x", "cms_group_id_x"}
        assert b.select(a.column_names).equals(a)
        assert b.column("adgroup_id_x").equals(b.column("adgroup_id"))
    out = tmp_path / "q.json"
    main(["--size", "tiny", *FAST, "--variants", "on", "--config", str(config), "--out", str(out)])
    _check_variant(json.loads(out.read_text())["variants"]["on"], counted=True)
