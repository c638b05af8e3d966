"""The export bundle: round trip, golden metadata/manifest, plain-safetensors access, refusals."""

import calendar
import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shared.bundle.writer as writer
from shared.bundle import (
    BundleError,
    load_dense_program,
    read_bundle,
    read_manifest,
    write_bundle,
)
from shared.config import config_digest, parse_config
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
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
SEED_FS = feature_set_from_text(SEED_TEXT, "seed")
DIGEST = config_digest(parse_config(SEED_TEXT))
SHARD = "model-00000-of-00001"

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
    assert shards == [f"model-{i:05d}-of-{count:05d}" for i in range(count)]
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
            seen_tables.add(re.sub(r"\.(values/part_\d+_\d+|weight)$", "", entry["name"]))
    assert names == set()  # every tensor is described
    assert seen_tables == set(SEED_FS.tables)
    hashmaps = [e for e in meta.values() if e["is_hashmap"]]
    assert len(hashmaps) == 2 * len(SEED_FS.dynamic_tables)  # two parts each


# --------------------------------------------------------------------------- golden


def _golden_fs() -> FeatureSet:
    dyn = DynamicTableSpec(
        max_capacity=10,
        init_capacity=10,
        bucket_capacity=128,
        score_strategy=ScoreStrategy.STEP,
        initializer=CONSTANT_ZERO,
        eval_initializer=CONSTANT_ZERO,
        admission=None,
        init_table=None,
    )
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


GOLDEN_METADATA = {
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


def test_golden_metadata_and_manifest(tmp_path: Path, program: Path) -> None:
    fs = _golden_fs()
    keys0, keys1 = torch.tensor([4, 8]), torch.tensor([5])
    vals0, vals1 = torch.tensor([[0.5, 1.0], [1.5, 2.0]]), torch.tensor([[-1.0, 0.25]])
    pid = torch.arange(6, dtype=torch.float32).view(3, 2)
    before = time.time()
    out = write_bundle(
        tmp_path / "golden",
        dense_tables={"pid_emb": pid},
        hash_tables={"user_id_emb": [(keys0, vals0), (keys1, vals1)]},
        feature_set=fs,
        dense_program_path=program,
        config_digest="ab" * 32,
        version="v1",
        extra={"step": 7},
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "dense.pt2",
        "fg.json",
        "manifest.json",
        f"{SHARD}.json",
        f"{SHARD}.safetensors",
    ]
    meta_text = (out / f"{SHARD}.json").read_text()
    assert json.loads(meta_text) == GOLDEN_METADATA
    assert list(json.loads(meta_text)) == list(GOLDEN_METADATA)  # table order of the FeatureSet
    assert json.loads((out / "fg.json").read_text()) == feature_set_to_dict(fs)

    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest.pop("files")
    created = manifest.pop("created_at")
    assert manifest == {
        "format": "dynrec-bundle",
        "format_version": 1,
        "version": "v1",
        "config_digest": "ab" * 32,
        "producer": {
            "torch": torch.__version__,
            "safetensors": manifest["producer"]["safetensors"],
        },
        "shards": [SHARD],
        "tables": {
            "user_id_emb": {"is_hashmap": True, "dimension": 2, "rows": 3, "parts": 2},
            "pid_emb": {"is_hashmap": False, "dimension": 2, "rows": 3, "parts": 1},
        },
        "extra": {"step": 7},
    }
    stamp = calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    assert before - 2 <= stamp <= time.time() + 2
    assert sorted(files) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    for name, info in files.items():
        data = (out / name).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    with safe_open(out / f"{SHARD}.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(
            [
                "pid_emb.weight",
                "user_id_emb.keys/part_0_2",
                "user_id_emb.keys/part_1_2",
                "user_id_emb.values/part_0_2",
                "user_id_emb.values/part_1_2",
            ]
        )
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor("user_id_emb.keys/part_1_2"), keys1)
        assert torch.equal(f.get_tensor("user_id_emb.values/part_0_2"), vals0)
    b = read_bundle(out)
    assert torch.equal(b.hash_tables["user_id_emb"][0], torch.tensor([4, 8, 5]))


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
        m["user_id_emb.values/part_0_2"]["shape"][0] += 1

    _tamper(bundle, meta=edit)
    _refused(bundle, f"{SHARD}.json", "table 'user_id_emb'", "metadata/shape mismatch")


def test_dense_weight_disagrees_with_fg_json(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t["pid_emb.weight"] = t["pid_emb.weight"][:-1].clone()

    def edit_m(m: dict[str, Any]) -> None:
        m["pid_emb.weight"]["shape"] = [19, 16]

    _tamper(bundle, tensors=edit_t, meta=edit_m)
    _refused(bundle, "table 'pid_emb'", "shape [19, 16]", "expected [20, 16]")


def test_missing_table(bundle: Path) -> None:
    _tamper(
        bundle,
        tensors=lambda t: t.pop("pid_emb.weight"),
        meta=lambda m: m.pop("pid_emb.weight"),
    )
    _refused(bundle, "missing table 'pid_emb'", "fg.json declares it")


def test_missing_part(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        del t["brand_emb.keys/part_1_2"], t["brand_emb.values/part_1_2"]

    _tamper(bundle, tensors=edit_t, meta=lambda m: m.pop("brand_emb.values/part_1_2"))
    _refused(bundle, "table 'brand_emb'", "a part is missing")


def test_duplicate_keys(bundle: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = t["customer_emb.keys/part_1_2"]
        k[0] = t["customer_emb.keys/part_0_2"][3]  # the same key on two ranks

    _tamper(bundle, tensors=edit)
    _refused(bundle, "table 'customer_emb'", "duplicate keys")


def test_key_dtype_not_int64(bundle: Path) -> None:
    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t["user_id_emb.keys/part_0_2"] = t["user_id_emb.keys/part_0_2"].to(torch.int32)

    def edit_m(m: dict[str, Any]) -> None:
        m["user_id_emb.values/part_0_2"]["hashmap_key_dtype"] = "int32"

    _tamper(bundle, tensors=edit_t, meta=edit_m)
    _refused(bundle, "table 'user_id_emb'", "key dtype torch.int32", "expected int64")


def test_tensors_of_unknown_table(bundle: Path) -> None:
    ghost = {"name": "ghost_emb.weight", "dense": False, "dimension": 16, "dtype": "float32"}
    ghost |= {"shape": [2, 16], "is_hashmap": False}

    def edit_t(t: dict[str, torch.Tensor]) -> None:
        t["ghost_emb.weight"] = torch.zeros(2, 16)

    _tamper(bundle, tensors=edit_t, meta=lambda m: m.update({"ghost_emb.weight": ghost}))
    _refused(bundle, "unknown table 'ghost_emb'", "fg.json has no such table")


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
    with pytest.raises(BundleError, match=r"already holds a bundle; pass overwrite=True"):
        _write(out, program, version="v2")
    assert read_bundle(out).version == "v1"  # untouched
    _write(out, program, version="v2", overwrite=True)
    assert read_bundle(out).version == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # old copy and temp dir removed


def test_partial_and_foreign_destinations(tmp_path: Path, program: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / f"{SHARD}.safetensors").write_bytes(b"half")
    with pytest.raises(BundleError, match="incomplete bundle .*pass overwrite=True"):
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
