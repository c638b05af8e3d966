"""Delta updates on a running server: base bundle + delta → a new model version, no restart.

A delta (:mod:`shared.delta`, written by ``python -m train.tools delta-export``) is relative to a
base bundle. :func:`build_with_delta` takes the serving model, checks that the delta was made for
the bundle it was loaded from (manifest digest and config digest), merges the base tables (kept
in memory, memory-mapped) with the delta's rows, builds the serving tables from the result with
the same code as a full load (:func:`serve.model.build_tables`), loads the delta's dense program
if it has one (the program cache makes a same-graph program a weight copy) or reuses the base's,
and warms the new model up. :meth:`serve.versions.ModelManager.replace` runs this on the loader
thread while requests keep being served by the old model, and swaps the result in with one
reference assignment, so there is no restart and no pause; the scores equal those of a full
export of the same checkpoint (tests check it over gRPC).

The new model's version is ``"<base version>+<delta id>"`` and it remembers every delta applied
since the base was loaded (``LoadedModel.deltas``; GetModelMetadata and InspectTables return
them). Because deltas are relative to the base, applying one replaces the previous one's rows.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from serve.model import LoadedModel, StartupTimes, _side_stream, _sync, build_tables, load_program
from shared.delta import Delta, DeltaError, apply_delta_tables, manifest_digest, read_delta


class DeltaMismatchError(DeltaError):
    """The delta was made for another base bundle than the one the server runs."""


def check_base(model: LoadedModel, delta: Delta) -> None:
    base = model.base_bundle
    digest = manifest_digest(base.manifest)
    if delta.base_digest != digest or delta.config_digest != base.config_digest:
        raise DeltaMismatchError(
            f"{delta.path}: made for base bundle {delta.base_version!r} (manifest digest "
            f"{delta.base_digest[:12]}), but the server runs base {base.version!r} ({digest[:12]}"
            f", from {base.path}); export the delta against that bundle (delta-export --base)"
        )


def build_with_delta(
    current: LoadedModel,
    path: str | Path,
    *,
    verify_checksums: bool = True,
    warmup_candidates: int = 100,
) -> tuple[LoadedModel, Delta]:
    """The model of ``current``'s base bundle plus the delta at ``path`` (see module doc)."""
    t0 = time.perf_counter()
    delta = read_delta(path, verify_checksums=verify_checksums)
    check_base(current, delta)
    base = current.base_bundle
    dense, hashed = apply_delta_tables(base.dense_tables, base.hash_tables, delta)
    version = f"{base.version}+{delta.delta_id}"
    extra: dict[str, Any] = dict(base.manifest.get("extra", {}))
    extra["table_summaries"] = delta.summaries
    manifest = {**base.manifest, "version": version, "extra": extra, "delta": delta.manifest}
    program_path = delta.dense_program_path or base.dense_program_path
    patched = dataclasses.replace(
        base,
        dense_tables=dense,
        hash_tables=hashed,
        manifest=manifest,
        version=version,
        dense_program_path=program_path,
    )
    dev = current.device
    t1 = time.perf_counter()
    with _side_stream(dev):
        tables = build_tables(patched, dev)
        _sync(dev)
        t2 = time.perf_counter()
        if delta.dense_program_path is not None:
            program = load_program(delta.dense_program_path, dev)
        else:
            program = current.base_program
        t3 = time.perf_counter()
        model = LoadedModel(patched, tables, program, dev, StartupTimes(t1 - t0, 0, 0, 0, 0))
        model.warmup(candidates=warmup_candidates)
        _sync(dev)
    t4 = time.perf_counter()
    model.startup = StartupTimes(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
    model.base_bundle = base
    model.base_program = current.base_program
    model.deltas = (*current.deltas, delta.delta_id)
    return model, delta


__all__ = ["DeltaError", "DeltaMismatchError", "build_with_delta", "check_base"]
