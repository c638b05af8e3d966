"""The export bundle: round trip, golden metadata/manifest (ours of format 1, TorchEasyRec's RTP
export names of format 2), plain-safetensors access, refusals."""

import calendar
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shared.bundle.writer as writer
from shared.bundle import (
    DYNREC_NAMING,
    TZREC_COLLECTION,
    TZREC_NAMING,
    BundleError,
    TzrecNaming,
    load_dense_program,
    read_bundle,
    read_manifest,
    write_bundle,
)
from shared.bundle.naming import PAIR_PROGRAM_FORMAT
from shared.config import config_digest, parse_config
from shared.dense_inputs import PAIR_INPUT_NAMES
from shared.features import (
    CONSTANT_ZERO,
    DynamicTableSpec,
    FeatureKind,
    FeatureSet,
    FeatureSpec,
    GroupSpec,
    GroupType,
    IdTransform,
    ScoreStrategy,
    Side,
    TableSpec,
    feature_set_from_text,
)
from shared.fg_spec import feature_set_to_dict

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "dynamicemb_ckpt"  # a real tzrec checkpoint + export
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
SEED_FS = feature_set_from_text(SEED_TEXT, "seed")
DIGEST = config_digest(parse_config(SEED_TEXT))
SHARD = "model-000000-of-000001"  # the default naming: TorchEasyRec's
C = TZREC_COLLECTION


def V(table: str, rank: int, world: int = 2) -> str:
    """The values tensor name of a part in the default naming."""
    return TZREC_NAMING.values_name(table, rank, world)


def K(table: str, rank: int, world: int = 2) -> str:
    return TZREC_NAMING.keys_name(table, rank, world)


def W(table: str) -> str:
    return TZREC_NAMING.weight_name(table)


HashTables = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]


class Toy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, 4] → [B]
        return (x * 2.0).sum(dim=1)


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny torch.export program standing in for the dense part."""
    path = tmp_path_factory.mktemp("program") / "dense.pt2"
    torch.export.save(torch.export.export(Toy(), (torch.ones(3, 4),)), path)
    return path


class PairToy(torch.nn.Module):
    """Takes the inputs of a format 3 dense program (shared.dense_inputs.PAIR_INPUT_NAMES)."""

    def forward(
        self,
        user_deep: torch.Tensor,
        item_deep: torch.Tensor,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor,
        pair_segment: torch.Tensor,
        pair_element: torch.Tensor,
    ) -> torch.Tensor:  # [B]
        return item_deep.sum(1) + user_deep[user_index].sum(1) + query.sum(1)


@pytest.fixture(scope="module")
def pair_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny program with the pair inputs: it makes a tzrec bundle format 3."""
    path = tmp_path_factory.mktemp("pair_program") / "dense.pt2"
    kwargs = {n: torch.ones(3, 2) for n in PAIR_INPUT_NAMES}
    kwargs.update({n: torch.zeros(3, dtype=torch.int64) for n in PAIR_INPUT_NAMES[4:]})
    torch.export.save(torch.export.export(PairToy(), (), kwargs=kwargs), path)
    return path


def _tables(fs: FeatureSet, *, keys_per_table: int = 40, world: int = 2) -> tuple[dict, HashTables]:
    g = torch.Generator().manual_seed(0)
    dense = {t.name: torch.randn(t.num_rows, t.dim, generator=g) for t in fs.dense_tables}
    hashes: HashTables = {}
    for t in fs.dynamic_tables:
        keys = torch.randperm(1000, generator=g)[:keys_per_table].to(torch.int64) * 7919
        owner = keys % world  # rank R owns key mod W, as in training
        hashes[t.name] = [
            (keys[owner == r], torch.randn(int((owner == r).sum()), t.dim, generator=g))
            for r in range(world)
        ]
    return dense, hashes


def _write(out: Path, program: Path, fs: FeatureSet = SEED_FS, **kw: Any) -> Path:
    dense, hashes = _tables(fs)
    args: dict[str, Any] = {
        "dense_tables": dense,
        "hash_tables": hashes,
        "feature_set": fs,
        "dense_program_path": program,
        "config_digest": DIGEST,
        "version": "v1",
    }
    return write_bundle(out, **{**args, **kw})


# --------------------------------------------------------------------------- round trip


def test_round_trip(tmp_path: Path, program: Path) -> None:
    dense, hashes = _tables(SEED_FS, world=2)
    out = write_bundle(
        tmp_path / "bundle",
        dense_tables=dense,
        hash_tables=hashes,
        feature_set=SEED_FS,
        dense_program_path=program,
        config_digest=DIGEST,
        version="step-42",
        extra={"step": 42, "auc": 0.61},
    )
    b = read_bundle(out)
    assert b.feature_set == SEED_FS
    assert (b.version, b.config_digest, b.manifest["extra"]) == (
        "step-42",
        DIGEST,
        {"step": 42, "auc": 0.61},
    )
    assert list(b.dense_tables) == [t.name for t in SEED_FS.dense_tables]
    for name, w in dense.items():
        assert torch.equal(b.dense_tables[name], w)
    assert list(b.hash_tables) == [t.name for t in SEED_FS.dynamic_tables]
    for name, parts in hashes.items():
        keys, values = b.hash_tables[name]
        assert torch.equal(keys, torch.cat([k for k, _ in parts]))  # parts in rank order
        assert torch.equal(values, torch.cat([v for _, v in parts]))
    on_disk = json.loads((out / f"{SHARD}.json").read_text())
    assert b.metadata == on_disk
    assert b.dense_program_path == out / "dense.pt2"
    assert (out / "dense.pt2").read_bytes() == program.read_bytes()
    x = torch.randn(3, 4)
    assert torch.equal(load_dense_program(b)(x), Toy()(x))
    assert b.read_seconds > 0
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # no temp dir left behind


