"""Read and validate a bundle; every defect is a BundleError naming the file, table and fix."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import load_file

from shared.bundle.layout import (
    BUNDLE_FORMAT,
    DENSE_PROGRAM,
    FG_JSON,
    MANIFEST,
    BundleError,
    check_unique,
    read_json,
    sha256,
)
from shared.bundle.naming import BundleNaming, TensorName, naming_of
from shared.features import FeatureSet, TableSpec
from shared.fg_spec import FgSpecError, feature_set_from_dict

# table → rank → (W, keys, values, scores or None)
Part = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]
Parts = dict[str, dict[int, Part]]


@dataclass
class Bundle:
    """A validated bundle. Dense program loading is left to :func:`load_dense_program`.

    Tensors are backed by a private (copy-on-write) memory map of the safetensors files, so pages
    are read on first touch; hash tables of several parts are concatenated copies.
    """

    path: Path
    dense_tables: dict[str, torch.Tensor]  # table → float32 [rows, dim]
    hash_tables: dict[str, tuple[torch.Tensor, torch.Tensor]]  # table → (int64 [N], f32 [N, dim])
    feature_set: FeatureSet
    manifest: dict[str, Any]
    metadata: dict[str, dict[str, Any]]  # entries of every model-*.json, by entry name
    dense_program_path: Path
    version: str
    read_seconds: float
    naming: BundleNaming  # of the files and tensor names (shared.bundle.naming)
    # table → what its tensor names put before the table: the collection path in TorchEasyRec
    # naming ("model.model.embedding_group.emb_impls.__BASE__.ebc"), "" in dynrec naming
    table_prefixes: dict[str, str]
    # dynamic table → (the keys tensor they belong to, its rows' hotness int64 [N]): read them
    # with hotness(), which drops them once hash_tables holds other keys (a delta merged in)
    hash_scores: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def config_digest(self) -> str:
        return str(self.manifest["config_digest"])

    def hotness(self, table: str) -> torch.Tensor | None:
        """The rows' hotness of dynamic ``table``, int64 [N] in the order of its keys (larger is
        hotter: the training table's STEP/TIMESTAMP/LFU scores), or None when the bundle has none
        for it: written without them, or derived from a bundle whose keys were replaced (a delta
        merged in, ``serve.delta``), whose scores no longer match its rows."""
        entry = self.hash_scores.get(table)
        if entry is None or entry[0] is not self.hash_tables[table][0]:
            return None
        return entry[1]

    @property
    def format_version(self) -> int:
        """1-3 (:mod:`shared.bundle.naming`); 3: the dense program takes the pair inputs."""
        return int(self.manifest["format_version"])


@dataclass
class _Tables:
    """What the entries of the shards have given so far, by table."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: Parts = field(default_factory=dict)
    prefixes: dict[str, str] = field(default_factory=dict)  # what precedes each table's name


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the bundle at ``path`` (cheap: no tensors, no checksums)."""
    return _manifest(Path(path))[0]


def _manifest(root: Path) -> tuple[dict[str, Any], BundleNaming]:
    """The checked manifest and the naming it declares (detected here, once)."""
    if not root.is_dir():
        raise BundleError(
            f"{root}: no such bundle directory; check the path (the --out of python -m train "
            "export)"
        )
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise BundleError(
            f"{root}: incomplete bundle: no {MANIFEST} (it is written last, so the export did "
            "not finish); re-run the export"
        )
    m = read_json(mpath)
    if m.get("format") != BUNDLE_FORMAT:
        raise BundleError(
            f"{mpath}: format is {m.get('format')!r}, expected {BUNDLE_FORMAT!r}; this is not a "
            "dynrec bundle: write one with python -m train export"
        )
    naming = naming_of(m, str(mpath))
    types_ = {
        "version": str,
        "created_at": str,
        "config_digest": str,
        "shards": list,
        "tables": dict,
        "extra": dict,
        "files": dict,
        "producer": dict,
    }
    for key, tp in types_.items():
        if not isinstance(m.get(key), tp):
            raise BundleError(
                f"{mpath}: key {key!r} is missing or not a {tp.__name__}; re-export the bundle"
            )
    if not m["shards"]:
        raise BundleError(f"{mpath}: 'shards' is empty; re-export the bundle")
    for stem in m["shards"]:
        if not isinstance(stem, str) or not naming.is_stem(stem):
            raise BundleError(
                f"{mpath}: shard {stem!r} is not named as {naming.id} naming (format_version "
                f"{naming.format_version}) names shards, e.g. {naming.shard_stem(0, 1)!r}; "
                "re-export the bundle"
            )
    needed = [FG_JSON, DENSE_PROGRAM] + [
        f"{s}{x}" for s in m["shards"] for x in (".safetensors", ".json")
    ]
    for name in needed:
        if name not in m["files"]:
            raise BundleError(f"{mpath}: 'files' does not list {name!r}; re-export the bundle")
    for name, info in m["files"].items():
        ok = (
            "/" not in name
            and name not in ("", ".", "..")
            and isinstance(info, dict)
            and isinstance(info.get("size"), int)
            and isinstance(info.get("sha256"), str)
        )
        if not ok:
            raise BundleError(
                f"{mpath}: bad 'files' entry {name!r}: {info!r}; re-export the bundle"
            )
    return m, naming


def read_bundle(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> Bundle:
    """Read and validate the bundle at ``path``; any defect raises :class:`BundleError`.

    Sizes are always checked against the manifest; ``verify_checksums`` adds sha256 of every file.
    Both namings are read (:mod:`shared.bundle.naming`); the manifest says which one it is.
    """
    t0 = time.perf_counter()
    root = Path(path)
    manifest, naming = _manifest(root)
    _check_files(root, manifest, verify_checksums)
    try:
        fs = feature_set_from_dict(read_json(root / FG_JSON), source=str(root / FG_JSON))
    except FgSpecError as err:
        raise BundleError(f"{err}; re-export the bundle") from None
    metadata: dict[str, dict[str, Any]] = {}
    found = _Tables()
    for stem in manifest["shards"]:
        tensors = _load_safetensors(root / f"{stem}.safetensors")
        meta = read_json(root / f"{stem}.json")
        used: set[str] = set()
        for entry, info in meta.items():
            if entry in metadata:
                raise BundleError(
                    f"{root / (stem + '.json')}: entry {entry!r} is in two shards; re-export the "
                    "bundle"
                )
            metadata[entry] = info
            _read_entry(root / f"{stem}.json", entry, info, tensors, fs, naming, found, used)
        orphans = sorted(set(tensors) - used)
        if orphans:
            raise BundleError(
                f"{root / (stem + '.safetensors')}: tensor {orphans[0]!r} has no entry in "
                f"{stem}.json; re-export the bundle"
            )
    dense = found.dense
    joined = {t: _join_parts(root, t, p) for t, p in found.parts.items()}
    hashes = {t: (k, v) for t, (k, v, _) in joined.items()}
    scores = {t: sc for t, (_, _, sc) in joined.items() if sc is not None}
    for t in fs.tables:
        if t not in dense and t not in hashes:
            raise BundleError(
                f"{root}: missing table {t!r}: fg.json declares it but no model-*.json entry "
                "holds its tensors; re-export the bundle"
            )
    _check_summary(root, manifest, dense, hashes, found.parts)
    return Bundle(
        path=root,
        dense_tables={t: dense[t] for t in fs.tables if t in dense},
        hash_tables={t: hashes[t] for t in fs.tables if t in hashes},
        feature_set=fs,
        manifest=manifest,
        metadata=metadata,
        dense_program_path=root / DENSE_PROGRAM,
        version=manifest["version"],
        read_seconds=time.perf_counter() - t0,
        naming=naming,
        table_prefixes={t: found.prefixes[t] for t in fs.tables},
        hash_scores={t: (hashes[t][0], scores[t]) for t in fs.tables if t in scores},
    )


def load_dense_program(bundle: Bundle) -> torch.nn.Module:
    """The dense part as a callable module (``torch.export.load(dense.pt2).module()``)."""
    try:
        program = torch.export.load(bundle.dense_program_path)
    except Exception as err:  # any load failure: name the file
        raise BundleError(
            f"{bundle.dense_program_path}: torch.export.load failed ({type(err).__name__}: "
            f"{err}); torch {bundle.manifest['producer'].get('torch')} wrote it: load it with "
            "that torch (and fbgemm_gpu installed), or re-export the bundle with this one"
        ) from err
    return program.module()


def _check_files(root: Path, manifest: dict[str, Any], verify: bool) -> None:
    for name, info in manifest["files"].items():
        p = root / name
        if not p.is_file():
            raise BundleError(f"{p}: listed in {MANIFEST} but missing; copy the bundle again")
        size = p.stat().st_size
        if size != info["size"]:
            raise BundleError(
                f"{p}: {size} bytes but {MANIFEST} says {info['size']}: the file is truncated "
                "or modified; copy the bundle again or re-export it"
            )
        if verify and sha256(p) != info["sha256"]:
            raise BundleError(
                f"{p}: sha256 checksum mismatch against {MANIFEST}: the file is corrupt or "
                "modified; copy the bundle again or re-export it"
            )


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise BundleError(
            f"{path}: not a readable safetensors file ({err}); it is truncated or corrupt: "
            "copy the bundle again or re-export it"
        ) from None


def _read_entry(
    json_path: Path,
    entry: str,
    info: Any,
    tensors: dict[str, torch.Tensor],
    fs: FeatureSet,
    naming: BundleNaming,
    found: _Tables,
    used: set[str],
) -> None:
    """Check one model-*.json entry against its tensors and fg.json; file it under its table."""
    st_path = json_path.with_suffix(".safetensors")
    where = f"{json_path}: entry {entry!r}"
    required = ["name", "dense", "dimension", "dtype", "shape", "is_hashmap"]
    if not isinstance(info, dict) or any(k not in info for k in required):
        raise BundleError(f"{where}: needs keys {required}, got {info!r}; re-export the bundle")
    if info["is_hashmap"]:
        for k in ("hashmap_key", "hashmap_value", "hashmap_key_dtype"):
            if k not in info:
                raise BundleError(f"{where}: is_hashmap entry lacks {k!r}; re-export the bundle")
    name = info["hashmap_value"] if info["is_hashmap"] else info["name"]
    parsed = _entry_table(where, name, bool(info["is_hashmap"]), fs, naming, found)
    table, spec = parsed.table, fs.tables[parsed.table]
    where = f"{json_path}: table {table!r} entry {entry!r}"
    if info["is_hashmap"] != spec.is_dynamic:
        kind = "dynamic" if spec.is_dynamic else "dense"
        raise BundleError(
            f"{where}: is_hashmap={info['is_hashmap']} but fg.json says {kind}; re-export the "
            "bundle"
        )
    values = _tensor(tensors, name, st_path, where)
    used.add(name)
    rows = int(values.shape[0]) if values.dim() == 2 else -1
    problems = _value_problems(values, info, spec)
    if problems:
        raise BundleError(f"{where}: metadata/shape mismatch: {'; '.join(problems)}; re-export")
    if not spec.is_dynamic:
        if table in found.dense:
            raise BundleError(f"{where}: a second weight for dense table {table!r}; re-export")
        found.dense[table] = values
        return
    keys = _tensor(tensors, info["hashmap_key"], st_path, where)
    used.add(info["hashmap_key"])
    if keys.dtype != torch.int64 or info["hashmap_key_dtype"] != "int64":
        raise BundleError(
            f"{where}: key dtype {keys.dtype} (metadata {info['hashmap_key_dtype']!r}), "
            "expected int64; re-export with int64 keys"
        )
    if list(keys.shape) != [rows]:
        raise BundleError(
            f"{where}: metadata/shape mismatch: keys {list(keys.shape)} for {rows} value rows; "
            "re-export the bundle"
        )
    scores = None
    if "hashmap_score" in info:  # optional: the rows' hotness (shared.bundle.naming)
        scores = _tensor(tensors, info["hashmap_score"], st_path, where)
        used.add(info["hashmap_score"])
        if scores.dtype != torch.int64 or list(scores.shape) != [rows]:
            raise BundleError(
                f"{where}: scores are {scores.dtype} {list(scores.shape)}, expected int64 "
                f"[{rows}]; re-export the bundle"
            )
    table_parts = found.parts.setdefault(table, {})
    if parsed.rank in table_parts or parsed.rank >= parsed.world:
        raise BundleError(
            f"{where}: part {parsed.rank} of {parsed.world} is repeated or out of range; "
            "re-export the bundle"
        )
    table_parts[parsed.rank] = (parsed.world, keys, values, scores)


def _value_problems(values: torch.Tensor, info: dict[str, Any], spec: TableSpec) -> list[str]:
    """How a values/weight tensor disagrees with its entry and fg.json (RTP: float32 only)."""
    rows = int(values.shape[0]) if values.dim() == 2 else -1
    expect = [spec.num_rows if spec.num_rows is not None else rows, spec.dim]
    problems = []
    if values.dtype != torch.float32 or info["dtype"] != "float32":
        problems.append(f"dtype {values.dtype} (metadata {info['dtype']!r}), expected float32")
    if list(values.shape) != info["shape"] or list(values.shape) != expect:
        problems.append(f"shape {list(values.shape)} (metadata {info['shape']}), expected {expect}")
    if info["dimension"] != spec.dim:
        problems.append(f"dimension {info['dimension']}, fg.json says {spec.dim}")
    if "memory" in info and info["memory"] != values.nbytes:
        problems.append(f"memory {info['memory']}, the tensor has {values.nbytes} bytes")
    return problems


def _entry_table(
    where: str, name: Any, hashmap: bool, fs: FeatureSet, naming: BundleNaming, found: _Tables
) -> TensorName:
    """The table a tensor name belongs to, by the bundle's naming; one collection per table."""
    parsed = naming.parse(name, hashmap=hashmap) if isinstance(name, str) else None
    if parsed is None:
        form = naming.values_form if hashmap else naming.weight_form
        raise BundleError(
            f"{where}: tensor name {name!r} is not of the form {form} ({naming.id} naming, "
            f"format_version {naming.format_version} in {MANIFEST}); re-export the bundle"
        )
    if parsed.table not in fs.tables:
        raise BundleError(
            f"{where}: tensor {name!r} is of table {parsed.table!r}, which fg.json does not "
            f"have (tables: {', '.join(fs.tables)}): the bundle mixes two exports, or the "
            "table has another name in the config; re-export the bundle with this config"
        )
    prefix = found.prefixes.setdefault(parsed.table, parsed.prefix)
    if prefix != parsed.prefix:
        raise BundleError(
            f"{where}: table {parsed.table!r} is under two paths, {prefix!r} and "
            f"{parsed.prefix!r}: serving has one table per embedding name (a TorchEasyRec "
            "export keeps a sequence group's tables in a collection of their own); export "
            "the table once"
        )
    return parsed


