"""Checkpoint → bundle → offline scorer: the bundle alone reproduces the trained model, in
TorchEasyRec's names with a program taking the pairs (format 3, the default) and in ours of
format 1 (program without them) alike; each checkpoint table file read once, and checkpoints of
2 and 3 ranks exported as the one-process checkpoint of the same model state."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
import torch
from safetensors import safe_open

from serve.model import LoadedModel
from serve.offline import score_table
from shared.bundle import DYNREC_NAMING, TZREC_COLLECTION, TZREC_NAMING, read_bundle, write_bundle
from shared.bundle.writer import HashPart
from shared.features import FeatureSet
from shared.fg import table_to_batch
from shared.hashtable.checkpoint import collection_paths, open_checkpoint, read_table, select_tables
from shared.hashtable.summary import checkpoint_summaries
from tests.conftest import SEED_CONFIG, write_config
from tests.train.export_checks import assert_same_model, bundle_files
from train.export import export_bundle, restore_model
from train.trainer import Trainer, TrainOptions


@pytest.fixture(scope="module")
def trained(tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export")
    _train(SEED_CONFIG, root / "model", tiny_samples)
    bundle = export_bundle(SEED_CONFIG, out_dir=root / "bundle", model_dir=root / "model")
    return root / "model", bundle


def _train(config: Path, model_dir: Path, tiny: Path) -> Trainer:
    """12 steps of 256 rows of ``config`` on the tiny samples, into ``model_dir``."""
    options = TrainOptions(
        config_path=config,
        model_dir=model_dir,
        train_path=tiny / "train",
        eval_path=tiny / "eval",
        batch_size=256,
        num_workers=0,
        max_steps=12,
        progress_bar=False,
    )
    trainer = Trainer(options)
    trainer.fit()
    return trainer


def _eval_rows(tiny: Path) -> pa.Table:
    table = ds.dataset(str(tiny / "eval"), format="parquet").to_table()
    # add rows with ids never seen in training and with empty click sequences
    extra = table.slice(0, 8)
    extra = extra.set_column(
        extra.schema.get_field_index("user_id"), "user_id", pa.array(np.arange(8) + 10**12)
    )
    extra = extra.set_column(
        extra.schema.get_field_index("adgroup_id"), "adgroup_id", pa.array(np.arange(8) + 10**12)
    )
    for name in ("click_50_seq__adgroup_id", "click_50_seq__cate_id", "click_50_seq__brand"):
        extra = extra.set_column(extra.schema.get_field_index(name), name, pa.array([""] * 8))
    return pa.concat_tables([table, extra])


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_offline_scorer_reproduces_trained_model(
    trained: tuple[Path, Path], tiny_samples: Path, tiled: bool
) -> None:
    model_dir, bundle = trained
    rows = _eval_rows(tiny_samples)
    empty = pc.equal(rows.column("click_50_seq__adgroup_id"), "").to_numpy(zero_copy_only=False)
    assert empty.sum() >= 8, "the check must include rows with empty sequences"
    model, _progress, _ckpt = restore_model(SEED_CONFIG, model_dir=model_dir)
    with torch.no_grad():
        expected = torch.sigmoid(model(table_to_batch(model.fs, rows))).numpy()
    served = score_table(LoadedModel.load(bundle, device="cpu", warmup_rounds=0), rows, tiled=tiled)
    assert served.shape == expected.shape
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)


def test_bundle_tables_through_plain_safetensors(trained: tuple[Path, Path]) -> None:
    _model_dir, bundle = trained
    b = read_bundle(bundle)
    hashmaps = {k: m for k, m in b.metadata.items() if m["is_hashmap"]}
    assert {m["hashmap_key"].split(".")[-2] for m in hashmaps.values()} == {
        t.name for t in b.feature_set.dynamic_tables
    }
    assert all(m["hashmap_key"].startswith(f"{TZREC_COLLECTION}.") for m in hashmaps.values())
    with safe_open(str(bundle / "model-000000-of-000001.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for meta in hashmaps.values():
            assert meta["hashmap_key"] in names and meta["hashmap_value"] in names
            keys, values = f.get_tensor(meta["hashmap_key"]), f.get_tensor(meta["hashmap_value"])
            assert keys.dtype == torch.int64 and values.dtype == torch.float32
            assert keys.shape[0] == values.shape[0] == meta["shape"][0]
            assert values.shape[1] == meta["dimension"] == 16
            assert len(torch.unique(keys)) == len(keys)


def test_export_contains_only_admitted_keys(trained: tuple[Path, Path]) -> None:
    model_dir, bundle = trained
    model, _p, _c = restore_model(SEED_CONFIG, model_dir=model_dir)
    b = read_bundle(bundle)
    for t in model.fs.dynamic_tables:
        keys, _ = model.sparse.dynamic.export_table(t.name)
        assert torch.equal(torch.sort(b.hash_tables[t.name][0]).values, torch.sort(keys).values)
        stats = model.sparse.dynamic.stats()[t.name]
        assert len(keys) == stats["size"]


def test_export_carries_each_rows_score_and_a_cached_server_scores_alike(
    trained: tuple[Path, Path], tiny_samples: Path
) -> None:
    """The bundle's hotness is the training table's score of each key (the seed config's LFU
    counts), and a server caching a tenth of each table scores as HBM-only."""
    from serve.tiers import TierConfig
    from shared.hashtable.checkpoint import read_table
    from train.checkpoint import latest_checkpoint

    model_dir, bundle_dir = trained
    b = read_bundle(bundle_dir)
    ckpt = latest_checkpoint(model_dir)
    assert ckpt is not None
    for t in b.feature_set.dynamic_tables:
        hot = b.hotness(t.name)
        assert hot is not None and hot.dtype == torch.int64
        state, _ = read_table(ckpt, t.name, spec=t)
        want = dict(zip(state.keys.tolist(), state.scores.tolist(), strict=True))
        got = dict(zip(b.hash_tables[t.name][0].tolist(), hot.tolist(), strict=True))
        assert got == want
        assert min(got.values()) > 0  # the seed config's LFU counts: every exported row seen
    table = _eval_rows(tiny_samples)
    want_scores = score_table(LoadedModel.load(bundle_dir, device="cpu"), table, tiled=False)
    factors = {t.name: 0.1 for t in b.feature_set.dynamic_tables}
    cached = LoadedModel.load(bundle_dir, device="cpu", tiers=TierConfig(factors))
    assert {s.mode for s in cached.table_stats() if s.is_hashmap} == {"CACHING"}
    np.testing.assert_array_equal(score_table(cached, table, tiled=False), want_scores)


def test_tzrec_named_bundle_serves_and_scores_like_ours(
    trained: tuple[Path, Path], tiny_samples: Path, tmp_path: Path
) -> None:
    """The same checkpoint exported in both namings: the serving loader gives the same tables and
    the same scores, row for row (unseen ids and empty click sequences included)."""
    model_dir, tzrec = trained
    ours = export_bundle(
        SEED_CONFIG, out_dir=tmp_path / "dynrec", model_dir=model_dir, naming=DYNREC_NAMING
    )
    assert (ours / "model-00000-of-00001.json").is_file()
    assert (tzrec / "model-000000-of-000001.json").is_file()
    a = LoadedModel.load(tzrec, device="cpu", warmup_rounds=0)
    b = LoadedModel.load(ours, device="cpu", warmup_rounds=0)
    assert (a.bundle.naming, b.bundle.naming) == (TZREC_NAMING, DYNREC_NAMING)
    # format 3: the program takes the pairs; format 1 servers predate them, so no pairs there
    assert (a.bundle.format_version, b.bundle.format_version) == (3, 1)
    assert (a.program.takes_pairs, b.program.takes_pairs) == (True, False)
    assert a.bundle.manifest["tables"] == b.bundle.manifest["tables"]
    for name, (keys, values) in a.bundle.hash_tables.items():
        assert torch.equal(keys, b.bundle.hash_tables[name][0])
        assert torch.equal(values, b.bundle.hash_tables[name][1])
    for name, w in a.bundle.dense_tables.items():
        assert torch.equal(w, b.bundle.dense_tables[name])
    rows = _eval_rows(tiny_samples)
    for tiled in (False, True):
        np.testing.assert_array_equal(
            score_table(a, rows, tiled=tiled), score_table(b, rows, tiled=tiled)
        )


@pytest.fixture(
    scope="module",
    params=[
        "cold_backoff {}",
        "cold_backoff { id_dropout: 0.4 }",
        "cold_backoff {}\ncrosses {}\nitem_tower { hidden_units: [8] }",
    ],
    ids=["backoff", "id_dropout", "crosses_item_tower"],
)
def trained_cold(
    request: pytest.FixtureRequest, tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The seed config with the cold-id backoff on (and, for ``id_dropout``, 0.4 of the warm
    user ids treated as cold in training: train.model.id_dropout; for ``crosses_item_tower``,
    every user × item feature cross, train.model.crosses, and an item-only tower,
    train.model.dense_arch.ItemTower), trained and exported (bundle format 4,
    the same either way: the program never drops)."""
    root = tmp_path_factory.mktemp("export_cold")
    backoff = request.param
    config = write_config(
        SEED_CONFIG,
        root / "cold.config",
        train=tiny_samples / "train",
        eval_=tiny_samples / "eval",
        replace={"final { hidden_units: [64] }": f"final {{ hidden_units: [64] }}\n{backoff}"},
    )
    trainer = _train(config, root / "model", tiny_samples)
    stats = trainer.model.sparse.dynamic.stats()
    assert stats["user_id_emb"]["misses"] > 0, "tiny data must have cold users in training"
    return config, export_bundle(config, out_dir=root / "bundle", model_dir=root / "model")