def test_sharding_keeps_names_and_round_trips(tmp_path: Path, program: Path) -> None:
    dense, hashes = _tables(SEED_FS, keys_per_table=200, world=2)
    out = write_bundle(
        tmp_path / "b",
        dense_tables=dense,
        hash_tables=hashes,
        feature_set=SEED_FS,
        dense_program_path=program,
        config_digest=DIGEST,
        max_shard_bytes=8_000,
    )
    shards = read_manifest(out)["shards"]
    count = len(shards)
    assert count > 2
    assert shards == [f"model-{i:06d}-of-{count:06d}" for i in range(count)]
    b = read_bundle(out)
    for stem in shards:  # every tensor of a shard's JSON lives in that shard
        with safe_open(out / f"{stem}.safetensors", "pt") as f:
            names = set(f.keys())
        for entry in json.loads((out / f"{stem}.json").read_text()).values():
            assert entry["name"] in names
            assert not entry["is_hashmap"] or entry["hashmap_key"] in names
    for name, parts in hashes.items():
        assert torch.equal(b.hash_tables[name][0], torch.cat([k for k, _ in parts]))
    for name, w in dense.items():
        assert torch.equal(b.dense_tables[name], w)


def test_plain_safetensors_api_finds_every_hashmap(tmp_path: Path, program: Path) -> None:
    """What an RTP-style runtime does: JSON + safe_open, no code of ours."""
    out = _write(tmp_path / "b", program)
    meta = json.loads((out / f"{SHARD}.json").read_text())
    seen_tables = set()
    with safe_open(out / f"{SHARD}.safetensors", framework="pt") as f:
        names = set(f.keys())
        for entry in meta.values():
            values = f.get_tensor(entry["name"])
            assert values.dtype == torch.float32 and entry["dtype"] == "float32"
            assert list(values.shape) == entry["shape"]
            assert entry["dimension"] == values.shape[1] == 16
            if entry["is_hashmap"]:
                assert entry["hashmap_value"] == entry["name"]
                assert entry["hashmap_key_dtype"] == "int64"
                keys = f.get_tensor(entry["hashmap_key"])
                assert keys.dtype == torch.int64
                assert list(keys.shape) == [entry["shape"][0]]
                names -= {entry["hashmap_key"]}
            names -= {entry["name"]}
            seen_tables.add(entry["name"].split(".")[-2])  # how tzrec's reader takes the table
    assert names == set()  # every tensor is described
    assert seen_tables == set(SEED_FS.tables)
    hashmaps = [e for e in meta.values() if e["is_hashmap"]]
    assert len(hashmaps) == 2 * len(SEED_FS.dynamic_tables)  # two parts each


# --------------------------------------------------------------------------- golden


def _dynamic(capacity: int, strategy: ScoreStrategy) -> DynamicTableSpec:
    return DynamicTableSpec(
        max_capacity=capacity,
        init_capacity=capacity,
        bucket_capacity=128,
        score_strategy=strategy,
        initializer=CONSTANT_ZERO,
        eval_initializer=CONSTANT_ZERO,
        admission=None,
        init_table=None,
    )


def _golden_fs() -> FeatureSet:
    dyn = _dynamic(10, ScoreStrategy.STEP)
    tables = {
        "user_id_emb": TableSpec("user_id_emb", 2, None, dyn, "sum"),
        "pid_emb": TableSpec("pid_emb", 2, 3, None, "sum"),
    }
    features = {
        "user_id": FeatureSpec(
            "user_id", FeatureKind.ID, Side.USER, "user_id", "user_id_emb", IdTransform.DYNAMIC
        ),
        "pid": FeatureSpec(
            "pid", FeatureKind.ID, Side.CONTEXT, "pid", "pid_emb", IdTransform.HASH, None, 3
        ),
    }
    groups = {"deep": GroupSpec("deep", GroupType.DEEP, ("user_id", "pid"))}
    return FeatureSet(features, tables, groups, {"deep": ("user_id_emb",)})


def _golden_entry(name: str, rows: int, key: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "dense": False, "dimension": 2, "dtype": "float32"}
    entry |= {"memory": rows * 2 * 4, "shape": [rows, 2]}
    if key is None:
        return entry | {"is_hashmap": False}
    return entry | {
        "hashmap_value": name,
        "hashmap_key": key,
        "hashmap_key_dtype": "int64",
        "is_hashmap": True,
    }


# today's bundles (format 1): what this project wrote before TorchEasyRec's names
GOLDEN_FORMAT_1_METADATA = {
    "user_id_emb.values/part_0_2": {
        "name": "user_id_emb.values/part_0_2",
        "dense": False,
        "dimension": 2,
        "dtype": "float32",
        "memory": 16,
        "shape": [2, 2],
        "hashmap_value": "user_id_emb.values/part_0_2",
        "hashmap_key": "user_id_emb.keys/part_0_2",
        "hashmap_key_dtype": "int64",
        "is_hashmap": True,
    },
    "user_id_emb.values/part_1_2": {
        "name": "user_id_emb.values/part_1_2",
        "dense": False,
        "dimension": 2,
        "dtype": "float32",
        "memory": 8,
        "shape": [1, 2],
        "hashmap_value": "user_id_emb.values/part_1_2",
        "hashmap_key": "user_id_emb.keys/part_1_2",
        "hashmap_key_dtype": "int64",
        "is_hashmap": True,
    },
    "pid_emb.weight": {
        "name": "pid_emb.weight",
        "dense": False,
        "dimension": 2,
        "dtype": "float32",
        "memory": 24,
        "shape": [3, 2],
        "is_hashmap": False,
    },
}
_U0 = "model.model.embedding_group.emb_impls.__BASE__.ebc.user_id_emb.values/part_0_2"
_U1 = "model.model.embedding_group.emb_impls.__BASE__.ebc.user_id_emb.values/part_1_2"
_PID = "model.model.embedding_group.emb_impls.__BASE__.ebc.embedding_bags.pid_emb.weight"
GOLDEN_TZREC_METADATA = {  # the same tables in TorchEasyRec's names (format 2, the default)
    _U0: _golden_entry(_U0, 2, _U0.replace(".values/", ".keys/")),
    _U1: _golden_entry(_U1, 1, _U1.replace(".values/", ".keys/")),
    _PID: _golden_entry(_PID, 3, None),
}
GOLDEN_TABLES = {
    "user_id_emb": {"is_hashmap": True, "dimension": 2, "rows": 3, "parts": 2},
    "pid_emb": {"is_hashmap": False, "dimension": 2, "rows": 3, "parts": 1},
}
# which: (naming, shard stem, shard metadata, manifest naming fields, format_version, pairs)
GOLDEN_NAMINGS = {
    "tzrec": (
        TZREC_NAMING,
        "model-000000-of-000001",
        GOLDEN_TZREC_METADATA,
        {"naming": "tzrec"},
        2,
        False,
    ),
    # format 3 = format 2 with a dense program that takes the pair inputs: the same files
    "tzrec+pairs": (
        TZREC_NAMING,
        "model-000000-of-000001",
        GOLDEN_TZREC_METADATA,
        {"naming": "tzrec"},
        3,
        True,
    ),
    "dynrec": (DYNREC_NAMING, "model-00000-of-00001", GOLDEN_FORMAT_1_METADATA, {}, 1, False),
}