def _tensor(tensors: dict[str, torch.Tensor], name: str, path: Path, where: str) -> torch.Tensor:
    if name not in tensors:
        raise BundleError(f"{where}: tensor {name!r} is missing from {path}; re-export the bundle")
    return tensors[name]


def _join_parts(
    root: Path, table: str, parts: dict[int, Part]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    worlds = {w for w, _, _, _ in parts.values()}
    world = max(worlds)
    if len(worlds) != 1 or sorted(parts) != list(range(world)):
        raise BundleError(
            f"{root}: table {table!r}: parts {sorted(parts)} with world sizes {sorted(worlds)}; "
            f"expected parts 0..{world - 1} of {world}: a part is missing, re-export the bundle"
        )
    ordered = [parts[r] for r in range(world)]
    with_scores = [sc is not None for _, _, _, sc in ordered]
    if any(with_scores) and not all(with_scores):
        raise BundleError(
            f"{root}: table {table!r}: parts {[r for r, w in enumerate(with_scores) if w]} have "
            "scores and the others not; re-export the bundle"
        )
    scores: torch.Tensor | None = None
    if world == 1:
        keys, values, scores = ordered[0][1], ordered[0][2], ordered[0][3]
    else:
        keys = torch.cat([k for _, k, _, _ in ordered])
        values = torch.cat([v for _, _, v, _ in ordered])
        if all(with_scores):
            scores = torch.cat([sc for _, _, _, sc in ordered if sc is not None])
    check_unique(table, keys, str(root))
    return keys, values, scores


def _check_summary(
    root: Path,
    manifest: dict[str, Any],
    dense: dict[str, torch.Tensor],
    hashes: dict[str, tuple[torch.Tensor, torch.Tensor]],
    parts: Parts,
) -> None:
    """manifest["tables"] must describe exactly the tensors read."""
    found = {
        **{
            t: {
                "is_hashmap": False,
                "dimension": int(w.shape[1]),
                "rows": int(w.shape[0]),
                "parts": 1,
            }
            for t, w in dense.items()
        },
        **{
            t: {
                "is_hashmap": True,
                "dimension": int(v.shape[1]),
                "rows": int(v.shape[0]),
                "parts": len(parts[t]),
            }
            for t, (_, v) in hashes.items()
        },
    }
    for t in sorted(set(found) | set(manifest["tables"])):
        if manifest["tables"].get(t) != found.get(t):
            raise BundleError(
                f"{root / MANIFEST}: table {t!r}: manifest says {manifest['tables'].get(t)}, "
                f"the tensors say {found.get(t)}; re-export the bundle"
            )
