"""Delta updates of a bundle: only the rows that changed since a base bundle, and their merge.

``train/`` writes a delta (:func:`diff_tables` + :func:`write_delta`, ``python -m train.tools
delta-export``); ``serve/`` reads it (:func:`shared.delta_reader.read_delta`, which checks
every field, file and tensor before use) and rebuilds its tables as base + delta
(:func:`apply_delta_tables`, which checks the delta against the base). Layout of a delta
directory (the manifest's ``files`` names the other two; a reader opens no other path)::

    delta.safetensors   per dynamic table T: "T.upsert_keys" int64 [n] (new and updated keys),
                        "T.upsert_values" float32 [n, dim], "T.evict_keys" int64 [e] (keys of the
                        base no longer in the table); per dense table T: "T.rows" int64 [r]
                        (changed row indices), "T.row_values" float32 [r, dim]
    dense.pt2           the dense program, only when its weights changed
    manifest.json       format and format_version, delta id, base (version, manifest digest, config digest), target
                        version, per-table counts (new, updated, evicted, rows; base and target
                        row counts), table summaries, size + sha256 of every other file;
                        optionally ``event_time`` (int, Unix seconds: the newest row trained
                        into it, written by online training, :mod:`train.stream`); written last

``evict_keys`` are the tombstones: keys of the base that the trainer no longer holds (evicted,
or never admitted past the base); a key added after the base and evicted since is simply absent
from the upserts.

``format_version`` is 1, :data:`COLD_PROGRAM_DELTA_FORMAT` (3) when the delta's ``dense.pt2``
takes the cold masks too (as a bundle of format 4 does), or :data:`PAIR_PROGRAM_DELTA_FORMAT` (2)
when it takes the (candidate, element) pairs as inputs (as a bundle of format 3 does,
:mod:`shared.bundle.naming`): a server that predates pair programs knows only version 1, so it
refuses such a delta instead of failing in warm-up; a delta without a program, or with one
without the pairs, stays version 1 (any server applies it). :func:`write_delta` tells the
version from the program it is given.

A delta is always relative to its **base bundle** (not to an earlier delta): applying delta 3 to a
server that runs base + delta 2 rebuilds from base + delta 3. So deltas need not be applied in
order or all of them, a lost delta costs nothing, and a key added by delta 2 and evicted since is
gone (a chain of incremental deltas would need every link). The price: a delta grows with the
rows changed since its base; publish a new full bundle when it gets large. Writing is atomic
(temporary directory beside the destination, manifest last, one rename). Example::

    tables = diff_tables(base.dense_tables, base.hash_tables, new_dense, new_hash)
    write_delta(out, tables=tables, base_manifest=base.manifest, delta_id="step-2000", ...)
    delta = read_delta(out)          # shared.delta_reader; DeltaError names file, field and fix
    dense, hashed = apply_delta_tables(base.dense_tables, base.hash_tables, delta)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from shared.bundle.layout import BundleError, sha256, write_json
from shared.bundle.writer import program_signature
from shared.dense_inputs import Signature

DELTA_FORMAT = "dynrec-delta"
DELTA_FORMAT_VERSION = 1  # no dense program, or one without the pair inputs
PAIR_PROGRAM_DELTA_FORMAT = 2  # its dense.pt2 takes the pairs (a format 3 bundle's program)
COLD_PROGRAM_DELTA_FORMAT = 3  # ... the pairs and the cold masks (a format 4 bundle's program)
DELTA_FORMATS = {
    Signature.PLAIN: DELTA_FORMAT_VERSION,
    Signature.PAIRS: PAIR_PROGRAM_DELTA_FORMAT,
    Signature.COLD: COLD_PROGRAM_DELTA_FORMAT,
}
DELTA_FORMAT_VERSIONS = tuple(DELTA_FORMATS.values())
DELTA_TENSORS = "delta.safetensors"
DELTA_PROGRAM = "dense.pt2"
DELTA_MANIFEST = "manifest.json"
DELTA_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")  # no "+": it joins base and delta ids


class DeltaError(ValueError):
    """A delta that cannot be written, read or applied; the message names the file and fix."""


@dataclass
class TableDelta:
    """The change of one table. Dynamic: upserts and evictions; dense: changed rows."""

    name: str
    is_hashmap: bool
    dim: int
    base_rows: int  # rows (dense) or keys (dynamic) of the base
    target_rows: int  # ... after the delta
    upsert_keys: torch.Tensor | None = None  # [n] int64
    upsert_values: torch.Tensor | None = None  # [n, dim] float32
    evict_keys: torch.Tensor | None = None  # [e] int64
    new: int = 0  # upserted keys absent from the base
    rows: torch.Tensor | None = None  # [r] int64 (dense)
    row_values: torch.Tensor | None = None  # [r, dim] float32 (dense)

    @property
    def updated(self) -> int:
        return 0 if self.upsert_keys is None else int(self.upsert_keys.numel()) - self.new

    @property
    def evicted(self) -> int:
        return 0 if self.evict_keys is None else int(self.evict_keys.numel())

    @property
    def changed_rows(self) -> int:
        return 0 if self.rows is None else int(self.rows.numel())

    def counts(self) -> dict[str, Any]:
        return {
            "is_hashmap": self.is_hashmap,
            "dimension": self.dim,
            "base_rows": self.base_rows,
            "target_rows": self.target_rows,
            "new": self.new,
            "updated": self.updated,
            "evicted": self.evicted,
            "rows": self.changed_rows,
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.is_hashmap:
            assert self.upsert_keys is not None and self.upsert_values is not None
            assert self.evict_keys is not None
            return {
                f"{self.name}.upsert_keys": self.upsert_keys,
                f"{self.name}.upsert_values": self.upsert_values,
                f"{self.name}.evict_keys": self.evict_keys,
            }
        assert self.rows is not None and self.row_values is not None
        return {f"{self.name}.rows": self.rows, f"{self.name}.row_values": self.row_values}


@dataclass
class Delta:
    """A validated delta directory (tensors loaded, dense program left on disk)."""

    path: Path
    delta_id: str
    base_version: str
    base_digest: str
    config_digest: str
    target_version: str
    tables: dict[str, TableDelta]
    dense_program_path: Path | None
    manifest: dict[str, Any] = field(repr=False)
    format_version: int = DELTA_FORMAT_VERSION  # its program's signature (DELTA_FORMATS)
    label: str = ""  # how messages name the delta ("": by its path); the server: request path
    event_time: int | None = None  # Unix seconds of the newest row trained into it (None: unsaid)

    @property
    def program_signature(self) -> Signature:
        """The inputs the delta's dense program takes (its format version says)."""
        return {v: s for s, v in DELTA_FORMATS.items()}[self.format_version]

    @property
    def where(self) -> str:
        return self.label or str(self.path)

    @property
    def summaries(self) -> dict[str, Any]:
        return dict(self.manifest.get("table_summaries", {}))


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of a bundle manifest's content (canonical JSON): names one exact bundle (the
    manifest holds the checksum of every bundle file), whatever its directory."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------- diff