def _golden_tensors() -> dict[str, torch.Tensor]:
    return {
        "keys0": torch.tensor([4, 8]),
        "keys1": torch.tensor([5]),
        "vals0": torch.tensor([[0.5, 1.0], [1.5, 2.0]]),
        "vals1": torch.tensor([[-1.0, 0.25]]),
        "pid": torch.arange(6, dtype=torch.float32).view(3, 2),
    }


@pytest.mark.parametrize("which", list(GOLDEN_NAMINGS))
def test_golden_metadata_and_manifest(
    tmp_path: Path, program: Path, pair_program: Path, which: str
) -> None:
    naming, shard, golden, naming_fields, version, pairs = GOLDEN_NAMINGS[which]
    fs = _golden_fs()
    g = _golden_tensors()
    before = time.time()
    out = write_bundle(
        tmp_path / "golden",
        dense_tables={"pid_emb": g["pid"]},
        hash_tables={"user_id_emb": [(g["keys0"], g["vals0"]), (g["keys1"], g["vals1"])]},
        feature_set=fs,
        dense_program_path=pair_program if pairs else program,
        config_digest="ab" * 32,
        version="v1",
        extra={"step": 7},
        naming=naming,
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "dense.pt2",
        "fg.json",
        "manifest.json",
        f"{shard}.json",
        f"{shard}.safetensors",
    ]
    meta_text = (out / f"{shard}.json").read_text()
    assert json.loads(meta_text) == golden
    assert list(json.loads(meta_text)) == list(golden)  # table order of the FeatureSet
    assert json.loads((out / "fg.json").read_text()) == feature_set_to_dict(fs)

    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest.pop("files")
    created = manifest.pop("created_at")
    assert manifest == {
        "format": "dynrec-bundle",
        "format_version": version,
        **naming_fields,  # format 1 has no "naming": its manifest is as it always was
        "version": "v1",
        "config_digest": "ab" * 32,
        "producer": {
            "torch": torch.__version__,
            "safetensors": manifest["producer"]["safetensors"],
        },
        "shards": [shard],
        "tables": GOLDEN_TABLES,
        "extra": {"step": 7},
    }
    stamp = calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    assert before - 2 <= stamp <= time.time() + 2
    assert sorted(files) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    for name, info in files.items():
        data = (out / name).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    values0, values1, weight = list(golden)
    with safe_open(out / f"{shard}.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(
            [
                weight,
                values0,
                values1,
                golden[values0]["hashmap_key"],
                golden[values1]["hashmap_key"],
            ]
        )
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor(golden[values1]["hashmap_key"]), g["keys1"])
        assert torch.equal(f.get_tensor(values0), g["vals0"])
        assert torch.equal(f.get_tensor(weight), g["pid"])
    b = read_bundle(out)
    assert b.naming == naming
    assert b.format_version == version
    assert torch.equal(b.hash_tables["user_id_emb"][0], torch.tensor([4, 8, 5]))
    prefix = C if naming == TZREC_NAMING else ""
    dense_prefix = f"{C}.embedding_bags" if naming == TZREC_NAMING else ""
    assert b.table_prefixes == {"user_id_emb": prefix, "pid_emb": dense_prefix}


def test_golden_scores_tensor(tmp_path: Path, program: Path) -> None:
    """The optional hotness of a dynamic table's rows: one int64 tensor per part beside its
    values, named by the entry's ``hashmap_score``; read back in key order."""
    fs = _golden_fs()
    g = _golden_tensors()
    s0, s1 = torch.tensor([7, 3]), torch.tensor([9])
    out = write_bundle(
        tmp_path / "golden",
        dense_tables={"pid_emb": g["pid"]},
        hash_tables={"user_id_emb": [(g["keys0"], g["vals0"], s0), (g["keys1"], g["vals1"], s1)]},
        feature_set=fs,
        dense_program_path=program,
        config_digest="ab" * 32,
        version="v1",
    )
    shard = "model-000000-of-000001"
    golden = {k: dict(v) for k, v in GOLDEN_TZREC_METADATA.items()}
    for values in (_U0, _U1):
        golden[values]["hashmap_score"] = values.replace(".values/", ".scores/")
    meta = json.loads((out / f"{shard}.json").read_text())
    assert meta == golden
    assert list(meta[_U0]) == [*GOLDEN_TZREC_METADATA[_U0], "hashmap_score"]
    with safe_open(out / f"{shard}.safetensors", "pt") as f:
        assert f.get_tensor(f"{C}.user_id_emb.scores/part_0_2").tolist() == [7, 3]
        assert f.get_tensor(f"{C}.user_id_emb.scores/part_1_2").tolist() == [9]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tables"] == GOLDEN_TABLES  # the summary is as without scores
    b = read_bundle(out)
    hot = b.hotness("user_id_emb")
    assert hot is not None and hot.tolist() == [7, 3, 9]  # keys [4, 8, 5]
    derived = dataclasses.replace(b, hash_tables={"user_id_emb": (torch.tensor([4]), g["vals1"])})
    assert derived.hotness("user_id_emb") is None  # other keys: the scores are not theirs


def test_a_bundle_without_scores_has_no_hotness(bundle: Path) -> None:
    b = read_bundle(bundle)
    assert b.hash_scores == {}
    assert all(b.hotness(t) is None for t in b.hash_tables)