def test_exported_backoff_scores_as_trained(
    trained_cold: tuple[Path, Path], tiny_samples: Path
) -> None:
    """The backoff learned something, travels in the format 4 program, and the bundle alone
    scores the rows (unseen ids among them: cold, backed off) as the trained model does."""
    config, bundle = trained_cold
    assert read_bundle(bundle).format_version == 4
    rows = _eval_rows(tiny_samples)
    model, _progress, _ckpt = restore_model(config, model_dir=bundle.parent / "model")
    assert model.dense.backoff is not None
    assert (model.sparse.id_dropout is not None) == ("id_dropout" in config.read_text())
    if model.dense.crosses is not None:  # learned away from its initial 1s
        assert "crosses" in config.read_text() and (model.dense.crosses.weight != 1).all()
    if model.dense.item_tower is not None:  # learned away from its initial 0s
        assert "item_tower" in config.read_text()
        assert model.dense.item_tower.output.weight.abs().sum() > 0
    assert any(p.abs().sum() > 0 for p in model.dense.backoff.parameters())
    with torch.no_grad():
        expected = torch.sigmoid(model(table_to_batch(model.fs, rows))).numpy()
    served = score_table(LoadedModel.load(bundle, device="cpu", warmup_rounds=0), rows, tiled=True)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- table files: read once, any W