def _bits(x: torch.Tensor) -> np.ndarray:
    """float32 rows as int32 bit patterns: equality is exact (NaN == NaN, -0 != 0)."""
    return np.ascontiguousarray(x.detach().cpu().numpy().astype(np.float32)).view(np.int32)


def _diff_hash(
    name: str, base: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]
) -> TableDelta:
    kb, vb = base[0].cpu().numpy(), base[1]
    kn, vn = new[0].cpu().numpy(), new[1]
    order = np.argsort(kb, kind="stable")
    kb_sorted = kb[order]
    pos = np.searchsorted(kb_sorted, kn).clip(max=max(kb.size - 1, 0))
    in_base = (kb_sorted[pos] == kn) if kb.size else np.zeros(kn.size, bool)
    base_row = order[pos] if kb.size else np.zeros(kn.size, np.int64)  # an empty base table
    changed = np.ones(kn.size, bool)  # new keys always go in
    common = np.flatnonzero(in_base)
    if common.size:
        a = _bits(vn[torch.from_numpy(common)])
        b = _bits(vb[torch.from_numpy(base_row[common])])
        changed[common] = (a != b).any(axis=1)
    upsert = np.flatnonzero(changed)
    # base keys absent from the new ones, as np.isin finds them but with one sort of the new
    # keys (stable: a few ms when they come sorted, as a checkpoint's do) instead of sorting
    # both tables again
    kn_sorted = kn[np.argsort(kn, kind="stable")]
    at = np.searchsorted(kn_sorted, kb).clip(max=max(kn.size - 1, 0))
    evict = kb[~(kn_sorted[at] == kb)] if kn.size else kb
    new_first = upsert[np.argsort(in_base[upsert], kind="stable")]  # new keys, then updated
    idx = torch.from_numpy(new_first)
    return TableDelta(
        name,
        True,
        int(vn.shape[1]),
        int(kb.size),
        int(kn.size),
        upsert_keys=torch.from_numpy(kn[new_first].astype(np.int64)),
        upsert_values=vn[idx].float().contiguous(),
        evict_keys=torch.from_numpy(np.sort(evict).astype(np.int64)),
        new=int((~in_base[upsert]).sum()),
    )


