"""A JSON-able summary of one dynamic table: size, score histogram, top keys, admission backlog.

Training-side facts that serving does not keep (scores and admission counters live only in the
trainer's tables and checkpoints), computed once from a checkpoint's table files and carried to
serving in the bundle manifest (``extra["table_summaries"]``) or a delta manifest, so that
``python -m train.tools inspect`` shows the same columns for a checkpoint and for a running
server. Example::

    state, info = read_table(ckpt, "user_id_emb")
    table_summary(state, strategy="LFU", threshold=3, top_k=5)
    # {"size": 1834, "score_strategy": "LFU",
    #  "score_histogram": [{"lower": 3, "upper": 4, "count": 612}, ...],
    #  "top_keys": [{"key": 17, "score": 96}, ...],
    #  "admission": {"threshold": 3, "pending": 412, "pending_by_count": {"1": 301, "2": 111}}}

Histogram bins: LFU scores (use counts) in powers of two ``[1, 2), [2, 4), [4, 8) ...`` (plus
``[0, 1)`` for keys never used since an init checkpoint); STEP / TIMESTAMP / NO_EVICTION scores
(step or time of last use) in ``bins`` equal-width ranges from the lowest to the highest score.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.features import TableSpec
from shared.hashtable.checkpoint import DEEP_COLLECTION, open_checkpoint
from shared.hashtable.checkpoint_io import (
    CheckpointReader,
    ReadRequest,
    ReadTable,
    SavedTable,
    TableInfo,
)
from shared.hashtable.storage import TableState

DEFAULT_TOP_K = 20  # top keys stored in bundle / delta manifests
DEFAULT_BINS = 8


def score_histogram(
    scores: np.ndarray, strategy: str, bins: int = DEFAULT_BINS
) -> list[dict[str, int]]:
    """Bins ``[lower, upper)`` with their key counts (empty bins left out)."""
    if scores.size == 0:
        return []
    if strategy == "LFU":
        top = int(scores.max())
        edges = [0, 1] + [1 << i for i in range(1, max(top, 1).bit_length() + 1)]
    else:
        lo, hi = int(scores.min()), int(scores.max()) + 1
        step = max(1, -(-(hi - lo) // bins))  # ceil
        edges = list(range(lo, hi + step, step))
    counts, _ = np.histogram(scores, bins=np.asarray(edges, dtype=np.float64))
    return [
        {"lower": int(a), "upper": int(b), "count": int(c)}
        for a, b, c in zip(edges[:-1], edges[1:], counts, strict=True)
        if c
    ]


def top_keys(keys: np.ndarray, scores: np.ndarray, k: int) -> list[dict[str, int]]:
    """The ``k`` keys of highest score (ties: lower key first). Only the keys scored at least
    the ``k``-th highest score are sorted (a partition finds it): every one of the top ``k`` is
    among them, and a lexsort of all of a table's keys was most of a summary's time."""
    if k <= 0 or keys.size == 0:
        return []
    if keys.size > k:
        kth = np.partition(scores, keys.size - k)[keys.size - k]  # the k-th highest score
        chosen = np.flatnonzero(scores >= kth)
        keys, scores = keys[chosen], scores[chosen]
    order = np.lexsort((keys, -scores))[:k]
    return [{"key": int(keys[i]), "score": int(scores[i])} for i in order]


def table_summary(
    state: TableState,
    *,
    strategy: str,
    threshold: int | None,
    top_k: int = DEFAULT_TOP_K,
    bins: int = DEFAULT_BINS,
) -> dict[str, Any]:
    """The summary of one table's checkpoint state (see the module docstring)."""
    keys = _np(state.keys)
    scores = _np(state.scores)
    out: dict[str, Any] = {
        "size": int(keys.size),
        "score_strategy": strategy,
        "score_histogram": score_histogram(scores, strategy, bins),
        "top_keys": top_keys(keys, scores, top_k),
    }
    if threshold is not None or state.counter_counts is not None:
        counts = _np(state.counter_counts) if state.counter_counts is not None else np.zeros(0)
        values, n = np.unique(counts, return_counts=True)
        out["admission"] = {
            "threshold": 0 if threshold is None else int(threshold),  # 0: the files do not say
            "pending": int(counts.size),  # keys counted, not yet admitted
            "pending_by_count": {str(int(v)): int(c) for v, c in zip(values, n, strict=True)},
        }
    return out