def _tables_read_thrice(ckpt: Path, fs: FeatureSet) -> tuple[dict[str, list[HashPart]], dict]:
    """The hash tables and summaries as export_bundle took them before it read each file once:
    each rank's (keys, values) from ``reader.parts``, their scores matched by key from a second
    read (``read_table``), the summaries from a third (``checkpoint_summaries``)."""
    reader = open_checkpoint(ckpt)
    chosen, _ = select_tables(reader, [t.name for t in fs.dynamic_tables], collection_paths(fs))
    tables: dict[str, list[HashPart]] = {}
    for t in fs.dynamic_tables:
        state, _ = read_table(ckpt, t.name, spec=t)
        score = dict(zip(state.keys.tolist(), state.scores.tolist(), strict=True))
        tables[t.name] = [
            (k, v, torch.tensor([score[x] for x in k.tolist()], dtype=torch.int64))
            for k, v in reader.parts(chosen[t.name], t.dim)
        ]
    return tables, checkpoint_summaries(ckpt)


@pytest.mark.parametrize("world_size", [1, 2])
def test_full_export_writes_the_bytes_of_three_reads(
    dyn_ranks: dict[int, Path], dyn_rank_bundles: dict[int, Path], world_size: int, tmp_path: Path
) -> None:
    """The bundle of one read per file (the session's cold export of the checkpoint) is byte for
    byte the bundle of the former three (its tables and summaries written with the same dense
    part, program and version)."""
    ckpt, bundle = dyn_ranks[world_size], dyn_rank_bundles[world_size]
    b = read_bundle(bundle)
    tables, summaries = _tables_read_thrice(ckpt, b.feature_set)
    assert all(len(parts) == world_size for parts in tables.values())
    before = write_bundle(
        tmp_path / "thrice",
        dense_tables=b.dense_tables,
        hash_tables=tables,
        feature_set=b.feature_set,
        dense_program_path=bundle / "dense.pt2",
        config_digest=b.config_digest,
        version=b.version,
        extra={"table_summaries": summaries},
        naming=TZREC_NAMING.for_tables(collection_paths(b.feature_set)),
    )
    assert bundle_files(bundle) == bundle_files(before)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[Path]:
    """Every raw array file read from now on (``read_array``, the one reader of table files
    in every layout), counted by path; the reads still happen."""
    from shared.hashtable import checkpoint_dynamicemb, checkpoint_io, checkpoint_v1

    counts: Counter[Path] = Counter()
    real = checkpoint_io.read_array

    def counted(path: Path, dtype: str) -> torch.Tensor:
        counts[Path(path)] += 1
        return real(path, dtype)

    for module in (checkpoint_io, checkpoint_dynamicemb, checkpoint_v1):
        monkeypatch.setattr(module, "read_array", counted)
    return counts


@pytest.mark.parametrize("world_size", [1, 3])
def test_full_export_reads_each_table_file_once(
    dyn_ranks: dict[int, Path], world_size: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every file of every rank (keys, values, scores, optimizer states, admission counters)
    read exactly once for the rows, their scores and the summaries."""
    ckpt = dyn_ranks[world_size]
    files = {p for p in (ckpt / "dynamicemb").rglob("*.rank_*") if p.is_file()}
    assert len(files) == 6 * 6 * world_size  # 6 tables, 6 kinds (counters too), W ranks
    counts = _count_reads(monkeypatch)
    export_bundle(SEED_CONFIG, out_dir=tmp_path / "bundle", checkpoint=ckpt)
    assert dict(counts) == dict.fromkeys(files, 1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_export_the_one_process_bundle(
    dyn_rank_bundles: dict[int, Path], world_size: int
) -> None:
    """W ranks' checkpoint of a model state exports what the one-process checkpoint of it
    exports: W parts per table (``part_R_W``) that a load joins into the same rows and scores
    by key, the same dense part and program bytes, summaries but for the files' world size
    (the session's cold exports of each checkpoint)."""
    one, many = (read_bundle(dyn_rank_bundles[w]) for w in (1, world_size))
    assert_same_model(one, many, world_size)
