"""Fine-tune starts: TorchEasyRec's dynamicemb checkpoint and our older ones load into a model of
the seed config row for row; every way of loading nothing is an error that says what it found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.config import load_config
from shared.features import build_feature_set
from shared.hashtable.checkpoint import DEEP_COLLECTION, CheckpointError
from tests.conftest import SEED_CONFIG
from train.fine_tune import load_weights
from train.model.multi_tower_din import MultiTowerDIN

FIXTURES = Path(__file__).parents[1] / "fixtures"
TZREC = FIXTURES / "dynamicemb_ckpt"
V1 = FIXTURES / "dynrec_v1_ckpt"
NAMES = ["user_id_emb", "adgroup_id_emb"]


@pytest.fixture(scope="module")
def model() -> MultiTowerDIN:
    config = load_config(SEED_CONFIG)
    return MultiTowerDIN.from_config(config, build_feature_set(config))


def _f32(rows: list) -> torch.Tensor:
    return torch.from_numpy(np.asarray(rows, dtype=np.float64).astype(np.float32))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tzrec_checkpoint_loads_row_for_row(model: MultiTowerDIN, world: int) -> None:
    want = json.loads((TZREC / "expected.json").read_text())["tables"]
    states: dict[str, list] = {n: [] for n in NAMES}
    for rank in range(world):  # the model dir resolves to its newest model.ckpt-N
        info = load_weights(TZREC, model, rank=rank, world_size=world, tables=NAMES)
        assert info["checkpoint"] == str(TZREC / "model.ckpt-500") and info["dense"] is False
        assert info["layout"] == "dynamicemb" and info["tables"] == sorted(NAMES)
        assert info["rows"] == {n: want[n]["rows"] for n in NAMES}
        assert sorted(info["missing"]) == [
            "brand_emb",
            "campaign_id_emb",
            "cate_id_emb",
            "customer_emb",
        ]
        for n in NAMES:
            s = model.sparse.dynamic.table_state(n)
            assert (s.keys % world == rank).all() and (s.counter_keys % world == rank).all()
            states[n].append(s)
    for n in NAMES:
        keys = torch.cat([s.keys for s in states[n]])
        o = torch.argsort(keys)
        assert keys[o].tolist() == want[n]["keys"]
        assert torch.equal(torch.cat([s.values for s in states[n]])[o], _f32(want[n]["values"]))
        acc = torch.cat([s.accumulators for s in states[n]])[o]
        assert torch.equal(acc, _f32(want[n]["opt_values"]))
        assert torch.cat([s.scores for s in states[n]])[o].tolist() == want[n]["scores"]
        ck = torch.cat([s.counter_keys for s in states[n]])
        cf = torch.cat([s.counter_counts for s in states[n]])
        assert ck[torch.argsort(ck)].tolist() == want[n]["counter_keys"]
        assert cf[torch.argsort(ck)].tolist() == want[n]["counter_frequencies"]


def test_a_table_missing_from_the_checkpoint_is_an_error(model: MultiTowerDIN) -> None:
    with pytest.raises(CheckpointError) as err:
        load_weights(TZREC / "model.ckpt-500", model)
    msg = str(err.value)
    assert (
        "has no files for dynamic tables ['brand_emb', 'campaign_id_emb', 'cate_id_emb', 'customer_emb']"
        in msg
    )
    assert f"found adgroup_id_emb ({DEEP_COLLECTION}), user_id_emb ({DEEP_COLLECTION})" in msg
    assert "--fine-tune-tables" in msg


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / "model.ckpt-500"
    shutil.copytree(TZREC / "model.ckpt-500", out)
    for p in out.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return out


def test_no_matching_table_is_an_error(model: MultiTowerDIN, tmp_path: Path) -> None:
    ckpt = _copy(tmp_path)
    for p in (ckpt / "dynamicemb" / DEEP_COLLECTION).iterdir():  # another model's tables
        p.rename(
            p.with_name(
                p.name.replace("user_id_emb", "uid_emb").replace("adgroup_id_emb", "ad_emb")
            )
        )
    with pytest.raises(
        CheckpointError,
        match=r"no files for dynamic tables \['adgroup_id_emb', 'user_id_emb'\].*found ad_emb",
    ):
        load_weights(ckpt, model, tables=NAMES)
    shutil.rmtree(ckpt / "dynamicemb" / DEEP_COLLECTION)
    with pytest.raises(
        CheckpointError,
        match=r"holds no dynamic tables .*expected \['adgroup_id_emb', 'user_id_emb'\]",
    ):
        load_weights(ckpt, model, tables=NAMES)


def test_files_without_rows_are_an_error(model: MultiTowerDIN, tmp_path: Path) -> None:
    ckpt = _copy(tmp_path)
    for p in (ckpt / "dynamicemb" / DEEP_COLLECTION).glob("*.rank_*"):
        p.write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match=r"hold no rows \(0 keys, 0 admission counters\); nothing would be loaded",
    ):
        load_weights(ckpt, model, tables=NAMES)


def test_checkpoints_of_the_first_layout_keep_loading(model: MultiTowerDIN) -> None:
    info = load_weights(V1 / "seed", model)  # every dynamic table of the config is there
    assert info["layout"] == "dynrec-v1" and info["missing"] == []
    want = json.loads((V1 / "seed_expected.json").read_text())["tables"]
    for n, t in want.items():
        keys, values = model.sparse.dynamic.export_table(n)
        assert keys.tolist() == t["keys"] and torch.equal(values, _f32(t["values"]))
    info = load_weights(V1 / "init", model, rank=1, world_size=2)  # init-ckpt: its own tables
    assert info["tables"] == ["user_id_emb"]
    init = json.loads((V1 / "init_expected.json").read_text())["tables"]["user_id_emb"]
    keys, values = model.sparse.dynamic.export_table("user_id_emb")
    mine = [i for i, k in enumerate(init["keys"]) if k % 2 == 1]
    assert keys.tolist() == [init["keys"][i] for i in mine]
    assert torch.equal(values, _f32([init["values"][i] for i in mine]))
