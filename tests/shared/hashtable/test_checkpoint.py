"""Checkpoints: dynamicemb file layout (golden), exact round trips, re-sharding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shared.hashtable.checkpoint import file_name
from shared.hashtable.embedding import DynamicEmbeddingCollection

from .conftest import dyn_table

TABLES = [dyn_table("user_id_emb", threshold=2), dyn_table("brand_emb", dim=3)]
GROUPS = {"deep": ["user_id_emb", "brand_emb"]}
FIELDS = ("keys", "values", "scores", "accumulators", "counter_keys", "counter_counts")


def _trained(steps: int = 3) -> DynamicEmbeddingCollection:
    dec = DynamicEmbeddingCollection(TABLES, GROUPS, lr=0.1, initial_accumulator_value=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        dec.set_step(step)
        out = dec(
            {t: torch.randint(0, 60, (40,), generator=g) for t in ("user_id_emb", "brand_emb")}
        )
        sum((v * torch.randn(v.shape, generator=g)).sum() for v in out.values()).backward()
    return dec


def _fresh() -> DynamicEmbeddingCollection:
    return DynamicEmbeddingCollection(TABLES, GROUPS, lr=0.1, initial_accumulator_value=0.01)


def _assert_same(a: DynamicEmbeddingCollection, b: DynamicEmbeddingCollection, keep=None):
    for t in ("user_id_emb", "brand_emb"):
        sa, sb = a.table_state(t), b.table_state(t)
        for f in FIELDS:
            x, y = getattr(sa, f), getattr(sb, f)
            if x is None:
                assert y is None
                continue
            if keep is not None:
                mask = keep(sa.keys if not f.startswith("counter") else sa.counter_keys)
                x = x[mask]
            assert torch.equal(x, y), (t, f)


def test_round_trip_is_exact(tmp_path):
    dec = _trained()
    assert dec.table_state("user_id_emb").counter_keys.numel() > 0  # counters are exercised
    path = dec.save(tmp_path, "sparse")
    assert path == tmp_path / "dynamicemb" / "sparse"
    assert [p.name for p in (tmp_path / "dynamicemb").iterdir()] == ["sparse"]  # no temp dirs
    other = _fresh()
    other.load(tmp_path, "sparse")
    _assert_same(dec, other)
    dec.save(tmp_path, "sparse")  # overwrite an existing checkpoint file by file
    other.load(tmp_path, "sparse")
    _assert_same(dec, other)


def test_world_size_2_to_1(tmp_path):
    dec = _trained()
    for rank in range(2):
        dec.save(tmp_path, "sparse", rank=rank, world_size=2)
    keys = np.fromfile(tmp_path / "dynamicemb/sparse" / file_name("brand_emb", "keys", 1, 2), "<i8")
    assert keys.size > 0 and (keys % 2 == 1).all()
    other = _fresh()
    other.load(tmp_path, "sparse", rank=0, world_size=1)
    _assert_same(dec, other)


def test_world_size_1_to_3(tmp_path):
    dec = _trained()
    dec.save(tmp_path, "sparse")
    parts = []
    for rank in range(3):
        shard = _fresh()
        shard.load(tmp_path, "sparse", rank=rank, world_size=3)
        _assert_same(dec, shard, keep=lambda k, r=rank: k % 3 == r)
        parts.append(shard.table_state("user_id_emb").keys)
    assert sorted(torch.cat(parts).tolist()) == dec.table_state("user_id_emb").keys.tolist()


def test_golden_byte_layout(tmp_path):
    dec = DynamicEmbeddingCollection(TABLES, GROUPS, lr=0.25, eps=1e-8)
    with torch.no_grad():
        dec({"brand_emb": torch.tensor([9, 2, 2]), "user_id_emb": torch.tensor([5, 5, 8])})
    d = dec.save(tmp_path, "model")
    names = sorted(p.name for p in d.iterdir())
    suffix = ".rank_0.world_size_1"
    assert names == sorted(
        [f"brand_emb_{k}{suffix}" for k in ("keys", "values", "scores", "opt_values")]
        + [f"user_id_emb_{k}{suffix}" for k in ("keys", "values", "scores", "opt_values")]
        + [f"user_id_emb_counter_{k}{suffix}" for k in ("keys", "frequencies")]
        + ["brand_emb_opt_args.json", "user_id_emb_opt_args.json"]
    )
    assert file_name("user_id_emb", "keys", 0, 1) == "user_id_emb_keys.rank_0.world_size_1"
    raw = {n: (d / n).read_bytes() for n in names}
    assert raw[f"brand_emb_keys{suffix}"] == np.array([2, 9], "<i8").tobytes()
    assert raw[f"brand_emb_scores{suffix}"] == np.array([1, 1], "<i8").tobytes()  # STEP 1
    _, values = dec.export_table("brand_emb")
    assert raw[f"brand_emb_values{suffix}"] == values.numpy().astype("<f4").tobytes()
    assert len(raw[f"brand_emb_values{suffix}"]) == 2 * 3 * 4
    assert raw[f"brand_emb_opt_values{suffix}"] == np.zeros(6, "<f4").tobytes()
    # user 5 was seen twice (threshold 2: admitted), user 8 once (still counting)
    assert raw[f"user_id_emb_keys{suffix}"] == np.array([5], "<i8").tobytes()
    assert raw[f"user_id_emb_counter_keys{suffix}"] == np.array([8], "<i8").tobytes()
    assert raw[f"user_id_emb_counter_frequencies{suffix}"] == np.array([1], "<i8").tobytes()
    args = json.loads(raw["brand_emb_opt_args.json"])
    assert args == {
        "admission_threshold": None,
        "byte_order": "little",
        "dim": 3,
        "eps": 1e-8,
        "format": "dynrec-dynamicemb/1",
        "initial_accumulator_value": 0.0,
        "key_dtype": "int64",
        "lr": 0.25,
        "max_capacity": 1024,
        "opt_values_per_row": 3,
        "optimizer": "adagrad",
        "owner": "key % world_size",
        "score_dtype": "int64",
        "score_strategy": "STEP",
        "table": "brand_emb",
        "value_dtype": "float32",
        "world_size": 1,
    }


def test_incomplete_or_mismatched_checkpoints_fail_clearly(tmp_path):
    dec = _trained(1)
    dec.save(tmp_path, "sparse", rank=0, world_size=2)  # rank 1 never saved
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\] are missing"):
        _fresh().load(tmp_path, "sparse")
    with pytest.raises(FileNotFoundError, match="no dynamic embedding checkpoint"):
        _fresh().load(tmp_path, "other")
    dec.save(tmp_path, "small")
    wrong = DynamicEmbeddingCollection(
        [dyn_table("user_id_emb", dim=5, threshold=2), dyn_table("brand_emb", dim=3)],
        GROUPS,
        lr=0.1,
    )
    with pytest.raises(ValueError, match="dim 4 but table 'user_id_emb' has dim 5"):
        wrong.load(tmp_path, "small")
    with pytest.raises(ValueError, match="rank < world_size"):
        dec.save(tmp_path, "x", rank=2, world_size=2)
