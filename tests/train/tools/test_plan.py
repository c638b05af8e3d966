"""``python -m train.tools plan`` and the trainer's use of the same plan."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from shared.config import load_config
from shared.features import build_feature_set
from shared.hashtable.layout import RowArrays
from tests.conftest import SEED_CONFIG
from train.model.multi_tower_din import MultiTowerDIN
from train.tools.__main__ import main

USER_ID_BLOCK = 'max_capacity: 300000\ninitializer_args { mode: "NORMAL"; std_dev: 0.05 }'


def _config(tmp_path: Path, old: str, new: str) -> Path:
    text = SEED_CONFIG.read_text()
    assert old in text, old
    out = tmp_path / "c.config"
    out.write_text(text.replace(old, new, 1))
    return out


def test_plan_prints_every_table_and_the_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(SEED_CONFIG)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "budget: none (no budget)"
    assert out[1].startswith("user_id_emb: mode=HBM_ONLY cache_load_factor=1.00 (config) hbm=")
    assert out[-1].startswith("total: hbm=0.200GiB host=0.000GiB (6 dynamic tables)")


def test_plan_json_with_a_budget_plans_a_cache(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(SEED_CONFIG), "--hbm-gib", "0.1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["budget_source"] == "--hbm-gib"
    assert report["tables"]["user_id_emb"]["mode"] == "CACHING"
    assert report["tables"]["user_id_emb"]["row_arrays"] == "DEVICE"
    assert report["hbm_bytes"] <= report["budget_bytes"]
    for table in report["tables"].values():  # the parts add up to the totals
        assert sum(table["hbm_parts"].values()) == table["hbm_bytes"]
        assert sum(table["host_parts"].values()) == table["host_bytes"]
    assert report["tables"]["user_id_emb"]["hbm_parts"]["cache"] > 0


def test_plan_refuses_an_unfittable_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(SEED_CONFIG), "--hbm-gib", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the dynamic tables need 0.20 GiB of HBM HBM-only")
    assert "the biggest is user_id_emb" in err


def test_cache_load_factor_out_of_range_is_a_config_error_naming_the_field(
    tmp_path: Path,
) -> None:
    path = _config(tmp_path, USER_ID_BLOCK, USER_ID_BLOCK + "\ncache_load_factor: 1.5")
    with pytest.raises(ValueError, match=r"id_feature\(user_id\)\.dynamicemb\.cache_load_factor"):
        build_feature_set(load_config(path))


def test_the_model_logs_its_plan_and_builds_the_planned_tiers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(SEED_CONFIG)
    with caplog.at_level(logging.INFO, logger="train.model.multi_tower_din"):
        MultiTowerDIN.from_config(cfg, build_feature_set(cfg))
    plan_lines = [r.getMessage() for r in caplog.records if "table plan:" in r.getMessage()]
    assert len(plan_lines) == 7 and "user_id_emb: mode=HBM_ONLY" in plan_lines[0]

    path = _config(tmp_path, USER_ID_BLOCK, USER_ID_BLOCK + "\ncache_load_factor: 0.1")
    cfg = load_config(path)
    model = MultiTowerDIN.from_config(cfg, build_feature_set(cfg))
    assert "user_id_emb" in _names(model, "CACHING")  # its storage (fused with others) caches
    # a budget the config sets is planned (every table without its own factor cached)
    path = _config(tmp_path, "train_config {", "train_config {\ntable_hbm_budget_gib: 0.1")
    cfg = load_config(path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train.model.multi_tower_din"):
        model = MultiTowerDIN.from_config(cfg, build_feature_set(cfg))
    assert any("cache_load_factor=0.08 (planned)" in r.getMessage() for r in caplog.records)
    assert set(_names(model, "CACHING")) == {t.name for t in build_feature_set(cfg).dynamic_tables}
    assert {s.table.row_arrays for s in model.sparse.dynamic._storages} == {RowArrays.DEVICE}
    # a budget too tight for the indexes: the storages keep their row arrays on the host
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train.model.multi_tower_din"):
        model = MultiTowerDIN.from_config(cfg, build_feature_set(cfg), hbm_budget_gib=1 / 12)
    assert any("row arrays on the host)" in r.getMessage() for r in caplog.records)
    assert {s.table.row_arrays for s in model.sparse.dynamic._storages} == {RowArrays.HOST}
    model = MultiTowerDIN.from_config(cfg, build_feature_set(cfg), hbm_budget_gib=1.0)  # flag wins
    assert _names(model, "CACHING") == []


def _names(model: MultiTowerDIN, mode: str) -> list[str]:
    """The dynamic tables whose storage's payload is ``mode``."""
    return [n for s in model.sparse.dynamic._storages if s.payload.name == mode for n in s.names]
