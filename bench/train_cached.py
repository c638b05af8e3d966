"""The ``cached`` config of :mod:`bench.bench_train` (issue #52, Done-when item 2): the seed
config with ``cache_load_factor`` 0.1 on every dynamic table (a CACHING storage: an HBM cache
of 10 % of the rows over a host tier holding them all), judged against the seed config of the
same run by end-to-end samples/s (at least 0.85x) and eval AUC (within 0.001).

Here: the config, derived from the seed config at run time (:func:`cached_config`); the trainer
that tells training's cache counters from its evaluations' (:class:`CacheCountingTrainer`); the
cache's figures of a trained model (:func:`cache_figures`); and the ratios and goals
(:func:`cached_ratios`, :data:`CACHED_GOALS`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from google.protobuf.message import Message

from bench.goals import check
from shared.config import load_config
from shared.hashtable.row_cache_lines import CacheCounters
from train.evaluate import EvalResult, UserCounts
from train.trainer import Trainer, TrainOptions

CACHED_LOAD_FACTOR = 0.1  # issue #52: "cache_load_factor: 0.1 on every dynamic table"
CACHED_GOALS = {  # issue #52, item 2: the cached config against the seed config, same run
    "end_to_end_over_dynamic": 0.85,
    "auc_abs_diff": 0.001,
}
# the cumulative counters of RowCache.stats (CacheCounters' fields, "cache_"-prefixed)
COUNTERS = tuple(f"cache_{name}" for name in CacheCounters.__dataclass_fields__)


def cached_config(seed: Path, out: Path, factor: float = CACHED_LOAD_FACTOR) -> Path:
    """Write ``seed`` with ``cache_load_factor: factor`` on every ``dynamicemb`` block to
    ``out``; returns ``out``.

    Why derived and not a shipped file: the cached config must be the seed config but for that
    one field, and a copy under ``configs/`` would drift from it (every later change to the seed
    config would have to be made twice). The field is set through the parsed config (any
    message of type ``DynamicEmbedding``, wherever a feature holds one), and the result is
    written with protobuf's ``text_format`` beside the bench's JSON, so a run records the
    config it trained. A seed config without a dynamic table is an error: nothing to cache.
    """
    config = load_config(seed)
    tables = _set_cache_load_factor(config, factor)
    if not tables:
        raise SystemExit(
            f"error: {seed} has no dynamicemb table to set cache_load_factor on; "
            "give the cached config as cached=PATH"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    header = f"# {seed.name} with cache_load_factor: {factor} on its {tables} dynamicemb tables\n"
    out.write_text(header + text_format.MessageToString(config))
    return out


def _set_cache_load_factor(msg: Message, factor: float) -> int:
    """Set ``cache_load_factor`` on every ``DynamicEmbedding`` under ``msg``; how many."""
    if msg.DESCRIPTOR.name == "DynamicEmbedding":
        msg.cache_load_factor = factor  # type: ignore[attr-defined]
        return 1
    found = 0
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        for sub in value if field.is_repeated else [value]:
            found += _set_cache_load_factor(sub, factor)
    return found


class CacheCountingTrainer(Trainer):
    """The trainer, keeping what its evaluations added to each storage's cache counters
    (``eval_counts``: storage → counter → rows), so that training's hits and misses can be told
    apart: the counters are cumulative over every lookup, the evaluation's included."""

    def __init__(self, options: TrainOptions) -> None:
        super().__init__(options)
        self.eval_counts: dict[str, dict[str, float]] = {}

    def run_eval(self, user_counts: UserCounts | None, step: int) -> EvalResult:
        before = self.model.sparse.dynamic.tier_stats()
        result = super().run_eval(user_counts, step)
        for name, stats in self.model.sparse.dynamic.tier_stats().items():
            counts = self.eval_counts.setdefault(name, {})
            for key in COUNTERS:
                if key in stats:
                    counts[key] = counts.get(key, 0.0) + stats[key] - before[name][key]
        return result


def cache_figures(trainer: CacheCountingTrainer, steps: int) -> dict[str, dict[str, Any]]:
    """Per CACHING storage of ``trainer``'s model after its run (none: an empty dict): its
    tables, lines, and the counters of the training steps alone (the run's less its
    evaluations'), with the hit rate (hits over the rows the calls used, each row counted once
    a call) and the misses a training step (``steps``); ``eval``: the evaluations' counters.
    A storage holds the tables fused into it (all six of the seed config's in one), so these
    are per storage: the cache is one per storage."""
    dyn = trainer.model.sparse.dynamic
    members = dyn.storages
    out = {}
    for name, stats in dyn.tier_stats().items():
        if "cache_lines" not in stats:  # HBM_ONLY: no cache
            continue
        ev = trainer.eval_counts.get(name, {})
        train = {k: stats[k] - ev.get(k, 0.0) for k in COUNTERS}
        used = train["cache_hits"] + train["cache_misses"] + train["cache_bypassed"]
        out[name] = {
            "tables": members[name],
            "cache_lines": stats["cache_lines"],
            "train": train,
            "train_hit_rate": train["cache_hits"] / used if used else None,
            "train_misses_per_step": train["cache_misses"] / steps if steps else None,
            "eval": ev,
            "hbm_payload_bytes": stats["hbm_payload_bytes"],
            "host_payload_bytes": stats["host_payload_bytes"],
        }
    return out


def e2e_ratio(a: dict[str, Any], b: dict[str, Any]) -> tuple[float | None, list[float] | None]:
    """Config entry ``a``'s end-to-end samples/s over ``b``'s (None where one is missing) and,
    where both ran the same rounds (``end_to_end_rounds``, ``bench_train --e2e-rounds``), each
    round's ratio: the ratio is then their median, each round's pair run back to back on the
    same host (None: one round, the runs' own ratio)."""
    ra, rb = a.get("end_to_end_rounds"), b.get("end_to_end_rounds")
    if ra and rb and len(ra) == len(rb):
        pairs = [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(ra, rb, strict=True)]
        return statistics.median(pairs), pairs
    x, y = (
        a.get("end_to_end", {}).get("samples_per_s"),
        b.get("end_to_end", {}).get("samples_per_s"),
    )
    return (None if x is None or y is None else x / y), None


def cached_ratios(
    cached: dict[str, Any], dyn: dict[str, Any], step_ms: float | None
) -> dict[str, Any]:
    """The cached config against the seed config of the same run: end-to-end samples/s
    (cached/dynamic; over several rounds the median of each round's, :func:`e2e_ratio`), the
    eval AUC difference (of the first round) (cached - dynamic), ``step_ms`` (cached/dynamic,
    as the caller measured it) and the goals of :data:`CACHED_GOALS` (``met``: None where a
    figure is missing, e.g. without the end-to-end runs)."""
    c, d = cached.get("end_to_end", {}), dyn.get("end_to_end", {})
    rate, rounds = e2e_ratio(cached, dyn)
    aucs = ((c.get("eval") or {}).get("auc"), (d.get("eval") or {}).get("auc"))
    diff = aucs[0] - aucs[1] if aucs[0] is not None and aucs[1] is not None else None
    got = {"end_to_end_over_dynamic": rate, "auc_abs_diff": None if diff is None else abs(diff)}
    return {
        "end_to_end_samples_per_s": rate,
        **({} if rounds is None else {"end_to_end_samples_per_s_rounds": rounds}),
        "auc_diff": diff,
        "step_ms": step_ms,
        "goals": {
            k: check(got[k], g, at_most=k == "auc_abs_diff") for k, g in CACHED_GOALS.items()
        },
    }
