"""Write a bundle atomically: temp directory beside the destination, manifest last, one rename."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import time
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import save_file

from shared.bundle.layout import (
    BUNDLE_FORMAT,
    DEFAULT_MAX_SHARD_BYTES,
    DENSE_PROGRAM,
    DIGEST_RE,
    FG_JSON,
    MANIFEST,
    VERSION_RE,
    BundleError,
    check_unique,
    sha256,
    write_json,
)
from shared.bundle.naming import TZREC_NAMING, BundleNaming, format_version, is_shard_file
from shared.dense_inputs import Signature, program_input_names, signature_of
from shared.features import FeatureSet, TableSpec
from shared.fg_spec import feature_set_to_dict
from shared.stale_dirs import remove_stale_dirs

# one rank part of a dynamic table: (keys [N] int64, values [N, dim] float32), with or without
# the rows' scores (int64 [N], larger is hotter)
HashPart = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# write_bundle's temp dirs (".<out name>.tmp-<12 hex>"); never ".old-" ones, which may hold the
# only copy of a bundle when a swap was killed between its two renames
_TEMP_DIR = re.compile(r"^\..+\.tmp-[0-9a-f]{12}$")


@dataclass
class _Group:
    """Tensors that must share a shard (a dense weight, or one keys/values part) and their entry."""

    table: str
    entry: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def write_bundle(
    out_dir: str | os.PathLike[str],
    *,
    dense_tables: Mapping[str, torch.Tensor],
    hash_tables: Mapping[str, Sequence[HashPart]],
    feature_set: FeatureSet,
    dense_program_path: str | os.PathLike[str],
    config_digest: str,
    version: str | None = None,
    extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    naming: BundleNaming = TZREC_NAMING,
    program_inputs: Signature | None = None,
) -> Path:
    """Write a complete bundle to ``out_dir`` atomically and return its path.

    ``hash_tables[t]`` holds one ``(keys, values)`` pair per rank part (part R of W = len), or
    ``(keys, values, scores)`` with the rows' hotness (int64 [N], larger is hotter: the
    training table's scores; :mod:`shared.bundle.naming`), for every part or none. Every
    table of ``feature_set`` must be given, dense ones in ``dense_tables``, dynamic ones in
    ``hash_tables``. ``version`` defaults to the UTC creation time (``20250101T120000Z``).
    An existing bundle at ``out_dir`` is replaced only with ``overwrite=True``. ``naming``
    names the files and tensors (:mod:`shared.bundle.naming`): TorchEasyRec's RTP export names
    (format 2, the default) or ``DYNREC_NAMING`` (format 1, for servers that predate format 2);
    a dense program that takes the pair inputs makes a format 2 bundle format 3, one that
    also takes the cold masks format 4
    (:func:`shared.bundle.naming.format_version`). ``program_inputs``: the program's signature
    when the caller holds the program (``signature_of(program_input_names(program))``); None:
    read from the file (a ``torch.export.load``, 0.4 s of a full export on CPU).
    """
    out, program = Path(out_dir), Path(dense_program_path)
    created = time.gmtime()
    version = version if version is not None else time.strftime("%Y%m%dT%H%M%SZ", created)
    _check_arguments(version, config_digest, program, max_shard_bytes)
    extra_json = _jsonable(dict(extra or {}), "extra")
    signature = program_inputs if program_inputs is not None else program_signature(program)
    fmt = format_version(naming, signature)
    groups = _table_groups(feature_set, dense_tables, hash_tables, naming)
    check_destination(out, overwrite=overwrite)

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_dirs(out.parent, _TEMP_DIR)  # temp dirs of killed writes (older than us)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        shards = _write_shards(tmp, _pack(groups, max_shard_bytes), naming)
        write_json(tmp / FG_JSON, feature_set_to_dict(feature_set))
        shutil.copyfile(program, tmp / DENSE_PROGRAM)
        _fsync_file(tmp / DENSE_PROGRAM)
        files = {
            p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(tmp.iterdir())
        }
        manifest = {
            "format": BUNDLE_FORMAT,
            "format_version": fmt,
            **naming.manifest_fields(),
            "version": version,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", created),
            "config_digest": config_digest,
            "producer": {"torch": torch.__version__, "safetensors": safetensors.__version__},
            "shards": shards,
            "tables": _table_summary(groups),
            "extra": extra_json,
            "files": files,
        }
        write_json(tmp / MANIFEST, manifest)  # last: its presence marks a complete bundle
        _fsync_dir(tmp)
        _swap_in(tmp, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_arguments(version: str, digest: str, program: Path, max_shard_bytes: int) -> None:
    if not VERSION_RE.match(version):
        raise BundleError(
            f"version {version!r} must be 1-128 characters of A-Z a-z 0-9 . _ : + - "
            "(it names the model in serving metrics and file names); choose another "
            "(export --version)"
        )
    if not DIGEST_RE.match(digest):
        raise BundleError(
            f"config_digest {digest!r} is not a sha256 hex digest; pass "
            "shared.config.config_digest(config)"
        )
    if not program.is_file() or not zipfile.is_zipfile(program):
        raise BundleError(
            f"dense_program_path {program} is not a torch.export archive; write it with "
            "torch.export.save(program, path)"
        )
    if max_shard_bytes < 1:
        raise BundleError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")


def program_signature(program: Path) -> Signature:
    """The inputs the torch.export archive ``program`` takes (its bundle format follows)."""
    try:
        names = program_input_names(torch.export.load(program))
    except Exception as err:  # any load failure: name the file
        raise BundleError(
            f"dense_program_path {program}: torch.export.load failed ({type(err).__name__}: "
            f"{err}); write it with torch.export.save(program, path) with this torch"
        ) from err
    try:
        return signature_of(names)
    except ValueError as err:
        raise BundleError(f"dense_program_path {program}: {err}") from None


def _table_groups(
    fs: FeatureSet,
    dense_tables: Mapping[str, torch.Tensor],
    hash_tables: Mapping[str, Sequence[HashPart]],
    naming: BundleNaming,
) -> list[_Group]:
    """Validate the inputs against ``fs`` and turn them into shard groups, in ``fs`` table order."""
    for name in [*dense_tables, *hash_tables]:
        if name not in fs.tables:
            raise BundleError(
                f"table {name!r} is not in the FeatureSet (tables: {', '.join(fs.tables)}); "
                "export only the tables of the config"
            )
    groups: list[_Group] = []
    for t in fs.tables.values():
        naming.check_table(t.name)
        if t.is_dynamic:
            if t.name in dense_tables:
                raise BundleError(
                    f"table {t.name!r} is dynamic; pass it in hash_tables as [(keys, values), ...]"
                )
            if t.name not in hash_tables:
                raise BundleError(f"dynamic table {t.name!r} is missing from hash_tables")
            groups.extend(_hash_groups(t, hash_tables[t.name], naming))
        else:
            if t.name in hash_tables:
                raise BundleError(
                    f"table {t.name!r} has num_rows={t.num_rows} (not dynamic); pass its "
                    "[rows, dim] weight in dense_tables"
                )
            if t.name not in dense_tables:
                raise BundleError(f"dense table {t.name!r} is missing from dense_tables")
            groups.append(_dense_group(t, dense_tables[t.name], naming))
    return groups


def _dense_group(t: TableSpec, weight: torch.Tensor, naming: BundleNaming) -> _Group:
    w = _cpu(weight)
    if w.dtype != torch.float32 or tuple(w.shape) != (t.num_rows, t.dim):
        raise BundleError(
            f"table {t.name!r}: weight is {w.dtype} {list(w.shape)}, expected float32 "
            f"[{t.num_rows}, {t.dim}] (num_rows, embedding_dim of the config); export with "
            "the config the model was trained with"
        )
    name = naming.weight_name(t.name)
    return _Group(t.name, name, {name: w}, _entry_meta(name, w, None))


def _hash_groups(t: TableSpec, parts: Sequence[HashPart], naming: BundleNaming) -> list[_Group]:
    if isinstance(parts, tuple) and len(parts) in (2, 3) and isinstance(parts[0], torch.Tensor):
        raise BundleError(
            f"table {t.name!r}: hash_tables values are a list of (keys, values) parts, one per "
            "rank; wrap a single pair as [(keys, values)]"
        )
    world = len(parts)
    if world < 1:
        raise BundleError(f"table {t.name!r}: no parts; pass at least one (keys, values) pair")
    groups: list[_Group] = []
    all_keys: list[torch.Tensor] = []
    with_scores = {len(part) == 3 for part in parts if isinstance(part, (tuple, list))}
    if len(with_scores) > 1:
        raise BundleError(
            f"table {t.name!r}: some parts have scores and some do not; pass (keys, values, "
            "scores) for every part or for none"
        )
    for rank, part in enumerate(parts):
        where = f"table {t.name!r} part {rank} of {world}"
        if not (isinstance(part, (tuple, list)) and len(part) in (2, 3)):
            raise BundleError(
                f"{where}: expected a (keys, values) pair or (keys, values, scores), got "
                f"{type(part).__name__}"
            )
        keys, values = _cpu(part[0]), _cpu(part[1])
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise BundleError(
                f"{where}: keys are {keys.dtype} {list(keys.shape)}, expected int64 [N]; "
                "convert with keys.to(torch.int64)"
            )
        if values.dtype != torch.float32 or tuple(values.shape) != (keys.numel(), t.dim):
            raise BundleError(
                f"{where}: values are {values.dtype} {list(values.shape)}, expected float32 "
                f"[{keys.numel()}, {t.dim}] (one row of embedding_dim per key); export with the "
                "config the model was trained with"
            )
        kname = naming.keys_name(t.name, rank, world)
        vname = naming.values_name(t.name, rank, world)
        meta = _entry_meta(vname, values, kname)
        tensors = {kname: keys, vname: values}
        if len(part) == 3:
            scores = _cpu(part[2])
            if scores.dtype != torch.int64 or tuple(scores.shape) != (keys.numel(),):
                raise BundleError(
                    f"{where}: scores are {scores.dtype} {list(scores.shape)}, expected int64 "
                    f"[{keys.numel()}] (one per key, larger is hotter)"
                )
            sname = naming.scores_name(t.name, rank, world)
            tensors[sname] = scores
            meta["hashmap_score"] = sname
        groups.append(_Group(t.name, vname, tensors, meta))
        all_keys.append(keys)
    check_unique(t.name, torch.cat(all_keys), "hash_tables")
    return groups


def _entry_meta(name: str, values: torch.Tensor, key_name: str | None) -> dict[str, Any]:
    """One entry of model-*.json, field for field as tzrec's RTP exporter writes it (dense
    weights: ``is_hashmap`` false and no ``hashmap_*`` keys)."""
    meta: dict[str, Any] = {
        "name": name,
        "dense": False,
        "dimension": int(values.shape[-1]),
        "dtype": "float32",
        "memory": values.numel() * values.element_size(),
        "shape": list(values.shape),
    }
    if key_name is None:
        meta["is_hashmap"] = False
    else:
        meta.update(
            hashmap_value=name, hashmap_key=key_name, hashmap_key_dtype="int64", is_hashmap=True
        )
    return meta


def _table_summary(groups: list[_Group]) -> dict[str, dict[str, Any]]:
    """manifest["tables"]: per table kind, dim, total rows and part count (serving sizes by it)."""
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        s = out.setdefault(
            g.table,
            {
                "is_hashmap": g.meta["is_hashmap"],
                "dimension": g.meta["dimension"],
                "rows": 0,
                "parts": 0,
            },
        )
        s["rows"] += g.meta["shape"][0]
        s["parts"] += 1
    return out


def _pack(groups: list[_Group], max_bytes: int) -> list[list[_Group]]:
    """Greedy shards of at most ``max_bytes`` (a bigger group gets a shard of its own)."""
    shards: list[list[_Group]] = [[]]
    size = 0
    for g in groups:
        if shards[-1] and size + g.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    return shards


def _write_shards(tmp: Path, shards: list[list[_Group]], naming: BundleNaming) -> list[str]:
    stems = []
    for i, groups in enumerate(shards):
        stem = naming.shard_stem(i, len(shards))
        tensors = {n: t for g in groups for n, t in g.tensors.items()}
        path = tmp / f"{stem}.safetensors"
        save_file(tensors, path, metadata={"format": "pt"})
        _fsync_file(path)
        write_json(tmp / f"{stem}.json", {g.entry: g.meta for g in groups})
        stems.append(stem)
    return stems


def _destination_state(out: Path) -> str:
    """absent | empty | bundle | partial; refuses a directory that is not a bundle at all."""
    if not out.exists():
        return "absent"
    if not out.is_dir():
        raise BundleError(f"{out} exists and is not a directory; choose another --out")
    names = [p.name for p in out.iterdir()]
    if not names:
        return "empty"
    if MANIFEST in names:
        return "bundle"
    foreign = [n for n in names if n not in (FG_JSON, DENSE_PROGRAM) and not is_shard_file(n)]
    if foreign:
        raise BundleError(
            f"{out} is not a bundle directory (it holds {foreign[0]!r}); refusing to replace it "
            "even with --overwrite: choose another --out or remove it yourself"
        )
    return "partial"


def check_destination(out_dir: str | os.PathLike[str], *, overwrite: bool) -> None:
    """Raise BundleError if :func:`write_bundle` to ``out_dir`` would refuse it: a bundle (or
    an incomplete one) there without ``overwrite``, or a directory that is not a bundle's.
    Cheap, so exporters call it before the expensive part."""
    out = Path(out_dir)
    state = _destination_state(out)
    if state in ("bundle", "partial") and not overwrite:
        what = "a bundle" if state == "bundle" else "an incomplete bundle (no manifest.json)"
        raise BundleError(
            f"{out} already holds {what}; pass --overwrite to replace it, or choose another --out"
        )


def _swap_in(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Move the finished ``tmp`` to ``out``; an old bundle there is exchanged atomically."""
    try:
        os.rename(tmp, out)  # absent or empty destination: one atomic rename
        _fsync_dir(out.parent)
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if not overwrite:  # checked before writing; something else wrote there meanwhile
        raise BundleError(
            f"{out} was filled while this bundle was written; pass --overwrite to replace it"
        )
    if not _exchange(tmp, out):  # no renameat2: two renames, `out` briefly absent, never half
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        tmp = old
    _fsync_dir(out.parent)
    shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous bundle


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _cpu(x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise BundleError(f"expected a torch.Tensor, got {type(x).__name__}")
    t: torch.Tensor = x.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # a view of a larger buffer: safetensors refuses shared storage
    return t


def _jsonable(value: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        copy: dict[str, Any] = json.loads(json.dumps(value, allow_nan=False))
        return copy
    except (TypeError, ValueError) as err:
        raise BundleError(
            f"{what} must be JSON-serializable (str/int/float/list/dict): {err}"
        ) from None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
