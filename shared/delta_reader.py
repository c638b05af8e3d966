"""Reading a delta directory (:mod:`shared.delta` for the format): every field checked first.

A delta comes from outside the server's process, so :func:`read_delta` trusts nothing in it:
each manifest field it uses is checked for its JSON type, range and form (ids, sha256 digests);
``files`` may list only the delta's own two files, each a regular file inside the directory
(an absolute path, ``..`` or a symlink out is refused before anything is opened there), with
its size and checksum; the tensors of every table must have the dtypes and shapes the manifest
implies (unique keys, finite values, rows in range), and no tensor may belong to no table. A
defect is a :class:`shared.delta.DeltaError` naming the field and saying what to do, never an
exception of the JSON or tensor code. Example::

    delta = read_delta("exports/deltas/step-2000")
    delta = read_delta(path, label="delta 'step-2000'")   # messages name it so, not by path
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shared.bundle.layout import DIGEST_RE, sha256
from shared.delta import (
    DELTA_FORMAT,
    DELTA_FORMAT_VERSION,
    DELTA_FORMAT_VERSIONS,
    DELTA_ID_RE,
    DELTA_MANIFEST,
    DELTA_PROGRAM,
    DELTA_TENSORS,
    Delta,
    DeltaError,
    TableDelta,
)

_MAX_MANIFEST_BYTES = 16 << 20
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT32_MAX = (1 << 32) - 1
_JSON_KINDS = {str: "a string", bool: "true or false", dict: "an object", list: "a list"}


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _get(obj: Any, key: str, kind: type, where: str) -> Any:
    """``obj[key]``, checked to be a ``kind`` (JSON types; for ``int`` a bool does not count)."""
    if not isinstance(obj, dict):
        raise DeltaError(f"{where}: {_show(obj)} is not a JSON object; re-export the delta")
    if key not in obj:
        raise DeltaError(f"{where}: key {key!r} is missing; re-export the delta")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = _JSON_KINDS.get(kind, "an integer")
        raise DeltaError(
            f"{where}: {key!r} is {_show(value)}, expected {expected}; re-export the delta"
        )
    return value


def _count(obj: Any, key: str, where: str, lo: int = 0, hi: int = _INT64[1]) -> int:
    value: int = _get(obj, key, int, where)
    if not lo <= value <= hi:
        raise DeltaError(f"{where}: {key!r} is {value}, expected {lo}..{hi}; re-export the delta")
    return value


def check_summaries(summaries: Any, where: str) -> dict[str, Any]:
    """``table_summaries`` of a delta or bundle manifest (:mod:`shared.hashtable.summary`),
    checked in every field ``InspectTables`` reads (all optional): ``score_strategy`` a string,
    ``score_histogram`` of ``{lower, upper, count}``, ``top_keys`` of ``{key, score}`` (int64),
    ``admission`` null or ``{threshold, pending, pending_by_count}``. DeltaError otherwise."""
    if not isinstance(summaries, dict):
        raise DeltaError(f"{where}: {_show(summaries)} is not a JSON object; re-export the delta")
    for table, s in summaries.items():
        sw = f"{where}[{table!r}]"
        if not isinstance(s, dict):
            raise DeltaError(f"{sw}: {_show(s)} is not a JSON object; re-export the delta")
        if "score_strategy" in s:
            _get(s, "score_strategy", str, sw)
        for i, b in enumerate(
            _get(s, "score_histogram", list, sw) if "score_histogram" in s else []
        ):
            for key in ("lower", "upper"):
                _count(b, key, f"{sw}.score_histogram[{i}]", *_INT64)
            _count(b, "count", f"{sw}.score_histogram[{i}]")
        for i, k in enumerate(_get(s, "top_keys", list, sw) if "top_keys" in s else []):
            for key in ("key", "score"):
                _count(k, key, f"{sw}.top_keys[{i}]", *_INT64)
        if s.get("admission") is not None:
            adm = _get(s, "admission", dict, sw)
            _count(adm, "threshold", f"{sw}.admission", hi=_UINT32_MAX)
            _count(adm, "pending", f"{sw}.admission")
            pending = _get(adm, "pending_by_count", dict, f"{sw}.admission")
            for count in pending:
                _count(pending, count, f"{sw}.admission.pending_by_count")
    return summaries


def _manifest(root: Path, where: str) -> dict[str, Any]:
    path = root / DELTA_MANIFEST
    where = f"{where}: {DELTA_MANIFEST}"
    try:
        if os.path.realpath(path) != os.path.join(os.path.realpath(root), DELTA_MANIFEST):
            raise DeltaError(f"{where}: a symlink; a delta's files are its own: copy it again")
        if not path.is_file():
            raise DeltaError(f"{where}: missing: not a delta directory, or its export did not end")
        if path.stat().st_size > _MAX_MANIFEST_BYTES:
            raise DeltaError(f"{where}: over {_MAX_MANIFEST_BYTES >> 20} MiB: not a delta manifest")
        m = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise DeltaError(f"{where}: cannot read it ({err.strerror})") from None
    except (ValueError, RecursionError) as err:  # JSON, UTF-8, nesting
        raise DeltaError(f"{where}: not valid JSON ({err}); re-export the delta") from None
    if not isinstance(m, dict):
        raise DeltaError(f"{where}: {_show(m)} is not a JSON object; re-export the delta")
    fmt, version = m.get("format"), m.get("format_version")
    if fmt != DELTA_FORMAT or type(version) is not int or version not in DELTA_FORMAT_VERSIONS:
        raise DeltaError(
            f"{where}: format {_show(fmt)} version {_show(version)}; expected {DELTA_FORMAT!r} "
            f"version {' or '.join(map(str, DELTA_FORMAT_VERSIONS))}: not a delta of a format "
            "this server knows (re-export it, or update the server)"
        )
    if not DELTA_ID_RE.match(_get(m, "delta_id", str, where)):
        raise DeltaError(
            f"{where}: delta_id {_show(m['delta_id'])}: not 1-64 of A-Z a-z 0-9 . _ : -; "
            "re-export the delta with another --id"
        )
    base = _get(m, "base", dict, where)
    _get(base, "version", str, f"{where}: base")
    for obj, key, w in (
        (base, "manifest_digest", f"{where}: base"),
        (base, "config_digest", f"{where}: base"),
        (m, "config_digest", where),
    ):
        if not DIGEST_RE.match(_get(obj, key, str, w)):
            raise DeltaError(
                f"{w}: {key!r} is {_show(obj[key])}, not a sha256 hex digest; re-export the delta"
            )
    _get(m, "target_version", str, where)
    if "event_time" in m:
        _count(m, "event_time", where)
    if version != DELTA_FORMAT_VERSION and not _get(m, "dense_program", bool, where):
        raise DeltaError(
            f"{where}: format_version {version} (a dense program taking the pairs) but "
            "'dense_program' is false; re-export the delta"
        )
    _get(m, "dense_program", bool, where)
    _get(m, "tables", dict, where)
    _get(m, "files", dict, where)
    check_summaries(_get(m, "table_summaries", dict, where), f"{where}: table_summaries")
    return m


def _check_files(root: Path, m: dict[str, Any], where: str, verify: bool) -> None:
    """Exactly the delta's own files, each a regular file in ``root`` with its size and sha256:
    the manifest never makes the reader touch another path (no '/', '..', symlinks out)."""
    fw = f"{where}: {DELTA_MANIFEST}: files"
    files: dict[str, Any] = m["files"]
    for name in files:
        if name not in (DELTA_TENSORS, DELTA_PROGRAM):
            raise DeltaError(
                f"{fw}: {_show(name)} is not a file of a delta ({DELTA_TENSORS}, {DELTA_PROGRAM})"
                "; paths (absolute, with '/' or '..') are never read: re-export the delta"
            )
    expected = {DELTA_TENSORS, DELTA_PROGRAM} if m["dense_program"] else {DELTA_TENSORS}
    if set(files) != expected:
        raise DeltaError(
            f"{fw}: lists {sorted(files)}, expected {sorted(expected)} (dense_program: "
            f"{str(m['dense_program']).lower()}); re-export the delta"
        )
    real_root = os.path.realpath(root)
    for name, info in files.items():
        size = _count(info, "size", f"{fw}[{name!r}]")
        digest = _get(info, "sha256", str, f"{fw}[{name!r}]")
        p = root / name
        try:
            if os.path.dirname(os.path.realpath(p)) != real_root or not p.is_file():
                raise DeltaError(
                    f"{where}: {name}: missing or not a regular file of the delta directory "
                    "(a symlink out of it does not count); copy the delta again"
                )
            actual = p.stat().st_size
            if actual != size:
                raise DeltaError(
                    f"{where}: {name}: {actual} bytes, the manifest says {size}: truncated or "
                    "modified; copy the delta again"
                )
            if verify and sha256(p) != digest:
                raise DeltaError(
                    f"{where}: {name}: sha256 mismatch against the manifest; copy the delta again"
                )
        except OSError as err:
            raise DeltaError(f"{where}: {name}: cannot read it ({err.strerror})") from None


def _load_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as err:
        raise DeltaError(
            f"{where}: {DELTA_TENSORS}: not a readable safetensors file ({err}); it is truncated "
            "or corrupt: copy the delta again or re-export it"
        ) from None


def _tensor(
    tensors: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype, shape: list[int], where: str
) -> torch.Tensor:
    """``tensors[key]`` of ``dtype`` and ``shape`` (-1: any size), else DeltaError."""
    if key not in tensors:
        raise DeltaError(f"{where}: tensor {key!r} is missing; re-export the delta")
    x = tensors[key]
    fits = x.dim() == len(shape) and all(s in (-1, a) for s, a in zip(shape, x.shape, strict=False))
    if x.dtype != dtype or not fits:
        want = "[" + ", ".join("N" if s == -1 else str(s) for s in shape) + "]"
        raise DeltaError(
            f"{where}: tensor {key!r} is {x.dtype} {list(x.shape)}, expected {dtype} {want}; "
            "re-export the delta"
        )
    return x


def _unique(x: torch.Tensor, key: str, where: str) -> None:
    if torch.unique(x).numel() != x.numel():
        raise DeltaError(f"{where}: tensor {key!r} repeats keys; re-export the delta")


def _finite(x: torch.Tensor, key: str, where: str) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise DeltaError(
            f"{where}: tensor {key!r} holds NaN or infinite values; re-export the delta"
        )


def _table(name: str, c: Any, tensors: Mapping[str, torch.Tensor], where: str) -> TableDelta:
    """One entry of the manifest's ``tables`` with its tensors, every field checked."""
    cw = f"{where}: {DELTA_MANIFEST}: tables[{name!r}]"
    tw = f"{where}: {DELTA_TENSORS}: table {name!r}"
    hashmap: bool = _get(c, "is_hashmap", bool, cw)
    dim = _count(c, "dimension", cw, lo=1)
    t = TableDelta(name, hashmap, dim, _count(c, "base_rows", cw), _count(c, "target_rows", cw))
    if hashmap:
        k, v, e = (f"{name}.upsert_keys", f"{name}.upsert_values", f"{name}.evict_keys")
        t.upsert_keys = _tensor(tensors, k, torch.int64, [-1], tw)
        n = int(t.upsert_keys.numel())
        t.upsert_values = _tensor(tensors, v, torch.float32, [n, dim], tw)
        t.evict_keys = _tensor(tensors, e, torch.int64, [-1], tw)
        t.new = _count(c, "new", cw, hi=n)
        _unique(t.upsert_keys, k, tw)
        _unique(t.evict_keys, e, tw)
        _finite(t.upsert_values, v, tw)
        return t
    r, v = f"{name}.rows", f"{name}.row_values"
    t.rows = _tensor(tensors, r, torch.int64, [-1], tw)
    t.row_values = _tensor(tensors, v, torch.float32, [int(t.rows.numel()), dim], tw)
    if t.base_rows != t.target_rows:
        raise DeltaError(f"{cw}: a dense table keeps its rows: base_rows != target_rows")
    if t.rows.numel() and (int(t.rows.min()) < 0 or int(t.rows.max()) >= t.target_rows):
        raise DeltaError(
            f"{tw}: tensor {r!r} has rows outside 0..{t.target_rows - 1}; re-export the delta"
        )
    _unique(t.rows, r, tw)
    _finite(t.row_values, v, tw)
    return t