def _diff_dense(name: str, base: torch.Tensor, new: torch.Tensor) -> TableDelta:
    if base.shape != new.shape:
        raise DeltaError(
            f"dense table {name!r}: base {list(base.shape)} vs new {list(new.shape)}; the config "
            "changed since the base bundle: export a full bundle instead of a delta"
        )
    rows = np.flatnonzero((_bits(base) != _bits(new)).any(axis=1))
    idx = torch.from_numpy(rows.astype(np.int64))
    return TableDelta(
        name,
        False,
        int(new.shape[1]),
        int(base.shape[0]),
        int(new.shape[0]),
        rows=idx,
        row_values=new[idx].float().contiguous(),
    )


def diff_tables(
    base_dense: Mapping[str, torch.Tensor],
    base_hash: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    new_dense: Mapping[str, torch.Tensor],
    new_hash: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, TableDelta]:
    """Per table, what changed from the base tables to the new ones (exact bit comparison)."""
    if set(base_dense) != set(new_dense) or set(base_hash) != set(new_hash):
        raise DeltaError(
            f"the tables differ (base: {sorted([*base_dense, *base_hash])}, new: "
            f"{sorted([*new_dense, *new_hash])}); export a full bundle instead of a delta"
        )
    out = {n: _diff_dense(n, base_dense[n], new_dense[n]) for n in new_dense}
    out.update({n: _diff_hash(n, base_hash[n], new_hash[n]) for n in new_hash})
    return out


# --------------------------------------------------------------------------- write


