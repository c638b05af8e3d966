"""Numbers and a plot from one load-test run: exact percentiles from the raw latencies, per-second
timelines, and locust's own CSV statistics."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from loadtest.latency import RawLatencies

PERCENTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0, "p99.9": 99.9}
TIMELINE_PERCENTILES = ("p50", "p95", "p99")


def latency_stats(raw: RawLatencies, num_candidates: int) -> dict[str, object]:
    """Counts, throughput and percentiles (ms) of the successful requests in ``raw``.

    Throughput is successes over the window from the first request's start to the last one's end.
    """
    n, ok = len(raw), int(raw.ok.sum())
    if n == 0:
        raise ValueError(
            f"no raw latencies recorded in {raw.files or 'the raw latency directory'}; run the "
            "load test (longer --duration) and check its locust log"
        )
    end_ns = raw.start_unix_ns + raw.latency_ns
    window_s = max(float(end_ns.max() - raw.start_unix_ns.min()) / 1e9, 1e-9)
    ms = raw.latency_ns[raw.ok] / 1e6
    qps = ok / window_s
    stats: dict[str, object] = {
        "requests": n,
        "failures": n - ok,
        "failure_rate": (n - ok) / n,
        "window_s": window_s,
        "qps": qps,
        "candidates_per_s": qps * num_candidates,
    }
    if ok:
        pct = np.percentile(ms, list(PERCENTILES.values()))
        lat: dict[str, float | None] = dict(zip(PERCENTILES, map(float, pct), strict=True))
        lat |= {"mean": float(ms.mean()), "min": float(ms.min()), "max": float(ms.max())}
    else:
        lat = dict.fromkeys([*PERCENTILES, "mean", "min", "max"], None)
    stats["latency_ms"] = lat
    return stats


def timeline(raw: RawLatencies, num_candidates: int) -> list[dict[str, float | None]]:
    """Per second of the run (by request start): requests/s, failures, p50/p95/p99 (ms)."""
    if len(raw) == 0:
        return []
    t0 = int(raw.start_unix_ns.min())
    end = float((raw.start_unix_ns + raw.latency_ns).max() - t0) / 1e9
    second = (raw.start_unix_ns - t0) // 1_000_000_000
    rows: list[dict[str, float | None]] = []
    for s in range(int(second.max()) + 1):
        sel = second == s
        ok = sel & raw.ok
        span = min(1.0, end - s)  # the last second may be partial
        qps = float(ok.sum()) / span if span > 0 else 0.0
        ms = raw.latency_ns[ok] / 1e6
        row: dict[str, float | None] = {
            "t_s": float(s),
            "requests": int(sel.sum()),
            "failures": int((sel & ~raw.ok).sum()),
            "qps": qps,
            "candidates_per_s": qps * num_candidates,
        }
        for name in TIMELINE_PERCENTILES:
            row[f"{name}_ms"] = float(np.percentile(ms, PERCENTILES[name])) if ms.size else None
        rows.append(row)
    return rows


def read_locust_csv(prefix: Path) -> dict[str, object]:
    """Locust's ``<prefix>_stats.csv`` rows by name (numbers parsed) and ``_failures.csv`` rows."""
    stats: dict[str, dict[str, object]] = {}
    stats_file = Path(f"{prefix}_stats.csv")
    if stats_file.exists():
        with open(stats_file, newline="") as f:
            for row in csv.DictReader(f):
                stats[row["Name"]] = {k: _number(v) for k, v in row.items()}
    failures = []
    failures_file = Path(f"{prefix}_failures.csv")
    if failures_file.exists():
        with open(failures_file, newline="") as f:
            failures = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return {"stats": stats, "failures": failures}


def plot(rows: list[dict[str, float | None]], path: Path, title: str, num_candidates: int) -> Path:
    """Latency percentiles over time (top) and throughput (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] for r in rows]
    fig, (ax_lat, ax_qps) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in TIMELINE_PERCENTILES:
        ms = [np.nan if r[f"{name}_ms"] is None else r[f"{name}_ms"] for r in rows]
        ax_lat.plot(t, ms, marker=".", label=name)
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_ylim(bottom=0)
    ax_lat.legend(loc="upper right")
    ax_lat.grid(alpha=0.3)
    ax_lat.set_title(title)
    ax_qps.plot(t, [r["qps"] for r in rows], marker=".", color="tab:green")
    ax_qps.set_ylabel("requests/s")
    ax_qps.set_xlabel("time since first request (s)")
    ax_qps.set_ylim(bottom=0)
    ax_qps.grid(alpha=0.3)
    cands = ax_qps.twinx()
    lo, hi = ax_qps.get_ylim()
    cands.set_ylim(lo * num_candidates, hi * num_candidates)
    cands.set_ylabel("candidates/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _number(v: str) -> object:
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v