@dataclass(frozen=True)
class SavedRead:
    """One saved table as read once (:func:`read_saved_tables`): its files, what they say
    without a config, and every rank's rows joined (:meth:`CheckpointReader.read`)."""

    table: SavedTable
    info: TableInfo
    got: ReadTable


def read_saved_tables(
    reader: CheckpointReader,
    *,
    specs: Mapping[SavedTable, TableSpec] | None = None,
    now: int | None = None,
) -> list[SavedRead]:
    """Every dynamic table of the checkpoint, each table's files read once, in summary order
    (the deep collection first). ``specs``: the config's tables an export takes rows from, by
    their files: read with the config's dim and score strategy (the values checked against the
    dim, the strategy against the files' ``evict_strategy``, as a load checks them); the others
    are read as the files say. ``now``: the TIMESTAMP clock (µs, default the wall clock). One
    read serves both an export's rows and its summaries (:func:`summaries_of`), instead of a
    second read of every file for the summaries; the reads are held together (every table's
    rows and optimizer states), where a summary alone held one table's at a time."""
    saved = sorted(reader.tables(), key=lambda t: (t.collection != DEEP_COLLECTION, t.collection))
    specs = specs or {}
    now = time.time_ns() // 1000 if now is None else now
    out = []
    for table in saved:
        info = reader.describe(table)
        spec = specs.get(table)
        want = (
            ReadRequest(spec.dim, spec.dynamic.score_strategy, 0.0, now)
            if spec is not None and spec.dynamic is not None
            else ReadRequest(info.dim, info.strategy, 0.0, now)
        )
        out.append(SavedRead(table, info, reader.read(table, want)))
    return out


def summaries_of(
    reads: Sequence[SavedRead], layout: str, *, top_k: int = DEFAULT_TOP_K
) -> dict[str, dict[str, Any]]:
    """Per table of ``reads`` (:func:`read_saved_tables` of a checkpoint of ``layout``):
    :func:`table_summary` plus ``dim``, ``world_size`` (of the files), ``max_capacity`` (per
    rank; None when the files do not say, as in TorchEasyRec's), ``collection`` and ``layout``.

    Keyed by table name; a second copy of a name in another collection (TorchEasyRec keeps the
    sequence tables twice) is keyed ``<collection>.<name>``.
    """
    out: dict[str, dict[str, Any]] = {}
    for r in reads:
        strategy = r.info.strategy.value if r.info.strategy is not None else "unknown"
        summary = table_summary(
            r.got.state, strategy=strategy, threshold=r.info.admission_threshold, top_k=top_k
        )
        summary["dim"] = int(r.info.dim or 0)
        summary["world_size"] = int(r.table.world_size or 0)
        summary["max_capacity"] = r.info.max_capacity
        summary["collection"] = r.table.collection
        summary["layout"] = layout
        key = r.table.name if r.table.name not in out else f"{r.table.collection}.{r.table.name}"
        out[key] = summary
    return out


def checkpoint_summaries(
    ckpt_dir: str | Path, *, top_k: int = DEFAULT_TOP_K, now: int | None = None
) -> dict[str, dict[str, Any]]:
    """:func:`summaries_of` every dynamic table of the checkpoint (any layout, no config
    needed; every rank's files). An export that also reads the tables' rows reads once
    (:func:`read_saved_tables`) and passes the reads to :func:`summaries_of` instead."""
    reader = open_checkpoint(ckpt_dir)
    return summaries_of(read_saved_tables(reader, now=now), reader.layout, top_k=top_k)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