def write_delta(
    out_dir: str | os.PathLike[str],
    *,
    tables: Mapping[str, TableDelta],
    base_manifest: Mapping[str, Any],
    delta_id: str,
    target_version: str,
    config_digest: str,
    dense_program_path: str | os.PathLike[str] | None = None,
    program_inputs: Signature | None = None,
    table_summaries: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    event_time: int | None = None,
) -> Path:
    """Write a delta directory atomically (see the module docstring); returns its path. Its
    ``format_version`` follows the inputs ``dense_program_path`` takes (:data:`DELTA_FORMATS`;
    :data:`DELTA_FORMAT_VERSION` without a program): ``program_inputs`` when the caller has the
    program in memory (``signature_of(program_input_names(program))``), else read from the file
    (a ``torch.export.load``: half a second of a delta export on CPU). ``event_time``: the Unix
    time of the newest row trained into it (online training; the server reports its age)."""
    out = Path(out_dir)
    if not DELTA_ID_RE.match(delta_id):
        raise DeltaError(f"delta id {delta_id!r} must be 1-64 characters of A-Z a-z 0-9 . _ : -")
    if out.exists() and not overwrite:
        raise DeltaError(f"{out} exists; pass --overwrite to replace it")
    if program_inputs is not None and dense_program_path is None:
        raise DeltaError("program_inputs without dense_program_path: pass both or neither")
    if program_inputs is not None:
        version = DELTA_FORMATS[program_inputs]
    else:
        version = delta_format_version(dense_program_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        tensors: dict[str, torch.Tensor] = {}
        for t in tables.values():
            tensors.update({k: v.contiguous() for k, v in t.tensors().items()})
        save_file(tensors, tmp / DELTA_TENSORS, metadata={"format": DELTA_FORMAT})
        if dense_program_path is not None:
            shutil.copyfile(dense_program_path, tmp / DELTA_PROGRAM)
        files = {
            p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(tmp.iterdir())
        }
        manifest = {
            "format": DELTA_FORMAT,
            "format_version": version,
            "delta_id": delta_id,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "base": {
                "version": str(base_manifest["version"]),
                "manifest_digest": manifest_digest(base_manifest),
                "config_digest": str(base_manifest["config_digest"]),
            },
            "config_digest": config_digest,
            "target_version": target_version,
            "dense_program": dense_program_path is not None,
            "tables": {n: t.counts() for n, t in tables.items()},
            "table_summaries": dict(table_summaries or {}),
            "files": files,
            **({"event_time": int(event_time)} if event_time is not None else {}),
        }
        write_json(tmp / DELTA_MANIFEST, manifest)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def delta_format_version(program: str | os.PathLike[str] | None) -> int:
    """The ``format_version`` of a delta carrying ``program`` (None: no program)."""
    if program is None:
        return DELTA_FORMAT_VERSION
    try:
        signature = program_signature(Path(program))
    except BundleError as err:
        raise DeltaError(str(err)) from err.__cause__
    return DELTA_FORMATS[signature]


# --------------------------------------------------------------------------- apply


class BaseKeyIndex:
    """One hashmap table's base keys sorted once, to find a delta's keys among them by binary
    search: every delta against the same base merges with it (a server keeps its base bundle
    and applies a delta every few seconds), so the base's sort is paid once, not in each
    ``torch.isin`` (two a table, each sorting both sides). The delta's keys are sorted before
    the search, so that it walks the base's keys in order. On 2 CPU threads, 350K delta keys
    against 1M base keys: the two ``isin`` 130-165 ms; sorting the base 25-34 ms, searching
    it 33-55 ms with the delta's keys as they come and 24 ms with them sorted first."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys  # the base tensor it was built from (checked by apply_delta_tables)
        self.sorted, self.order = torch.sort(keys)

    def find(self, query: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the base positions of ``query``'s keys the base holds, in no set order; how many
        of ``query``'s keys it holds)."""
        if not self.sorted.numel() or not query.numel():
            return self.order[:0], 0
        query = torch.sort(query).values
        at = torch.searchsorted(self.sorted, query).clamp_(max=self.sorted.numel() - 1)
        held = self.sorted[at] == query
        return self.order[at[held]], int(held.sum())


def apply_delta_tables(
    base_dense: Mapping[str, torch.Tensor],
    base_hash: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    delta: Delta,
    *,
    index: MutableMapping[str, BaseKeyIndex] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Base tables + ``delta`` → new (dense, hash) tables; the base tensors are not modified.

    Tables the delta does not name are shared with the base. Each table's kind, dimension, row
    counts (``base_rows`` → ``target_rows``) and count of new keys are checked against the
    base: a delta of another base fails here even without its digest. ``index``: the base's
    :class:`BaseKeyIndex` by table, kept by the caller across deltas of the same base (filled
    here where missing or built from other keys); None: built for this call.
    """
    dense = dict(base_dense)
    hashed = dict(base_hash)
    index = {} if index is None else index
    foreign = "it was made for another base bundle"
    for name, t in delta.tables.items():
        where = f"{delta.where}: table {name!r}"
        if t.is_hashmap:
            if name not in base_hash:
                raise DeltaError(f"{where}: not a hashmap table of the base bundle; {foreign}")
            assert t.upsert_keys is not None and t.upsert_values is not None
            assert t.evict_keys is not None
            keys, values = base_hash[name]
            if values.shape[1] != t.dim:
                raise DeltaError(f"{where}: dimension {t.dim}, the base has {values.shape[1]}")
            found = index.get(name)
            if found is None or found.keys is not keys:
                found = index[name] = BaseKeyIndex(keys)
            keep = torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)
            updated, held = found.find(t.upsert_keys)
            keep[updated] = False
            keep[found.find(t.evict_keys)[0]] = False
            new = t.upsert_keys.numel() - held
            merged = (
                torch.cat([keys[keep], t.upsert_keys]),
                torch.cat([values[keep], t.upsert_values]),
            )
            rows = int(merged[0].numel())
            if rows != t.target_rows or values.shape[0] != t.base_rows or new != t.new:
                raise DeltaError(
                    f"{where}: base has {values.shape[0]} keys and the merge {rows} ({new} new), "
                    f"the delta expects {t.base_rows} → {t.target_rows} ({t.new} new): {foreign}"
                )
            hashed[name] = merged
        else:
            if name not in base_dense:
                raise DeltaError(f"{where}: not a dense table of the base bundle; {foreign}")
            assert t.rows is not None and t.row_values is not None
            w = base_dense[name]
            rows_ok = not t.rows.numel() or 0 <= int(t.rows.min()) <= int(t.rows.max()) < len(w)
            if list(w.shape) != [t.target_rows, t.dim] or not rows_ok:
                raise DeltaError(
                    f"{where}: the base is {list(w.shape)}, the delta expects "
                    f"[{t.target_rows}, {t.dim}]: {foreign}"
                )
            if t.rows.numel():
                w = w.clone()
                w[t.rows] = t.row_values
            dense[name] = w
    return dense, hashed
