"""Delta updates on a running server: base bundle + delta → a new model version, no restart.

A delta (:mod:`shared.delta`, written by ``python -m train.tools delta-export``) is relative to a
base bundle. :func:`resolve_delta` turns the request's path into a directory under the server's
delta root: relative paths only, no ``..``, symlinks resolved and kept inside the root, and one
refusal text for every path that is not a delta there (existing or not, so a client learns
nothing about the server's other directories). :func:`apply_delta` reads the delta
(:func:`shared.delta_reader.read_delta`: every field checked, messages name it by the request's
path, not the server's), checks that it was made for the bundle the server runs (manifest
digest and config digest), merges the base tables (kept in memory, memory-mapped) with the
delta's rows, builds the serving tables from the result with the same code as a full load
(:func:`serve.model.build_tables`), loads the delta's dense program if it has one (the program
cache makes a same-graph program a weight copy) or reuses the base's, and warms the new model
up. A program that does not load or run with its tables is a :class:`DeltaError` like any other
defect of the delta. :meth:`serve.versions.ModelManager.replace` runs this on the loader thread
while requests keep being served by the old model, and swaps the result in with one reference
assignment, so there is no restart and no pause; the scores equal those of a full export of
the same checkpoint (tests check it over gRPC). Example::

    path = resolve_delta(Path("/srv/deltas").resolve(), "step-2000")   # DeltaPathError if not
    applied = apply_delta(current, path, label="delta 'step-2000'", in_place=False)  # the rebuild
    model, delta = applied.model, applied.delta

In place (:func:`apply_delta`, what ApplyDelta runs): the merged tables are written into the
serving model's own tensors instead (:meth:`serve.lookup.EmbeddingTables.prepare_update`: the
comparisons and sorts off the serving path, then only the writes, between batches under the
predict lock, :meth:`serve.model.LoadedModel.between_batches`): dense rows that changed, dynamic
rows that changed, and when keys come or go the group's sorted keys rewritten in the free slots
the tables are built with (:attr:`serve.tiers.TierConfig.headroom`, ``--key-headroom``). The
target is always base + this delta, so the previous delta's rows (and keys it added) are
replaced as by a rebuild. The new model (:meth:`~serve.model.LoadedModel.successor`) shares the
tables, and the old one is superseded inside the same lock, so a batch sees either the old
tables and program or the new ones.

Dense weights, in place too: a delta's ``dense.pt2`` of the serving program's graph (the
archive digest of :mod:`serve.program_cache`, weights left out; what ``train stream`` publishes
every few seconds) has its weights copied into the serving program's own tensors with the
table writes, under the same lock, so its CUDA graphs stay valid and nothing is captured (on
the H100 on 2026-12-07, loading each streamed delta's program and capturing its 42 graphs took
29-34 s under serving load: most of the event-to-served time). The base's weights are kept in a
copy of the program the first time they are overwritten, and a later delta without a program
gets them back the same way. A program of another graph is loaded as a rebuild does, and
warmed up (CUDA: its graphs captured over the live tensors) before the writes. Where in place
is impossible (no room for the new keys, a key beyond a shared key space, a table of another
shape) :func:`apply_delta` falls back to the rebuild below and says so (:class:`Applied`, the
log, ``dynrec_serving_delta_applies_total{path}``).
One difference from the rebuild: a request accepted before the swap and scored after the writes
gets the new scores but names the old version (the servicer reads the version from the model it
validated the request against); no request gets a mix of the two.

CUDA graphs (:mod:`serve.graphs`): the rebuilt model gets the serving model's graph buckets,
and its warm-up captures its own graphs, over its own tables and program, on the loader thread
and before the swap; the served model's graphs keep reading valid tensors until it is dropped,
and none is ever replayed over tensors its model no longer holds
(:class:`serve.graphs.CudaGraphs` refuses to). In place, rows are written into the tensors the
graphs read (and a table's key count into a tensor of its own), so they stay valid.

The new model's version is ``"<base version>+<delta id>"`` and it remembers every delta applied
since the base was loaded (``LoadedModel.deltas``; GetModelMetadata and InspectTables return
them). Because deltas are relative to the base, applying one replaces the previous one's rows.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
import zipfile
from dataclasses import dataclass
from enum import Enum, unique
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from serve.lookup import InPlaceUnavailableError
from serve.model import (
    DenseProgram,
    LoadedModel,
    StartupTimes,
    _side_stream,
    _sync,
    build_tables,
    load_program,
)
from serve.program_cache import refill, same_graph_weights
from shared.bundle import Bundle, BundleError
from shared.delta import (
    DELTA_MANIFEST,
    DELTA_PROGRAM,
    Delta,
    DeltaError,
    apply_delta_tables,
    manifest_digest,
)
from shared.delta_reader import read_delta

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 1024


@unique
class ApplyPath(Enum):
    """How a delta reached the serving tables."""

    IN_PLACE = "in_place"  # written into the live tensors between batches
    REBUILD = "rebuild"  # new tables built, the model swapped


@dataclass(frozen=True)
class Applied:
    """A delta applied: the model now serving, the delta, the path taken, why not in place
    (the fallback's reason; "" in place), and how long batches waited for the writes."""

    model: LoadedModel
    delta: Delta
    path: ApplyPath
    reason: str = ""
    pause_seconds: float = 0.0  # in place: the predict lock held for the writes


class DeltaMismatchError(DeltaError):
    """The delta was made for another base bundle than the one the server runs."""


class DeltaPathError(DeltaError):
    """The request's path is no delta directory under the delta root (one text for all)."""


def no_delta_at(path: str) -> str:
    shown = path if len(path) <= 200 else path[:200] + "..."
    return (
        f"path: no readable delta at {shown!r} under the delta root; give the delta directory "
        "relative to the server's --delta-root (no absolute path, no '..')"
    )


def resolve_delta(root: Path, path: str) -> Path:
    """The delta directory ``path`` names under ``root`` (resolved: no symlink in it), or
    :class:`DeltaPathError` with the same text whatever the reason: an absolute path, ``..``,
    a symlink leading out of the root, nothing there, or a directory without a manifest."""
    if not path:
        raise DeltaPathError("path: empty; give the delta directory relative to the delta root")
    parts = PurePosixPath(path).parts
    if len(path) > MAX_PATH_CHARS or "\0" in path or path.startswith("/") or ".." in parts:
        raise DeltaPathError(no_delta_at(path))
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    manifest = os.path.join(real, DELTA_MANIFEST)
    inside = os.path.commonpath([real, real_root]) == real_root
    if not inside or os.path.realpath(manifest) != manifest or not os.path.isfile(manifest):
        raise DeltaPathError(no_delta_at(path))
    return Path(real)


def check_base(model: LoadedModel, delta: Delta) -> None:
    base = model.base_bundle
    digest = manifest_digest(base.manifest)
    if delta.base_digest != digest or delta.config_digest != base.config_digest:
        raise DeltaMismatchError(
            f"{delta.where}: made for base bundle {delta.base_version!r} (manifest digest "
            f"{delta.base_digest[:12]}), but the server runs base {base.version!r} "
            f"({digest[:12]}); export the delta against that bundle (delta-export --base)"
        )


def _patched_bundle(current: LoadedModel, delta: Delta) -> Bundle:
    """The base bundle of ``current`` with ``delta``'s rows merged in (its tables, manifest,
    version and dense program)."""
    base = current.base_bundle
    dense, hashed = apply_delta_tables(
        base.dense_tables, base.hash_tables, delta, index=current.base_key_index
    )
    version = f"{base.version}+{delta.delta_id}"
    extra: dict[str, Any] = dict(base.manifest.get("extra", {}))
    extra["table_summaries"] = delta.summaries
    manifest = {**base.manifest, "version": version, "extra": extra, "delta": delta.manifest}
    return dataclasses.replace(
        base,
        dense_tables=dense,
        hash_tables=hashed,
        manifest=manifest,
        version=version,
        dense_program_path=delta.dense_program_path or base.dense_program_path,
    )


def apply_delta(
    current: LoadedModel,
    path: str | Path,
    *,
    verify_checksums: bool = True,
    warmup_candidates: int = 100,
    label: str = "",
    in_place: bool = True,
) -> Applied:
    """Base + the delta at ``path``, written into ``current``'s tables in place where it can
    be, else rebuilt (``in_place=False``: always rebuilt); the returned model is to be swapped
    in for ``current`` (:meth:`serve.versions.ModelManager.replace`)."""
    t0 = time.perf_counter()
    delta = read_delta(path, verify_checksums=verify_checksums, label=label)
    check_base(current, delta)
    patched = _patched_bundle(current, delta)
    reason = "in place switched off"
    if in_place:
        try:
            model, pause = _write_in_place(current, delta, patched, warmup_candidates, t0)
        except InPlaceUnavailableError as err:
            reason = str(err)
        else:
            log.info(
                "delta %s written in place into model %s (batches paused %.2f ms; %s)",
                delta.delta_id,
                current.version,
                pause * 1e3,
                _stages(model),
            )
            return Applied(model, delta, ApplyPath.IN_PLACE, pause_seconds=pause)
    log.info("delta %s: new tables built (%s)", delta.delta_id, reason)
    model = _rebuild(current, delta, patched, warmup_candidates, t0)
    log.info("delta %s: new model ready (%s)", delta.delta_id, _stages(model))
    return Applied(model, delta, ApplyPath.REBUILD, reason)


def _stages(model: LoadedModel) -> str:
    """The delta's seconds per stage for the log, so that a server's log says where an
    update's time went (read and merge, tables, program, warm-up, graphs, in all)."""
    return ", ".join(f"{k} {v:.3f} s" for k, v in model.startup.as_dict().items())


def _write_in_place(
    current: LoadedModel, delta: Delta, patched: Bundle, warmup_candidates: int, t0: float
) -> tuple[LoadedModel, float]:
    """``current``'s successor over its own tables, rewritten to ``patched``'s (module doc),
    and the seconds batches waited for the writes; :class:`InPlaceUnavailableError` before
    anything is written if they do not fit."""
    dev = current.device
    stats = current.graph_stats()
    captured = 0.0 if stats is None else stats.capture_seconds  # the successor may share them
    t1 = time.perf_counter()
    with _side_stream(dev):
        write = current.tables.prepare_update(patched)
        _sync(dev)
        t2 = time.perf_counter()
        weights = _weights_in_place(current, delta)
        program = current.program if weights is not None else _program(current, delta, dev)
        t3 = time.perf_counter()
        model = current.successor(patched, program)
        if weights and current.base_program is current.program:
            model.base_program = _copy(current.base_program)  # the base's weights kept
        if program is not current.program:  # checked, and graphs captured, before the writes
            _warmup(model, delta, warmup_candidates)
        _sync(dev)
    t4 = time.perf_counter()
    with current.between_batches():
        t_lock = time.perf_counter()
        write()
        if weights:
            refill(_module(program), weights)
        current.supersede(model)
    t5 = time.perf_counter()
    table_s = t2 - t1 + t5 - t4
    before = captured if model.graphs is current.graphs else 0.0
    model.startup = StartupTimes.split(
        t1 - t0, table_s, t3 - t2, t4 - t3, t5 - t0, model=model, captured_before=before
    )
    model.deltas = (*current.deltas, delta.delta_id)
    return model, t5 - t_lock


def _module(program: DenseProgram) -> torch.nn.Module:
    assert isinstance(program.module, torch.nn.Module)
    return program.module


def _weights_in_place(current: LoadedModel, delta: Delta) -> dict[str, torch.Tensor] | None:
    """The weights to write into the serving program's own tensors, so that its graphs stay
    valid and nothing is captured (module doc, "Dense weights"): the delta's program's when
    it has the serving one's graph (:func:`serve.program_cache.same_graph_weights`), the base's
    when the delta has none and the serving program is the base's graph with other weights;
    ``{}`` when the serving program already is the base's; None when the program must be
    loaded (another graph, weights that are not plain tensors)."""
    serving = current.program
    if not isinstance(serving.module, torch.nn.Module) or serving.digest is None:
        return None
    if delta.dense_program_path is not None:
        try:
            return same_graph_weights(delta.dense_program_path, serving.module, serving.digest)
        except (zipfile.BadZipFile, OSError, ValueError, KeyError):
            return None  # loaded as a program, which says what is wrong with it (a DeltaError)
    base = current.base_program
    if base is serving:
        return {}
    if base.digest != serving.digest or not isinstance(base.module, torch.nn.Module):
        return None
    return {k: v.detach() for k, v in base.module.state_dict(keep_vars=True).items()}


def _copy(program: DenseProgram) -> DenseProgram:
    """``program`` with a module of its own (the same graph and weights, new tensors)."""
    return dataclasses.replace(program, module=copy.deepcopy(program.module))


def _program(current: LoadedModel, delta: Delta, dev: torch.device) -> DenseProgram:
    """The delta's program, or the base's (which the serving one may already be)."""
    if delta.dense_program_path is not None:
        return _delta_program(delta, dev)
    return current.base_program


def _rebuild(
    current: LoadedModel, delta: Delta, patched: Bundle, warmup_candidates: int, t0: float
) -> LoadedModel:
    """A model of its own for ``patched``: tables built anew, program loaded or reused."""
    dev = current.device
    t1 = time.perf_counter()
    with _side_stream(dev):
        tables = build_tables(patched, dev, current.tables.tiers)
        _sync(dev)
        t2 = time.perf_counter()
        program = _program(current, delta, dev)
        t3 = time.perf_counter()
        model = LoadedModel(
            patched,
            tables,
            program,
            dev,
            StartupTimes(t1 - t0, 0, 0, 0, 0, 0),
            graph_buckets=current.graph_buckets,
        )
        _warmup(model, delta, warmup_candidates)  # and the CUDA graphs over the new tables
        _sync(dev)
    t4 = time.perf_counter()
    model.startup = StartupTimes.split(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, model=model)
    model.base_bundle = current.base_bundle
    model.base_key_index = current.base_key_index
    model.base_program = current.base_program
    model.deltas = (*current.deltas, delta.delta_id)
    return model


def _delta_program(delta: Delta, dev: torch.device) -> DenseProgram:
    """The delta's program; a DeltaError if it does not load or its inputs are not those its
    format version says (version 2: the pair inputs, :mod:`shared.delta`)."""
    assert delta.dense_program_path is not None
    try:
        program = load_program(delta.dense_program_path, dev)
    except BundleError as err:
        cause = err.__cause__ or err
        raise DeltaError(
            f"{delta.where}: {DELTA_PROGRAM}: not a loadable dense program "
            f"({type(cause).__name__}: {str(cause)[:300]}); re-export the delta"
        ) from None
    if program.signature is not delta.program_signature:
        raise DeltaError(
            f"{delta.where}: {DELTA_PROGRAM} takes {list(program.input_names)}, but the "
            f"manifest's format_version {delta.format_version} says "
            f"{list(delta.program_signature.value)}; re-export the delta (delta-export writes "
            "both)"
        )
    return program


def _warmup(model: LoadedModel, delta: Delta, candidates: int) -> None:
    """Warm up; a failure is the delta's when it brought its own program (the tables were
    checked against the base), else a bug of the server and raised as it is."""
    try:
        model.warmup(candidates=candidates)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as err:
        if delta.dense_program_path is None:
            raise
        raise DeltaError(
            f"{delta.where}: {DELTA_PROGRAM} does not run with the tables "
            f"({type(err).__name__}: {str(err)[:300]}); re-export the delta against its base"
        ) from None


__all__ = [
    "Applied",
    "ApplyPath",
    "DeltaError",
    "DeltaMismatchError",
    "DeltaPathError",
    "apply_delta",
    "check_base",
    "resolve_delta",
]