def test_scores_of_some_parts_only_are_refused(tmp_path: Path, program: Path) -> None:
    g = _golden_tensors()
    with pytest.raises(BundleError, match="some parts have scores and some do not"):
        write_bundle(
            tmp_path / "b",
            dense_tables={"pid_emb": g["pid"]},
            hash_tables={
                "user_id_emb": [
                    (g["keys0"], g["vals0"], torch.tensor([1, 2])),
                    (g["keys1"], g["vals1"]),
                ]
            },
            feature_set=_golden_fs(),
            dense_program_path=program,
            config_digest="ab" * 32,
        )
    with pytest.raises(BundleError, match=r"scores are torch.float32 \[2\], expected int64"):
        write_bundle(
            tmp_path / "c",
            dense_tables={"pid_emb": g["pid"]},
            hash_tables={"user_id_emb": [(g["keys0"], g["vals0"], torch.ones(2))]},
            feature_set=_golden_fs(),
            dense_program_path=program,
            config_digest="ab" * 32,
        )


def _hand_built(
    root: Path,
    program: Path,
    fs: FeatureSet,
    shards: dict[str, tuple[dict[str, torch.Tensor], str]],
    head: dict[str, Any],
    tables: dict[str, dict[str, Any]],
) -> Path:
    """A bundle written file by file without write_bundle, as another writer leaves one: an
    older version of ours, or TorchEasyRec's exporter plus our fg.json, dense.pt2 and manifest.
    ``shards``: stem → (tensors, JSON text); ``head``: format_version (+ naming)."""
    root.mkdir()
    for stem, (tensors, meta_text) in shards.items():
        save_file(tensors, root / f"{stem}.safetensors", metadata={"format": "pt"})
        (root / f"{stem}.json").write_text(meta_text)
    (root / "fg.json").write_text(json.dumps(feature_set_to_dict(fs)))
    shutil.copyfile(program, root / "dense.pt2")
    manifest = {
        "format": "dynrec-bundle",
        **head,
        "version": "v1",
        "created_at": "2025-01-01T00:00:00Z",
        "config_digest": "ab" * 32,
        "producer": {"torch": "2.0", "safetensors": "0.4"},
        "shards": list(shards),
        "tables": tables,
        "extra": {},
        "files": {p.name: {} for p in root.iterdir()},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    _resign(root)
    return root


def test_reads_a_format_1_bundle_as_written_before(tmp_path: Path, program: Path) -> None:
    """Old bundles keep loading: today's format, built by hand (not by the new writer)."""
    g = _golden_tensors()
    tensors = {
        "user_id_emb.keys/part_0_2": g["keys0"],
        "user_id_emb.values/part_0_2": g["vals0"],
        "user_id_emb.keys/part_1_2": g["keys1"],
        "user_id_emb.values/part_1_2": g["vals1"],
        "pid_emb.weight": g["pid"],
    }
    shards = {"model-00000-of-00001": (tensors, json.dumps(GOLDEN_FORMAT_1_METADATA, indent=2))}
    head = {"format_version": 1}
    root = _hand_built(tmp_path / "old", program, _golden_fs(), shards, head, GOLDEN_TABLES)
    b = read_bundle(root)
    assert b.naming == DYNREC_NAMING and b.metadata == GOLDEN_FORMAT_1_METADATA
    assert torch.equal(b.hash_tables["user_id_emb"][0], torch.tensor([4, 8, 5]))
    assert torch.equal(b.hash_tables["user_id_emb"][1], torch.cat([g["vals0"], g["vals1"]]))
    assert torch.equal(b.dense_tables["pid_emb"], g["pid"])
    assert b.table_prefixes == {"user_id_emb": "", "pid_emb": ""}


# --------------------------------------------------------------------------- TorchEasyRec's names

# what tzrec's RTP export writes for the fixture checkpoint (2 saving ranks; FIXTURE/README.md):
# the JSON of a 1-rank export, and which entries a 2-rank one puts in each rank's file
RTP = json.loads((FIXTURE / "rtp_export.json").read_text())
RTP_JSON = RTP["model-000000-of-000001.json"]
RTP_RANKS = {
    "model-000000-of-000002": RTP["model-000000-of-000002.json (entry names only)"],
    "model-000001-of-000002": RTP["model-000001-of-000002.json (entry names only)"],
}


def _rtp_fs() -> FeatureSet:
    """The fixture's two tables, dim 16, in the order tzrec's sorted key files give them."""
    dyn = _dynamic(1000, ScoreStrategy.LFU)
    features, tables = {}, {}
    for feature, side in (("adgroup_id", Side.ITEM), ("user_id", Side.USER)):
        t = f"{feature}_emb"
        tables[t] = TableSpec(t, 16, None, dyn, "sum")
        features[feature] = FeatureSpec(
            feature, FeatureKind.ID, side, feature, t, IdTransform.DYNAMIC
        )
    groups = {"deep": GroupSpec("deep", GroupType.DEEP, tuple(features))}
    return FeatureSet(features, tables, groups, {"deep": tuple(tables)})


def _rtp_parts() -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per table, each saving rank's (keys, values) as tzrec's export reads them: the raw
    dynamicemb key and value files of the fixture checkpoint, in file order."""
    root = FIXTURE / "model.ckpt-500" / "dynamicemb" / C
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name in RTP_JSON:
        table, rank = name.split(".")[-2], int(name[-3])
        keys = np.fromfile(root / f"{table}_emb_keys.rank_{rank}.world_size_2", dtype=np.int64)
        values = np.fromfile(root / f"{table}_emb_values.rank_{rank}.world_size_2", np.float32)
        parts.setdefault(table, []).append(
            (torch.from_numpy(keys), torch.from_numpy(values).view(-1, 16))
        )
    return parts


def _rtp_tensors(entries: list[str]) -> dict[str, torch.Tensor]:
    parts = _rtp_parts()
    out = {}
    for name in entries:
        keys, values = parts[name.split(".")[-2]][int(name[-3])]
        out[RTP_JSON[name]["hashmap_key"]] = keys
        out[name] = values
    return out


RTP_TABLES = {
    "adgroup_id_emb": {"is_hashmap": True, "dimension": 16, "rows": 90, "parts": 2},
    "user_id_emb": {"is_hashmap": True, "dimension": 16, "rows": 120, "parts": 2},
}
TZREC_HEAD = {"format_version": 2, "naming": "tzrec"}


def _rtp_bundle(root: Path, program: Path) -> Path:
    """tzrec's 1-rank export (its JSON text as its json.dump(meta, f, indent=4) writes it)."""
    text = json.dumps(RTP_JSON, indent=4)
    shards = {"model-000000-of-000001": (_rtp_tensors(list(RTP_JSON)), text)}
    return _hand_built(root, program, _rtp_fs(), shards, TZREC_HEAD, RTP_TABLES)


def test_writer_writes_what_tzrec_writes(tmp_path: Path, program: Path) -> None:
    out = write_bundle(
        tmp_path / "b",
        dense_tables={},
        hash_tables=_rtp_parts(),
        feature_set=_rtp_fs(),
        dense_program_path=program,
        config_digest=DIGEST,
    )
    meta = json.loads((out / "model-000000-of-000001.json").read_text())
    assert meta == RTP_JSON and list(meta) == list(RTP_JSON)  # every field, in tzrec's order
    assert read_manifest(out)["shards"] == ["model-000000-of-000001"]
    with safe_open(out / "model-000000-of-000001.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(_rtp_tensors(list(RTP_JSON)))


@pytest.mark.parametrize("ranks", [1, 2], ids=["1-rank export", "2-rank export"])
def test_reads_tzrec_rtp_export(tmp_path: Path, program: Path, ranks: int) -> None:
    if ranks == 1:
        root = _rtp_bundle(tmp_path / "rtp", program)
    else:  # one model-00000R-of-000002.{json,safetensors} per export rank
        shards = {
            stem: (_rtp_tensors(names), json.dumps({n: RTP_JSON[n] for n in names}, indent=4))
            for stem, names in RTP_RANKS.items()
        }
        root = _hand_built(tmp_path / "rtp", program, _rtp_fs(), shards, TZREC_HEAD, RTP_TABLES)
    b = read_bundle(root)
    assert b.naming == TZREC_NAMING and b.metadata == RTP_JSON
    assert b.table_prefixes == {"adgroup_id_emb": C, "user_id_emb": C}
    for table, parts in _rtp_parts().items():  # the parts joined in rank order
        assert torch.equal(b.hash_tables[table][0], torch.cat([k for k, _ in parts]))
        assert torch.equal(b.hash_tables[table][1], torch.cat([v for _, v in parts]))
    expected = json.loads((FIXTURE / "expected.json").read_text())["tables"]
    for table, (keys, values) in b.hash_tables.items():  # every row of the checkpoint
        order = torch.argsort(keys)
        assert keys[order].tolist() == expected[table]["keys"]
        want = torch.tensor(expected[table]["values"], dtype=torch.float32)
        assert torch.equal(values[order], want)


def _renamed(meta: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``meta`` with entry ``old`` (and its keys tensor) named ``new``."""
    out = {}
    for name, entry in meta.items():
        if name == old:
            key = new.replace(".values/", ".keys/")
            entry = {**entry, "name": new, "hashmap_value": new, "hashmap_key": key}
            name = new
        out[name] = entry
    return out


def _rtp_refused(tmp_path: Path, program: Path, old: str, new: str, *match: str) -> None:
    meta = _renamed(RTP_JSON, old, new)
    root = tmp_path / "rtp"
    shards = {"model-000000-of-000001": (_rtp_tensors(list(RTP_JSON)), json.dumps(meta))}
    tensors = shards["model-000000-of-000001"][0]
    tensors[new] = tensors.pop(old)
    tensors[new.replace(".values/", ".keys/")] = tensors.pop(old.replace(".values/", ".keys/"))
    _hand_built(root, program, _rtp_fs(), shards, TZREC_HEAD, RTP_TABLES)
    _refused(root, "model-000000-of-000001.json", *match)


def test_tzrec_name_of_no_table_is_refused(tmp_path: Path, program: Path) -> None:
    old = f"{C}.user_id_emb.values/part_1_2"
    new = f"{C}.click_50_seq__adgroup_id_emb.values/part_1_2"
    _rtp_refused(
        tmp_path,
        program,
        old,
        new,
        f"tensor '{new}' is of table 'click_50_seq__adgroup_id_emb'",
        "fg.json does not have (tables: adgroup_id_emb, user_id_emb)",
    )


def test_tzrec_table_under_two_collections_is_refused(tmp_path: Path, program: Path) -> None:
    seq = "model.model.embedding_group.seq_emb_impls.__BASE__.ec_dict.16"
    old = f"{C}.adgroup_id_emb.values/part_1_2"
    _rtp_refused(
        tmp_path,
        program,
        old,
        f"{seq}.adgroup_id_emb.values/part_1_2",
        "table 'adgroup_id_emb' is under two paths",
        f"'{C}' and '{seq}'",
        "one table per embedding name",
    )


def test_names_must_follow_the_declared_naming(tmp_path: Path, program: Path) -> None:
    _rtp_refused(  # format 2 / tzrec names need the collection path
        tmp_path,
        program,
        f"{C}.user_id_emb.values/part_0_2",
        "user_id_emb.values/part_0_2",
        "tensor name 'user_id_emb.values/part_0_2' is not of the form "
        "<collection path>.<table>.values/part_R_W (tzrec naming, format_version 2",
    )
    old = _write(tmp_path / "v1", program, naming=DYNREC_NAMING)  # format 1 with 6-digit shards
    m = json.loads((old / "manifest.json").read_text())
    m["shards"] = ["model-000000-of-000001"]
    (old / "manifest.json").write_text(json.dumps(m))
    _refused(old, "shard 'model-000000-of-000001' is not named as dynrec naming")


@pytest.mark.parametrize(
    ("head", "match"),
    [
        (
            {"format_version": 5},
            "format_version 5 is not supported (this reader knows [1, 2, 3, 4])",
        ),
        ({"format_version": 3}, "format_version 3 needs 'naming': 'tzrec', got None"),
        ({"format_version": 3, "naming": "dynrec"}, "needs 'naming': 'tzrec', got 'dynrec'"),
        ({"format_version": True}, "format_version True is not supported"),
        ({"format_version": 2}, "format_version 2 needs 'naming': 'tzrec', got None"),
        ({"format_version": 2, "naming": "dynrec"}, "needs 'naming': 'tzrec', got 'dynrec'"),
        ({"format_version": 2, "naming": ["tzrec"]}, "got ['tzrec']"),
    ],
)
def test_format_version_and_naming_are_checked(
    tmp_path: Path, program: Path, head: dict[str, Any], match: str
) -> None:
    root = _rtp_bundle(tmp_path / "rtp", program)
    m = json.loads((root / "manifest.json").read_text())
    m.pop("naming")
    (root / "manifest.json").write_text(json.dumps({**m, **head}))
    with pytest.raises(BundleError, match=re.escape(match)):
        read_manifest(root)
    with pytest.raises(BundleError, match=re.escape(match)):
        read_bundle(root)


def test_pair_program_needs_tzrec_naming(tmp_path: Path, pair_program: Path) -> None:
    """Format 1 readers predate the pair inputs: a pair program is refused in dynrec naming."""
    with pytest.raises(BundleError, match="use tzrec naming, or export the program without"):
        _write(tmp_path / "v1", pair_program, naming=DYNREC_NAMING)
    assert not (tmp_path / "v1").exists()
    out = _write(tmp_path / "v3", pair_program)
    assert read_manifest(out)["format_version"] == PAIR_PROGRAM_FORMAT
    assert read_bundle(out).naming == TZREC_NAMING


def test_program_must_load(tmp_path: Path) -> None:
    not_a_program = tmp_path / "dense.pt2"
    with zipfile.ZipFile(not_a_program, "w") as z:
        z.writestr("x/readme.txt", "not a program")
    with pytest.raises(BundleError, match="torch.export.load failed"):
        _write(tmp_path / "b", not_a_program)


def test_naming_object() -> None:
    n = TZREC_NAMING
    assert n.shard_stem(1, 12) == "model-000001-of-000012"
    assert DYNREC_NAMING.shard_stem(1, 12) == "model-00001-of-00012"
    assert n.keys_name("user_id_emb", 1, 2) == f"{C}.user_id_emb.keys/part_1_2"
    assert n.weight_name("pid_emb") == f"{C}.embedding_bags.pid_emb.weight"
    parsed = n.parse("a.b.__BASE__.ebc.user_id_emb.values/part_3_4", hashmap=True)
    assert (parsed.table, parsed.rank, parsed.world, parsed.prefix) == (
        "user_id_emb",
        3,
        4,
        "a.b.__BASE__.ebc",
    )
    assert n.parse("user_id_emb.values/part_0_1", hashmap=True) is None
    assert n.parse(f"{C}.user_id_emb.values/part_0_1", hashmap=False) is None
    assert DYNREC_NAMING.parse("pid_emb.weight", hashmap=False).table == "pid_emb"
    other = TzrecNaming("model.embedding_group.emb_impls.__BASE__.ebc")
    assert (
        other.values_name("t", 0, 1)
        == "model.embedding_group.emb_impls.__BASE__.ebc.t.values/part_0_1"
    )
    for bad in ("", ".model", "model.", "a/b"):
        with pytest.raises(BundleError, match="must be a dotted module path"):
            TzrecNaming(bad)
    with pytest.raises(BundleError, match=r"table 'a\.b'.*cannot contain '\.'.*DYNREC_NAMING"):
        n.check_table("a.b")
    DYNREC_NAMING.check_table("a.b")


def test_writer_refuses_a_table_name_tzrec_cannot_carry(tmp_path: Path, program: Path) -> None:
    fs = _golden_fs()
    dotted = FeatureSet(
        {**fs.features, "pid": dataclasses.replace(fs.features["pid"], table="pid.emb")},
        {
            "user_id_emb": fs.tables["user_id_emb"],
            "pid.emb": TableSpec("pid.emb", 2, 3, None, "sum"),
        },
        fs.groups,
        fs.fusion_groups,
    )
    args: dict[str, Any] = {
        "dense_tables": {"pid.emb": torch.zeros(3, 2)},
        "hash_tables": {"user_id_emb": [(torch.tensor([1]), torch.zeros(1, 2))]},
        "feature_set": dotted,
        "dense_program_path": program,
        "config_digest": DIGEST,
    }
    with pytest.raises(BundleError, match=r"table 'pid\.emb': TorchEasyRec names tensors"):
        write_bundle(tmp_path / "b", **args)
    assert not (tmp_path / "b").exists()
    b = read_bundle(write_bundle(tmp_path / "b", **args, naming=DYNREC_NAMING))
    assert "pid.emb.weight" in b.metadata and b.dense_tables["pid.emb"].shape == (3, 2)


def test_writes_the_collection_path_of_each_table(tmp_path: Path, program: Path) -> None:
    deep = "model.embedding_group.emb_impls.__BASE__.ebc"
    seq = "model.model.embedding_group.seq_emb_impls.__BASE__.ec_dict.16"
    naming = TzrecNaming(deep).for_tables({"brand_emb": seq})  # as the checkpoint holds them
    assert DYNREC_NAMING.for_tables({"brand_emb": seq}) is DYNREC_NAMING
    b = read_bundle(_write(tmp_path / "b", program, naming=naming))
    assert b.table_prefixes["user_id_emb"] == deep and b.table_prefixes["brand_emb"] == seq
    assert f"{seq}.brand_emb.values/part_1_2" in b.metadata
    assert b.table_prefixes["pid_emb"] == f"{deep}.embedding_bags"
    assert b.naming == TZREC_NAMING  # read back: tzrec naming, whatever the collection paths


def test_default_version_is_utc_time(tmp_path: Path, program: Path) -> None:
    out = _write(tmp_path / "b", program, version=None)
    m = read_manifest(out)
    assert re.fullmatch(r"\d{8}T\d{6}Z", m["version"])
    assert m["version"] == m["created_at"].replace("-", "").replace(":", "")


# --------------------------------------------------------------------------- refused on read


def _resign(root: Path) -> None:
    """Refresh manifest sizes/checksums, as a buggy writer that signs what it wrote would."""
    path = root / "manifest.json"
    m = json.loads(path.read_text())
    for name in m["files"]:
        data = (root / name).read_bytes()
        m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(m))


def _tamper(
    root: Path,
    *,
    tensors: Callable[[dict[str, torch.Tensor]], object] | None = None,
    meta: Callable[[dict[str, Any]], object] | None = None,
) -> None:
    """Rewrite shard 0's tensors and/or metadata, then re-sign the manifest."""
    st, js = root / f"{SHARD}.safetensors", root / f"{SHARD}.json"
    if tensors is not None:
        t = {k: v.clone() for k, v in load_file(st).items()}  # clone: st is rewritten below
        tensors(t)
        save_file(t, st)
    if meta is not None:
        m = json.loads(js.read_text())
        meta(m)
        js.write_text(json.dumps(m))
    _resign(root)


@pytest.fixture()
def bundle(tmp_path: Path, program: Path) -> Path:
    return _write(tmp_path / "b", program)


def _refused(path: Path, *match: str, verify_checksums: bool = True) -> str:
    with pytest.raises(BundleError) as err:
        read_bundle(path, verify_checksums=verify_checksums)
    msg = str(err.value)
    for m in match:
        assert m in msg, msg
    return msg


def test_flipped_byte_is_a_checksum_error(bundle: Path) -> None:
    st = bundle / f"{SHARD}.safetensors"
    data = bytearray(st.read_bytes())
    data[len(data) // 2] ^= 0xFF
    st.write_bytes(bytes(data))
    _refused(bundle, f"{SHARD}.safetensors", "sha256 checksum mismatch", "copy the bundle again")


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_safetensors(bundle: Path, verify: bool) -> None:
    st = bundle / f"{SHARD}.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    _refused(bundle, f"{SHARD}.safetensors", "truncated", verify_checksums=verify)
    _resign(bundle)  # even with a manifest that agrees: a clear error, not a crash
    _refused(
        bundle,
        f"{SHARD}.safetensors",
        "not a readable safetensors file",
        "truncated or corrupt",
        verify_checksums=verify,
    )


def test_garbage_header_is_refused(bundle: Path) -> None:
    st = bundle / f"{SHARD}.safetensors"
    st.write_bytes(b"\xff" * 64)
    _resign(bundle)
    _refused(bundle, f"{SHARD}.safetensors", "not a readable safetensors file")


def test_metadata_shape_mismatch(bundle: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m[V("user_id_emb", 0)]["shape"][0] += 1

    _tamper(bundle, meta=edit)
    _refused(bundle, f"{SHARD}.json", "table 'user_id_emb'", "metadata/shape mismatch")


def test_dense_weight_disagrees_with_fg_json(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t[W("pid_emb")] = t[W("pid_emb")][:-1].clone()

    def edit_m(m: dict[str, Any]) -> None:
        m[W("pid_emb")]["shape"] = [19, 16]
        m[W("pid_emb")]["memory"] = 19 * 16 * 4

    _tamper(bundle, tensors=edit_t, meta=edit_m)
    _refused(bundle, "table 'pid_emb'", "shape [19, 16]", "expected [20, 16]")


def test_missing_table(bundle: Path) -> None:
    _tamper(
        bundle,
        tensors=lambda t: t.pop(W("pid_emb")),
        meta=lambda m: m.pop(W("pid_emb")),
    )
    _refused(bundle, "missing table 'pid_emb'", "fg.json declares it")


def test_missing_part(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        del t[K("brand_emb", 1)], t[V("brand_emb", 1)]

    _tamper(bundle, tensors=edit_t, meta=lambda m: m.pop(V("brand_emb", 1)))
    _refused(bundle, "table 'brand_emb'", "a part is missing")


def test_duplicate_keys(bundle: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = t[K("customer_emb", 1)]
        k[0] = t[K("customer_emb", 0)][3]  # the same key on two ranks

    _tamper(bundle, tensors=edit)
    _refused(bundle, "table 'customer_emb'", "duplicate keys")


def test_key_dtype_not_int64(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t[K("user_id_emb", 0)] = t[K("user_id_emb", 0)].to(torch.int32)

    def edit_m(m: dict[str, Any]) -> None:
        m[V("user_id_emb", 0)]["hashmap_key_dtype"] = "int32"

    _tamper(bundle, tensors=edit_t, meta=edit_m)
    _refused(bundle, "table 'user_id_emb'", "key dtype torch.int32", "expected int64")


def test_tensors_of_unknown_table(bundle: Path) -> None:
    ghost = {"name": W("ghost_emb"), "dense": False, "dimension": 16, "dtype": "float32"}
    ghost |= {"shape": [2, 16], "is_hashmap": False}

    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t[W("ghost_emb")] = torch.zeros(2, 16)

    _tamper(bundle, tensors=edit_t, meta=lambda m: m.update({W("ghost_emb"): ghost}))
    _refused(
        bundle,
        f"tensor '{C}.embedding_bags.ghost_emb.weight' is of table 'ghost_emb'",
        "fg.json does not have",
    )


def test_tensor_without_metadata_entry(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t["stray"] = torch.zeros(1)

    _tamper(bundle, tensors=edit_t)
    _refused(bundle, f"{SHARD}.safetensors", "tensor 'stray' has no entry")


def test_bad_fg_json(bundle: Path) -> None:
    fg = bundle / "fg.json"
    d = json.loads(fg.read_text())
    del d["tables"]["pid_emb"]["num_rows"]
    fg.write_text(json.dumps(d))
    _resign(bundle)
    _refused(bundle, "fg.json: tables.pid_emb: missing key 'num_rows'")


def test_missing_manifest_is_an_incomplete_bundle(bundle: Path) -> None:
    (bundle / "manifest.json").unlink()
    _refused(bundle, "incomplete bundle", "manifest.json", "re-run the export")
    with pytest.raises(BundleError, match="no such bundle directory"):
        read_bundle(bundle.parent / "nowhere")


def test_missing_listed_file(bundle: Path) -> None:
    (bundle / "dense.pt2").unlink()
    _refused(bundle, "dense.pt2", "listed in manifest.json but missing")


# --------------------------------------------------------------------------- atomic writing


def test_overwrite_protection(tmp_path: Path, program: Path) -> None:
    out = _write(tmp_path / "b", program, version="v1")
    with pytest.raises(BundleError, match=r"already holds a bundle; pass --overwrite"):
        _write(out, program, version="v2")
    assert read_bundle(out).version == "v1"  # untouched
    _write(out, program, version="v2", overwrite=True)
    assert read_bundle(out).version == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # old copy and temp dir removed


def test_partial_and_foreign_destinations(tmp_path: Path, program: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / f"{SHARD}.safetensors").write_bytes(b"half")
    with pytest.raises(BundleError, match=r"incomplete bundle .*pass --overwrite"):
        _write(partial, program)
    _write(partial, program, overwrite=True)
    read_bundle(partial)

    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="not a bundle directory .*'notes.txt'"):
        _write(foreign, program, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    read_bundle(_write(empty, program))


def test_failure_mid_write_leaves_nothing(
    tmp_path: Path, program: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*_: object, **__: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(writer, "_swap_in", boom)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path / "b", program)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    out = _write(tmp_path / "b", program, version="v1")
    monkeypatch.setattr(writer, "write_json", boom)  # dies before the manifest exists
    with pytest.raises(OSError, match="disk full"):
        _write(out, program, version="v2", overwrite=True)
    assert read_bundle(out).version == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_swap_without_renameat2(
    tmp_path: Path, program: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _write(tmp_path / "b", program, version="v1")
    monkeypatch.setattr(writer, "_exchange", lambda *_: False)
    _write(out, program, version="v2", overwrite=True)
    assert read_bundle(out).version == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


# --------------------------------------------------------------------------- refused on write


def _bad_write(tmp_path: Path, program: Path, match: str, **kw: Any) -> None:
    with pytest.raises(BundleError, match=match):
        _write(tmp_path / "b", program, **kw)
    assert not (tmp_path / "b").exists()


def test_write_refuses_duplicate_keys(tmp_path: Path, program: Path) -> None:
    _, hashes = _tables(SEED_FS)
    k0, v0 = hashes["brand_emb"][0]
    k1, v1 = hashes["brand_emb"][1]
    hashes["brand_emb"][1] = (torch.cat([k1, k0[:1]]), torch.cat([v1, v0[:1]]))
    _bad_write(tmp_path, program, r"table 'brand_emb': duplicate keys", hash_tables=hashes)


def test_write_refuses_bad_tensors(tmp_path: Path, program: Path) -> None:
    dense, hashes = _tables(SEED_FS)
    k, v = hashes["user_id_emb"][0]
    bad_keys = {**hashes, "user_id_emb": [(k.to(torch.int32), v), hashes["user_id_emb"][1]]}
    _bad_write(
        tmp_path, program, r"'user_id_emb' part 0 of 2: keys are torch.int32", hash_tables=bad_keys
    )
    bad_vals = {**hashes, "user_id_emb": [(k, v[:, :8]), hashes["user_id_emb"][1]]}
    _bad_write(
        tmp_path, program, r"values are torch.float32 \[\d+, 8\], expected", hash_tables=bad_vals
    )
    pair = {**hashes, "user_id_emb": (k, v)}
    _bad_write(tmp_path, program, r"wrap a single pair as \[\(keys, values\)\]", hash_tables=pair)
    bad_dense = {**dense, "pid_emb": torch.zeros(21, 16)}
    _bad_write(
        tmp_path, program, r"'pid_emb': weight is torch.float32 \[21, 16\]", dense_tables=bad_dense
    )
    half = {**dense, "pid_emb": torch.zeros(20, 16, dtype=torch.float16)}
    _bad_write(tmp_path, program, r"'pid_emb'.*expected float32", dense_tables=half)


def test_write_refuses_table_mismatches(tmp_path: Path, program: Path) -> None:
    dense, hashes = _tables(SEED_FS)
    missing = {k: v for k, v in dense.items() if k != "pid_emb"}
    _bad_write(tmp_path, program, "dense table 'pid_emb' is missing", dense_tables=missing)
    extra = {**dense, "ghost_emb": torch.zeros(2, 16)}
    _bad_write(tmp_path, program, "table 'ghost_emb' is not in the FeatureSet", dense_tables=extra)
    swapped = {**dense, "user_id_emb": torch.zeros(2, 16)}
    _bad_write(
        tmp_path, program, "'user_id_emb' is dynamic; pass it in hash_tables", dense_tables=swapped
    )
    no_hash = {k: v for k, v in hashes.items() if k != "cate_id_emb"}
    _bad_write(tmp_path, program, "dynamic table 'cate_id_emb' is missing", hash_tables=no_hash)


def test_write_refuses_bad_arguments(tmp_path: Path, program: Path) -> None:
    _bad_write(tmp_path, program, "is not a sha256 hex digest", config_digest="abc")
    _bad_write(tmp_path, program, "version 'a/b' must be", version="a/b")
    _bad_write(tmp_path, program, "extra must be JSON-serializable", extra={"x": object()})
    not_zip = tmp_path / "dense.pt2"
    not_zip.write_text("nope")
    _bad_write(tmp_path, program, "is not a torch.export archive", dense_program_path=not_zip)


def test_destination_filled_while_writing(
    tmp_path: Path, program: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _write(tmp_path / "b", program, version="v1")
    monkeypatch.setattr(writer, "_destination_state", lambda _: "absent")  # a concurrent writer
    with pytest.raises(BundleError, match="was filled while this bundle was written"):
        _write(out, program, version="v2")
    assert read_bundle(out).version == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_stale_temp_dirs_of_killed_writes_are_removed(tmp_path: Path, program: Path) -> None:
    """Old hidden .<name>.tmp-<hex> dirs beside the bundle go; fresh ones, .old- ones (they may
    hold the only copy of a bundle) and other names stay."""
    old = time.time() - 3600
    names = (".1.tmp-0123456789ab", ".2.tmp-ba9876543210", ".b.old-0123456789ab", ".x", "y")
    for name in names:
        (tmp_path / name).mkdir()
        if name != ".2.tmp-ba9876543210":  # that one is fresh (a write still running)
            os.utime(tmp_path / name, (old, old))
    _write(tmp_path / "b", program)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".2.tmp-ba9876543210", ".b.old-0123456789ab", ".x", "b", "y"]
