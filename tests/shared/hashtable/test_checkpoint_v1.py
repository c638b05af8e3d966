"""Checkpoints of our first layout (written by git ac1a3bb, tests/fixtures/dynrec_v1_ckpt) keep
loading, at any world size, with every row as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.config import load_config
from shared.features import ScoreStrategy, build_feature_set
from shared.hashtable.checkpoint import open_checkpoint, read_table
from shared.hashtable.embedding import DynamicEmbeddingCollection
from tests.conftest import SEED_CONFIG

from .conftest import dyn_table

ROOT = Path(__file__).parents[2] / "fixtures" / "dynrec_v1_ckpt"


def _expected(name: str) -> dict:
    return json.loads((ROOT / f"{name}_expected.json").read_text())


def _check(states: list, want: dict) -> None:
    keys = torch.cat([s.keys for s in states])
    order = torch.argsort(keys)
    assert keys[order].tolist() == want["keys"]
    for field, name in (("values", "values"), ("accumulators", "opt_values")):
        rows = torch.cat([getattr(s, field) for s in states])[order]
        assert torch.equal(
            rows, torch.tensor(np.asarray(want[name], np.float64).astype(np.float32))
        )
    assert torch.cat([s.scores for s in states])[order].tolist() == want["scores"]
    if "counter_keys" in want:
        ck = torch.cat([s.counter_keys for s in states])
        cf = torch.cat([s.counter_counts for s in states])
        o = torch.argsort(ck)
        assert ck[o].tolist() == want["counter_keys"]
        assert cf[o].tolist() == want["counter_frequencies"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_seed_tables_load_at_any_world_size(world: int) -> None:
    fs = build_feature_set(load_config(SEED_CONFIG))
    dec = DynamicEmbeddingCollection(fs.dynamic_tables, fs.fusion_groups, lr=0.001)
    want = _expected("seed")
    got: dict[str, list] = {n: [] for n in want["tables"]}
    for rank in range(world):
        report = dec.load(ROOT / "seed", rank=rank, world_size=world)
        assert report.layout == "dynrec-v1"
        for n in got:
            s = dec.table_state(n)
            assert (s.keys % world == rank).all()
            got[n].append(s)
    for n, states in got.items():
        _check(states, want["tables"][n])


def test_step_and_absolute_timestamp_scores_load_as_they_were() -> None:
    tables = [
        dyn_table("ts_emb", dim=4, strategy=ScoreStrategy.TIMESTAMP),
        dyn_table("step_emb", dim=3, threshold=2),
    ]
    dec = DynamicEmbeddingCollection(tables, {"g": ["ts_emb", "step_emb"]}, lr=0.05)
    dec.set_clock(lambda: 42)  # the first layout stored times, not ages: no clock involved
    want = _expected("mixed")
    dec.load(ROOT / "mixed", "sparse")
    for n in ("ts_emb", "step_emb"):
        _check([dec.table_state(n)], want["tables"][n])
    assert open_checkpoint(ROOT / "mixed").layout == "dynrec-v1"
    state, info = read_table(ROOT / "mixed", "ts_emb")  # tools: no config
    assert info.dim == 4 and info.strategy is ScoreStrategy.TIMESTAMP
    assert state.scores.min() > 1_700_000_000_000_000
