"""Checkpoints: dynamicemb's files exactly (golden bytes, names, opt_args), exact round trips,
re-sharding, TIMESTAMP ages, the reader seam, and every refusal (messages asserted).

The golden dump of the real dynamicemb code (``tests/fixtures/dynamicemb_ckpt``) is read in
``test_checkpoint_dynamicemb.py``; checkpoints of our first layout in ``test_checkpoint_v1.py``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable.checkpoint import (
    DEEP_COLLECTION,
    META_FILE,
    CheckpointError,
    open_checkpoint,
    read_table,
)
from shared.hashtable.checkpoint_dynamicemb import emb_file
from shared.hashtable.embedding import DynamicEmbeddingCollection

from .conftest import dyn_table

TABLES = [dyn_table("user_id_emb", threshold=2), dyn_table("brand_emb", dim=3)]
GROUPS = {"deep": ["user_id_emb", "brand_emb"]}
FIELDS = ("keys", "values", "scores", "accumulators", "counter_keys", "counter_counts")
FIXTURE = Path(__file__).parents[2] / "fixtures" / "dynamicemb_ckpt" / "model.ckpt-500"


def _trained(steps: int = 3, tables=TABLES, clock=None) -> DynamicEmbeddingCollection:
    dec = DynamicEmbeddingCollection(
        tables, GROUPS, lr=0.1, initial_accumulator_value=0.01, clock=clock
    )
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        dec.set_step(step)
        out = dec({t.name: torch.randint(0, 60, (40,), generator=g) for t in tables})
        sum((v * torch.randn(v.shape, generator=g)).sum() for v in out.values()).backward()
    return dec


def _fresh(tables=TABLES, clock=None) -> DynamicEmbeddingCollection:
    return DynamicEmbeddingCollection(
        tables, GROUPS, lr=0.1, initial_accumulator_value=0.01, clock=clock
    )


def _tzrec() -> DynamicEmbeddingCollection:
    return DynamicEmbeddingCollection(
        TABLES, GROUPS, lr=0.1, initial_accumulator_value=0.01, id_mode="tzrec"
    )


def _assert_same(a: DynamicEmbeddingCollection, b: DynamicEmbeddingCollection, keep=None):
    for t in a.tables:
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
    assert path == tmp_path / "dynamicemb"
    assert [p.name for p in path.iterdir()] == ["sparse"]  # no temp dirs left
    other = _fresh()
    report = other.load(tmp_path, "sparse")
    assert report.layout == "dynamicemb" and report.tables["user_id_emb"].collection == "sparse"
    _assert_same(dec, other)
    dec.save(tmp_path, "sparse")  # overwrite an existing checkpoint file by file
    other.load(tmp_path, "sparse")
    _assert_same(dec, other)


def test_world_size_2_to_1(tmp_path):
    dec = _trained()
    for rank in range(2):
        dec.save(tmp_path, "sparse", rank=rank, world_size=2)
    d = tmp_path / "dynamicemb" / "sparse"
    keys = np.fromfile(d / emb_file("brand_emb", "keys", 1, 2), "<i8")
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
        report = shard.load(tmp_path, "sparse", rank=rank, world_size=3)
        _assert_same(dec, shard, keep=lambda k, r=rank: k % 3 == r)
        parts.append(shard.table_state("user_id_emb").keys)
        assert report.tables["user_id_emb"].rows_loaded == parts[-1].numel()
    assert sorted(torch.cat(parts).tolist()) == dec.table_state("user_id_emb").keys.tolist()


def test_golden_byte_layout(tmp_path):
    dec = DynamicEmbeddingCollection(TABLES, GROUPS, lr=0.25, eps=1e-8)
    with torch.no_grad():
        dec({"brand_emb": torch.tensor([9, 2, 2]), "user_id_emb": torch.tensor([5, 5, 8])})
    dec.save(tmp_path, {"user_id_emb": DEEP_COLLECTION, "brand_emb": DEEP_COLLECTION})
    d = tmp_path / "dynamicemb" / DEEP_COLLECTION
    names = sorted(p.name for p in d.iterdir())
    suffix = ".rank_0.world_size_1"
    assert names == sorted(
        [f"brand_emb_emb_{k}{suffix}" for k in ("keys", "values", "scores", "opt_values")]
        + [f"user_id_emb_emb_{k}{suffix}" for k in ("keys", "values", "scores", "opt_values")]
        + [f"user_id_emb_counter_{k}{suffix}" for k in ("keys", "frequencies")]
        + ["brand_emb_opt_args.json", "user_id_emb_opt_args.json"]
    )
    raw = {n: (d / n).read_bytes() for n in names}
    assert raw[f"brand_emb_emb_keys{suffix}"] == np.array([2, 9], "<i8").tobytes()
    assert raw[f"brand_emb_emb_scores{suffix}"] == np.array([1, 1], "<i8").tobytes()  # STEP 1
    _, values = dec.export_table("brand_emb")
    assert raw[f"brand_emb_emb_values{suffix}"] == values.numpy().astype("<f4").tobytes()
    assert len(raw[f"brand_emb_emb_values{suffix}"]) == 2 * 3 * 4
    assert raw[f"brand_emb_emb_opt_values{suffix}"] == np.zeros(6, "<f4").tobytes()
    # user 5 was seen twice (threshold 2: admitted), user 8 once (still counting)
    assert raw[f"user_id_emb_emb_keys{suffix}"] == np.array([5], "<i8").tobytes()
    assert raw[f"user_id_emb_counter_keys{suffix}"] == np.array([8], "<i8").tobytes()
    assert raw[f"user_id_emb_counter_frequencies{suffix}"] == np.array([1], "<i8").tobytes()
    text = raw["brand_emb_opt_args.json"].decode()
    args = json.loads(text)
    assert text == json.dumps(args, indent=4)  # as dynamicemb's save_to_json writes it
    assert list(args.items()) == [
        ("opt_type", "exact_adagrad"),
        ("lr", 0.25),
        ("eps", 1e-8),
        ("initial_accumulator_value", 0.0),
        ("evict_strategy", "EvictStrategy.KCustomized"),
        ("dist_type", "roundrobin"),
        ("step_score", 1),  # STEP: the step (one training forward without set_step)
    ]
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["format"] == "dynrec-ckpt/2"
    assert meta["id_mode"] == "dynrec"  # the collection's default
    assert meta["tables"]["user_id_emb"] == {
        "collection": DEEP_COLLECTION,
        "dim": 4,
        "score_strategy": "STEP",
        "max_capacity": 1024,
        "admission_threshold": 2,
    }


def test_opt_args_per_strategy_and_rank0_only(tmp_path):
    tables = [
        dyn_table("user_id_emb", strategy=ScoreStrategy.LFU, threshold=2),
        dyn_table("brand_emb", dim=3, strategy=ScoreStrategy.TIMESTAMP),
    ]
    dec = _trained(2, tables, clock=lambda: 5_000_000)
    for rank in range(2):
        dec.save(tmp_path, "c", rank=rank, world_size=2)
    d = tmp_path / "dynamicemb" / "c"
    assert sorted(p.name for p in d.glob("*.json")) == [
        "brand_emb_opt_args.json",
        "user_id_emb_opt_args.json",
    ]
    lfu = json.loads((d / "user_id_emb_opt_args.json").read_text())
    ts = json.loads((d / "brand_emb_opt_args.json").read_text())
    assert (lfu["evict_strategy"], lfu["step_score"]) == ("EvictStrategy.KLfu", 1)
    assert (ts["evict_strategy"], ts["step_score"]) == ("EvictStrategy.KLru", 0)


def test_opt_args_record_each_tables_own_rate(tmp_path):
    dec = DynamicEmbeddingCollection(TABLES, GROUPS, lr=0.1, lr_scales={"brand_emb": 2.5})
    dec.save(tmp_path, "c")
    d = tmp_path / "dynamicemb" / "c"
    brand = json.loads((d / "brand_emb_opt_args.json").read_text())
    user = json.loads((d / "user_id_emb_opt_args.json").read_text())
    assert (brand["lr"], user["lr"]) == (pytest.approx(0.25), pytest.approx(0.1))


def test_timestamp_scores_are_ages_restored_at_load_time(tmp_path):
    tables = [dyn_table("user_id_emb", strategy=ScoreStrategy.TIMESTAMP), TABLES[1]]
    t = {"now": 1_000_000}
    dec = _trained(1, tables, clock=lambda: t["now"])  # every row used at t = 1 s
    t["now"] = 1_250_000  # dumped 0.25 s later
    dec.save(tmp_path, "c")
    d = tmp_path / "dynamicemb" / "c"
    ages = np.fromfile(d / emb_file("user_id_emb", "scores", 0, 1), "<i8")
    assert ages.size > 0 and (ages == 250_000_000).all()  # nanoseconds, as dynamicemb's timer
    t["now"] = 9_000_000  # loaded at t = 9 s: same age, so used at 8.75 s
    other = _fresh(tables, clock=lambda: t["now"])
    other.load(tmp_path, "c")
    assert (other.table_state("user_id_emb").scores == 8_750_000).all()
    assert torch.equal(other.table_state("brand_emb").scores, dec.table_state("brand_emb").scores)


def _read_by_the_rules(directory: Path, table: str, dim: int) -> dict[str, dict[int, object]]:
    """A reader written from tests/fixtures/dynamicemb_ckpt/README.md alone (not our loader)."""
    keys_files = sorted(directory.glob(f"{table}_emb_keys.rank_*.world_size_*"))
    world = int(keys_files[0].name.split("world_size_")[1])
    assert len(keys_files) == world
    rows: dict[int, object] = {}
    counters: dict[int, object] = {}
    for r in range(world):
        sfx = f".rank_{r}.world_size_{world}"
        keys = np.fromfile(directory / f"{table}_emb_keys{sfx}", "<i8")
        values = np.fromfile(directory / f"{table}_emb_values{sfx}", "<f4").reshape(-1, dim)
        scores = np.fromfile(directory / f"{table}_emb_scores{sfx}", "<i8")
        opt = np.fromfile(directory / f"{table}_emb_opt_values{sfx}", "<f4").reshape(-1, dim)
        assert len(keys) == len(values) == len(scores) == len(opt) and (keys % world == r).all()
        for i, k in enumerate(keys.tolist()):
            rows[k] = (values[i].tobytes(), int(scores[i]), opt[i].tobytes())
        ck = np.fromfile(directory / f"{table}_counter_keys{sfx}", "<i8")
        cf = np.fromfile(directory / f"{table}_counter_frequencies{sfx}", "<i8")
        counters.update(zip(ck.tolist(), cf.tolist(), strict=True))
    return {"rows": rows, "counters": counters}


def _shape(directory: Path, table: str) -> set[str]:
    """File names with the table, rank and world size abstracted."""
    out = set()
    for p in directory.iterdir():
        if p.name.startswith(f"{table}_"):
            name = "{T}" + p.name[len(table) :]
            out.add(re.sub(r"\.rank_\d+\.world_size_\d+$", ".rank_{R}.world_size_{W}", name))
    return out


def test_what_we_write_reads_back_by_the_format_rules(tmp_path):
    tables = [
        dyn_table("user_id_emb", dim=16, strategy=ScoreStrategy.LFU, threshold=2),
        dyn_table("adgroup_id_emb", dim=16, strategy=ScoreStrategy.LFU, threshold=2),
    ]
    groups = {"deep": ["user_id_emb", "adgroup_id_emb"]}
    dec = DynamicEmbeddingCollection(tables, groups, lr=0.001, eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        big = torch.tensor([2**33 + 5, 2**33 + 8])  # above int32
        out = dec(
            {t.name: torch.cat([torch.randint(0, 50, (60,), generator=g), big]) for t in tables}
        )
        sum((v * torch.randn(v.shape, generator=g)).sum() for v in out.values()).backward()
    for rank in range(2):
        dec.save(tmp_path, DEEP_COLLECTION, rank=rank, world_size=2)
    ours = tmp_path / "dynamicemb" / DEEP_COLLECTION
    theirs = FIXTURE / "dynamicemb" / DEEP_COLLECTION
    for t in tables:
        got = _read_by_the_rules(ours, t.name, 16)
        s = dec.table_state(t.name)
        assert got["rows"] == {
            int(k): (
                s.values[i].numpy().tobytes(),
                int(s.scores[i]),
                s.accumulators[i].numpy().tobytes(),
            )
            for i, k in enumerate(s.keys.tolist())
        }
        assert got["counters"] == dict(
            zip(s.counter_keys.tolist(), s.counter_counts.tolist(), strict=True)
        )
        assert any(k > 2**32 for k in got["rows"])
        assert _shape(ours, t.name) == _shape(theirs, t.name)
        mine = json.loads((ours / f"{t.name}_opt_args.json").read_text())
        real = json.loads((theirs / f"{t.name}_opt_args.json").read_text())
        assert list(mine) == list(real) and mine == real  # lr 0.001, eps 1e-8, KLfu, step 1


def test_reader_is_chosen_once_by_what_is_on_disk(tmp_path):
    assert open_checkpoint(FIXTURE).layout == "dynamicemb"
    v1 = Path(__file__).parents[2] / "fixtures" / "dynrec_v1_ckpt" / "seed"
    assert open_checkpoint(v1).layout == "dynrec-v1"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert open_checkpoint(empty).tables() == []
    (empty / META_FILE).write_text(json.dumps({"format": "dynrec-ckpt/9"}))
    with pytest.raises(CheckpointError, match=r"format 'dynrec-ckpt/9'.*newer dynrec, upgrade"):
        open_checkpoint(empty)
    mixed = tmp_path / "mixed"
    import shutil

    shutil.copytree(v1, mixed)
    shutil.copytree(FIXTURE / "dynamicemb" / DEEP_COLLECTION, mixed / "dynamicemb" / "x")
    with pytest.raises(CheckpointError, match=r"mixes dynrec's first checkpoint layout"):
        open_checkpoint(mixed)


def test_refusals_name_what_was_expected_and_found(tmp_path):
    dec = _trained(1)
    dec.save(tmp_path / "a", "sparse", rank=0, world_size=2)  # rank 1 never saved
    with pytest.raises(CheckpointError, match=r"ranks \[1\] are missing"):
        _fresh().load(tmp_path / "a", "sparse")
    with pytest.raises(CheckpointError, match=r"holds no dynamic tables.*expected"):
        _fresh().load(tmp_path / "nothing", "sparse")
    dec.save(tmp_path / "b", "sparse")
    wrong = DynamicEmbeddingCollection(
        [dyn_table("user_id_emb", dim=5, threshold=2), dyn_table("brand_emb", dim=3)],
        GROUPS,
        lr=0.1,
    )
    with pytest.raises(CheckpointError, match="expected 5 per key.*another embedding_dim"):
        wrong.load(tmp_path / "b", "sparse")
    more = DynamicEmbeddingCollection(
        [*TABLES, dyn_table("cate_id_emb")],
        {"deep": ["user_id_emb", "brand_emb", "cate_id_emb"]},
        lr=0.1,
    )
    with pytest.raises(CheckpointError, match=r"no files for dynamic tables \['cate_id_emb'\]"):
        more.load(tmp_path / "b", "sparse")
    more.load(tmp_path / "b", "sparse", tables=["user_id_emb", "brand_emb"])  # named: fine
    with pytest.raises(CheckpointError, match=r"holds tables \['brand_emb'\] that this config"):
        DynamicEmbeddingCollection([TABLES[0]], {}, lr=0.1).load(tmp_path / "b", "sparse")
    with pytest.raises(ValueError, match="rank < world_size"):
        dec.save(tmp_path, "x", rank=2, world_size=2)
    empty = _fresh()
    empty.save(tmp_path / "c", "sparse")  # tables without a single row
    with pytest.raises(CheckpointError, match=r"hold no rows \(0 keys, 0 admission counters\)"):
        _fresh().load(tmp_path / "c", "sparse")
    strategy = [dyn_table("user_id_emb", threshold=2, strategy=ScoreStrategy.TIMESTAMP), TABLES[1]]
    with pytest.raises(CheckpointError, match=r"'EvictStrategy.KCustomized'.*TIMESTAMP.*KLru"):
        _fresh(strategy).load(tmp_path / "b", "sparse")
    args = tmp_path / "b" / "dynamicemb" / "sparse" / "brand_emb_opt_args.json"
    args.write_text(args.read_text().replace('"roundrobin"', '"continuous"'))
    with pytest.raises(
        CheckpointError, match=r"dist_type 'continuous', but dynrec shards rows 'roundrobin'"
    ):
        _fresh().load(tmp_path / "b", "sparse")
    args.unlink()
    with pytest.raises(CheckpointError, match=r"brand_emb_opt_args.json is missing.*rank 0"):
        _fresh().load(tmp_path / "b", "sparse")


def test_id_mode_is_saved_and_another_refused(tmp_path):
    dec = _trained()
    tz = _tzrec()
    tz.load_table_state("user_id_emb", dec.table_state("user_id_emb"))
    tz.load_table_state("brand_emb", dec.table_state("brand_emb"))
    tz.save(tmp_path / "tz", "sparse")
    assert json.loads((tmp_path / "tz" / META_FILE).read_text())["id_mode"] == "tzrec"
    with pytest.raises(
        CheckpointError,
        match=r"keys were made in id mode TZREC \(dynamic_tables.json id_mode 'tzrec'; absent: 'dynrec'\), this "
        r"config's are made in DYNREC; no key would be found\. Set "
        r"data_config.dynrec_id_mode: TZREC",
    ):
        _fresh().load(tmp_path / "tz", "sparse")
    _tzrec().load(tmp_path / "tz", "sparse")
    dec.save(tmp_path / "dyn", "sparse")
    with pytest.raises(CheckpointError, match=r"id mode DYNREC.*dynrec_id_mode: DYNREC"):
        _tzrec().load(tmp_path / "dyn", "sparse")
    with pytest.raises(ValueError, match=r"id_mode 'TZREC' is not one of \['dynrec', 'tzrec'\]"):
        DynamicEmbeddingCollection(TABLES, GROUPS, lr=0.1, id_mode="TZREC")


def test_meta_without_id_mode_is_dynrec(tmp_path):
    dec = _trained()
    dec.save(tmp_path, "sparse")
    path = tmp_path / META_FILE
    meta = json.loads(path.read_text())
    del meta["id_mode"]  # written before the id mode was recorded
    path.write_text(json.dumps(meta))
    other = _fresh()
    other.load(tmp_path, "sparse")
    _assert_same(dec, other)
    with pytest.raises(CheckpointError, match=r"id mode DYNREC \(dynamic_tables.json id_mode"):
        _tzrec().load(tmp_path, "sparse")


def test_checkpoint_without_meta_is_not_checked_but_dynrec_warned(tmp_path, caplog):
    dec = _trained()
    dec.save(tmp_path, "sparse")
    (tmp_path / META_FILE).unlink()  # as TorchEasyRec's / dynamicemb's own checkpoints
    with caplog.at_level(logging.WARNING, logger="shared.hashtable.checkpoint"):
        _fresh().load(tmp_path, "sparse")
    warned = [r.getMessage() for r in caplog.records if "id mode" in r.getMessage()]
    assert len(warned) == 1  # once per load, not per table
    assert "TZREC id mode" in warned[0] and "data_config.dynrec_id_mode: TZREC" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shared.hashtable.checkpoint"):
        _tzrec().load(tmp_path, "sparse")
    assert not [r for r in caplog.records if "id mode" in r.getMessage()]


def test_read_table_without_a_config(tmp_path):
    dec = _trained()
    dec.save(tmp_path, "sparse")
    state, info = read_table(tmp_path, "brand_emb")
    assert (info.dim, info.strategy, info.max_capacity) == (3, ScoreStrategy.STEP, 1024)
    assert torch.equal(state.values, dec.table_state("brand_emb").values)
    with pytest.raises(CheckpointError, match=r"has no table 'nope'; found brand_emb \(sparse\)"):
        read_table(tmp_path, "nope")
