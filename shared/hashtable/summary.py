"""A JSON-able summary of one dynamic table: size, score histogram, top keys, admission backlog.

Training-side facts that serving does not keep (scores and admission counters live only in the
trainer's tables and checkpoints), computed once from a checkpoint's table files and carried to
serving in the bundle manifest (``extra["table_summaries"]``) or a delta manifest, so that
``python -m train.tools inspect`` shows the same columns for a checkpoint and for a running
server. Example::

    state, args = read_table(module_dir(ckpt, "sparse.dynamic"), "user_id_emb")
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

from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.hashtable.checkpoint import module_dir, read_table, saved_tables
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
    """The ``k`` keys of highest score (ties: lower key first)."""
    if k <= 0 or keys.size == 0:
        return []
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
    if threshold is not None:
        counts = _np(state.counter_counts) if state.counter_counts is not None else np.zeros(0)
        values, n = np.unique(counts, return_counts=True)
        out["admission"] = {
            "threshold": int(threshold),
            "pending": int(counts.size),  # keys counted, not yet admitted
            "pending_by_count": {str(int(v)): int(c) for v, c in zip(values, n, strict=True)},
        }
    return out


def checkpoint_summaries(
    ckpt_dir: str | Path, module_name: str, *, top_k: int = DEFAULT_TOP_K
) -> dict[str, dict[str, Any]]:
    """Per table of ``<ckpt>/dynamicemb/<module>``: :func:`table_summary` plus ``world_size``
    and ``max_capacity`` (per rank, from ``<table>_opt_args.json``). Reads every rank's files."""
    directory = module_dir(ckpt_dir, module_name)
    out: dict[str, dict[str, Any]] = {}
    for name in saved_tables(directory):
        state, args = read_table(directory, name)
        threshold = args.get("admission_threshold")
        summary = table_summary(
            state,
            strategy=str(args.get("score_strategy", "STEP")),
            threshold=None if threshold is None else int(threshold),
            top_k=top_k,
        )
        summary["dim"] = int(args["dim"])
        summary["world_size"] = int(args.get("world_size", 1))
        summary["max_capacity"] = int(args.get("max_capacity", 0))
        out[name] = summary
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