def read_delta(
    path: str | os.PathLike[str], *, verify_checksums: bool = True, label: str = ""
) -> Delta:
    """Read and check a delta directory: every manifest field it uses (types, ranges, digests),
    its files (exactly ``delta.safetensors`` and ``dense.pt2`` when ``dense_program``, inside
    the directory, sizes and checksums) and its tensors (each table's dtypes, shapes, unique
    keys, finite values; no tensor of no table). Any defect raises :class:`DeltaError`, whose
    message names the delta by ``label`` when given (the server: the request's path), else by
    its path, then the file and field, and says what to do. The dense program is checked by
    loading it (:mod:`serve.delta`)."""
    root = Path(path)
    where = label or str(root)
    if not root.is_dir():
        raise DeltaError(f"{where}: no such delta directory (the server reads its own filesystem)")
    m = _manifest(root, where)
    _check_files(root, m, where, verify_checksums)
    tensors = _load_tensors(root / DELTA_TENSORS, where)
    tables = {name: _table(name, c, tensors, where) for name, c in m["tables"].items()}
    unused = set(tensors) - {key for t in tables.values() for key in t.tensors()}
    if unused:
        raise DeltaError(
            f"{where}: {DELTA_TENSORS}: tensors {sorted(unused)[:4]} belong to no table of the "
            "manifest; re-export the delta"
        )
    return Delta(
        path=root,
        delta_id=m["delta_id"],
        base_version=m["base"]["version"],
        base_digest=m["base"]["manifest_digest"],
        config_digest=m["config_digest"],
        target_version=m["target_version"],
        tables=tables,
        dense_program_path=root / DELTA_PROGRAM if m["dense_program"] else None,
        manifest=m,
        format_version=m["format_version"],
        label=label,
        event_time=m.get("event_time"),
    )
