"""What ``bench.bench_stream``'s phases 1 to 3 measured, as its JSON's sections: ``train`` and
``publish`` (:func:`train_report`, :func:`publish_report`: the publishing trainer's records),
``freshness`` (:func:`freshness`: the probe's samples), ``train_without_publishing``
(:func:`training_report`: phase 2's trainer) and ``serving`` (:func:`serving_report`: the load's
log in each phase's window, and the :data:`RATIOS`; which of them is the issue's goal, and why
phase 2 is the "without publishing": ``bench/bench_stream.py``'s module doc).

A module of its own because these are functions of what was recorded (records, landings,
probe samples, a load's log), not of the processes that recorded it: they are tested on
made-up records, and the phases only call them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.stream_load import PacedLoad
from bench.stream_processes import records
from bench.stream_source import Lander


def _percentiles(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    a = np.asarray(xs, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": len(xs)}  # fmt: skip


def training_report(
    stream: list[dict[str, Any]], start: float, end: float, rows: int
) -> dict[str, Any]:
    """A trainer's ``stream`` records from ``start`` to ``end`` (unix) of a replay of ``rows``
    rows that began at ``start``: rows/s while busy, lag, and whether (and how many seconds
    after ``start``) it had trained them all."""
    window = [r for r in stream if start <= r.get("at_unix", 0) <= end]
    done = [r for r in window if r["samples"] >= rows]
    return {
        "rows": rows,
        "rows_per_s": _percentiles([r["rows_per_s"] for r in window if r["rows_per_s"] > 0]),
        "lag_rows_max": max((r["lag_rows"] for r in window), default=None),
        "trained_rows": window[-1]["samples"] if window else None,
        "caught_up": bool(done),
        "caught_up_after_s": done[0]["at_unix"] - start if done else None,
    }


# the serving ratios: (numerator, denominator) phases; which is the goal: bench/bench_stream.py's
# module doc
RATIOS = {
    "p99_ratio_publishing": ("with_publishing", "training_without_publishing"),  # the goal
    "p99_ratio_training": ("training_without_publishing", "idle"),  # information
}


def serving_report(load: PacedLoad, windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """The load's stats in each phase's window (monotonic start, end), and each ratio of
    :data:`RATIOS` whose two phases are measured (None where one had no answered request),
    with its 95 % interval (``<ratio>_ci95``: :func:`p99_ratio_interval`)."""
    out: dict[str, Any] = {name: load.stats(*w) for name, w in windows.items()}
    for ratio, (a, b) in RATIOS.items():
        if a in out and b in out:
            x, y = out[a]["p99_ms"], out[b]["p99_ms"]
            out[ratio] = x / y if x and y else None
            out[f"{ratio}_ci95"] = (
                p99_ratio_interval(_seconds(load, windows[a]), _seconds(load, windows[b]))
                if x and y
                else None
            )
    return out


def _seconds(load: PacedLoad, window: tuple[float, float]) -> list[np.ndarray]:
    """The answered requests' latencies of ``window``, one array per whole second of it that
    has any (:meth:`PacedLoad.seconds`)."""
    return [np.asarray(xs) for xs in load.seconds(*window) if xs]


def p99_ratio_interval(
    a: list[np.ndarray], b: list[np.ndarray], resamples: int = 1000, seed: int = 0
) -> list[float]:
    """[low, high]: the 95 % interval of p99(a) / p99(b) by a block bootstrap over seconds
    (each phase's seconds drawn with replacement, its p99 taken over the seconds drawn):
    how far one window's p99 ratio could move by chance. Seconds, not requests, are the
    blocks, so a slow moment (a publish, a swap) stays whole. A ratio whose interval holds
    the bound is not told apart from it by this run."""
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    for i in range(resamples):
        pa = np.percentile(np.concatenate([a[j] for j in rng.integers(0, len(a), len(a))]), 99)
        pb = np.percentile(np.concatenate([b[j] for j in rng.integers(0, len(b), len(b))]), 99)
        ratios[i] = pa / pb
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def freshness(p1: dict) -> dict[str, Any]:
    """Event → served per version published in phase 1, and the age of what served at each
    probe of phase 1 from the first of them on (before it, the age is that of the base
    published while the server started; after phase 1 no new rows come)."""
    first_seen: dict[str, float] = {}
    ages = []
    for at, version, event_time, age in p1["probe"].samples:
        if event_time < int(p1["replay_start"]) or at > p1["end"]:  # due times: whole seconds
            continue
        ages.append(age)
        first_seen.setdefault(version, at - event_time)
    return {"event_to_served_s": _percentiles(list(first_seen.values())),
            "served_age_s": _percentiles(ages), "versions_served": len(first_seen)}  # fmt: skip


def replay_rate(landed: list[tuple[float, int]]) -> float:
    """The rate the replay landed rows at: the rows of landings 1..N-1 over the time from
    landing 1 to landing N (landing 0 is the start's; partition i lands when the rows before it
    are due, so its own rows count towards the next interval). The replay's wall time over every
    row, as before 2026-12-07, counted the 0.5 s lead and the last partition's rows without
    their interval: 981K rows/s for a replay paced at, and landing on time at, 1M (H100)."""
    replayed = landed[1:]
    if len(replayed) < 2:
        return 0.0
    span = replayed[-1][0] - replayed[0][0]
    return sum(n for _, n in replayed[:-1]) / max(span, 1e-9)


def train_report(work: Path, p1: dict, lander: Lander) -> dict[str, Any]:
    start, end = p1["replay_start"], p1["caught_up_at"]
    stream = [r for r in records(work, "stream") if start <= r.get("at_unix", 0) <= end]
    busy = [r["rows_per_s"] for r in stream if r["rows_per_s"] > 0]
    landed = p1["landed_at"] - start
    return {
        "rows": p1["rows"],
        "replay_seconds": landed,
        "replay_rows_per_s": replay_rate(lander.landed),
        "landing_late_s": _percentiles(lander.late_s),
        "caught_up_after_last_landing_s": end - p1["landed_at"],
        "rows_per_s": _percentiles(busy),
        "lag_rows_max": max((r["lag_rows"] for r in stream), default=None),
        "lag_seconds": _percentiles([r["lag_seconds"] for r in stream if r["lag_seconds"]]),
        "stall_seconds": stream[-1]["stall_seconds"] if stream else None,
    }


def publish_report(work: Path) -> dict[str, Any]:
    done = records(work, "publish")
    return {
        "count": len(done),
        "kinds": [r["what"] for r in done],
        "publish_seconds": _percentiles([r["publish_seconds"] for r in done]),
        "export_seconds": _percentiles([r["export_seconds"] for r in done]),
        "stall_seconds": _percentiles([r["stall_seconds"] for r in done]),
        "delta_bytes": _percentiles([r["bytes"] for r in done if r["what"] == "delta"]),
    }
